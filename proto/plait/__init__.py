"""plait.proto.plait: the `plait` protobuf package root (sources live at `plait/v1/*.proto`)."""

"""Trace requests as the daemon reads them: the OTLP request parsing the receiver and the ingest
workers share.

`trace_request_parser` is the receiver's gRPC deserializer and an ingest worker's reader alike:
the fast wire reader (`plait.daemon.otlp_wire`), else protobuf when that reader declines. What it
gives is a `TraceRequest`: the request's resources and spans as the decoder needs them, or, for
a request left to a worker, only its bytes. `attributes` turns OTLP key-values into a dict the
way the wire reader does.

This module imports neither the receiver (`plait.daemon.otlp`) nor the worker pool
(`plait.daemon.ingest_pool`): both import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from plait.daemon.ingest import DecodedResource
from plait.daemon.otlp_wire import Decline, TraceRequestReader, WireResource, WireSpan


def any_value(value: AnyValue) -> Any:
    """An OTLP `AnyValue` as a Python value."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, which)


def attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}


class TraceRequest:
    """A received trace request: its spans as the decoder needs them (or, from an ingest
    worker, already decoded; or, when `deferred`, only its bytes, for the receiver to hand to
    a worker), and the message itself (parsed from the bytes only when something needs it:
    forwarding upstream)."""

    __slots__ = ("_message", "_raw", "decoded", "deferred", "resources")

    def __init__(
        self,
        resources: list[WireResource],
        *,
        raw: bytes | None = None,
        message: trace_service_pb2.ExportTraceServiceRequest | None = None,
        decoded: list[DecodedResource] | None = None,
        deferred: bool = False,
    ) -> None:
        self.resources, self._raw, self._message = resources, raw, message
        self.decoded, self.deferred = decoded, deferred

    @property
    def raw(self) -> bytes:
        return self._raw if self._raw is not None else self.message.SerializeToString()

    @property
    def message(self) -> trace_service_pb2.ExportTraceServiceRequest:
        if self._message is None:
            self._message = trace_service_pb2.ExportTraceServiceRequest.FromString(self._raw or b"")
        return self._message

    @property
    def span_count(self) -> int:
        if self.decoded is not None:
            return sum(resource.span_count for resource in self.decoded)
        return sum(len(resource.spans) for resource in self.resources)

    @classmethod
    def from_message(cls, request: trace_service_pb2.ExportTraceServiceRequest) -> TraceRequest:
        """The message walk: what `TraceRequestReader` reads from the bytes, from the objects."""
        resources = []
        for resource_spans in request.resource_spans:
            resource = WireResource(attributes(resource_spans.resource.attributes))
            for s, scope_spans in enumerate(resource_spans.scope_spans):
                resource.spans.extend(
                    WireSpan(
                        s,
                        i,
                        span.name,
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        attributes(span.attributes),
                        span.status.code == Status.STATUS_CODE_ERROR,
                    )
                    for i, span in enumerate(scope_spans.spans)
                )
            resources.append(resource)
        return cls(resources, message=request)


def trace_request_parser(
    reader: TraceRequestReader | None = None, defer: Callable[[bytes], bool] | None = None
) -> Callable[[bytes], Any]:
    """The receiver's request deserializer: the fast reader, else protobuf (which raises
    `DecodeError` for malformed bytes, answered INVALID_ARGUMENT by the call guard).

    A request `defer` says yes to is left as bytes (`TraceRequest.deferred`) for the receiver
    to hand to an ingest worker: gRPC calls the deserializer on its one polling thread, so
    whatever it does happens one request at a time; the receiver runs on the handler threads,
    several at once."""
    reader = reader or TraceRequestReader()

    def parse(data: bytes) -> TraceRequest:
        if defer is not None and defer(data):
            return TraceRequest([], raw=data, deferred=True)
        try:
            return TraceRequest(reader.read(data), raw=data)
        except Decline:
            message = trace_service_pb2.ExportTraceServiceRequest.FromString(data)
            return TraceRequest.from_message(message)

    return parse

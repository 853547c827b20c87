"""The daemon's live web page (`plait daemon --web HOST:PORT`).

One more translation of the analysis layer, beside the gRPC servicer and the Prometheus
endpoint: `page_data` asks the daemon's own services in-process and builds the documents that
`plait top --json` and `plait bottleneck --json` print, with the functions that print them;
`live` pushes them to every open page as server-sent events; `http` serves the page, its bundled
assets (`static/`, uPlot from npm, nothing fetched at run time) and the operator actions
(`actions`: profile, memory, stacks); `sessions` keeps the daemon's token out of every URL.
"""

"""The page of a job of 1,024 ranks (8 nodes of 128) in headless Chromium: its top suspects
first, never a row per rank; the job's step times drawn as a histogram and summed up per node,
the slowest node first — each figure as the daemon computed it.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from plait.daemon.server import DaemonServer
from plait.tools.bench.fleet import steps_request
from tests.daemon.test_web_page_browser import browser as browser  # the fixture, by name
from tests.daemon.test_web_page_browser import pytestmark as pytestmark
from tests.daemon.test_web_page_browser import until

NODES, PER_NODE = 8, 128
WORLD = NODES * PER_NODE
SLOW_RANK = 5 * PER_NODE + 77  # on node 5
STEPS = 4

READ = """
const section = document.querySelector("section.job");
if (!section) return null;
const rows = (selector) => [...section.querySelectorAll(selector + " tbody tr")];
return {
  total: section.dataset.ranksTotal,
  note: section.querySelector(".shown-note").textContent,
  breakdown: rows(".breakdown").map((r) => Number(r.dataset.rank)),
  stragglers: rows(".stragglers").map((r) => Number(r.dataset.rank)),
  mfu: rows(".mfu-now").length,
  nodesHidden: section.querySelector(".nodes").hidden,
  nodes: rows(".node-steps").map((r) => [r.dataset.host, Number(r.dataset.slowestRank)]),
  counts: section.querySelector(".step-histogram").getAttribute("data-counts"),
  renderMs: Number(document.body.dataset.renderMs),
  rows: document.querySelectorAll("tr").length,
};
"""


def _feed(daemon: DaemonServer) -> None:
    """`STEPS` steps of every rank, one request per step holding every rank's spans."""
    with grpc.insecure_channel(daemon.address) as channel:
        export = trace_service_pb2_grpc.TraceServiceStub(channel)
        for step in range(STEPS):
            request = trace_service_pb2.ExportTraceServiceRequest()
            for rank in range(WORLD):
                one = steps_request(rank, WORLD, f"node{rank // PER_NODE}", step, rank == SLOW_RANK)
                request.resource_spans.extend(one.resource_spans)
            export.Export(request, timeout=60)


@pytest.mark.timeout(300)
def test_a_thousand_ranks_show_their_suspects_a_histogram_and_the_nodes(browser: Any) -> None:
    with DaemonServer(
        "127.0.0.1:0", web="127.0.0.1:0", web_interval=1.0, max_message_bytes=64 * 2**20
    ) as daemon:
        _feed(daemon)
        assert daemon.web is not None
        browser.get(daemon.web.url)
        page = until(
            browser,
            lambda d: (r := d.execute_script(READ)) and r["total"] == str(WORLD) and r["counts"]
            and r,
            "the 1,024-rank job",
        )  # fmt: skip
        assert page["note"] == f"; the 32 slowest of {WORLD} ranks"
        assert len(page["breakdown"]) == len(page["stragglers"]) == 32
        assert page["breakdown"][0] == page["stragglers"][0] == SLOW_RANK
        assert page["mfu"] == 33  # the job and its 32 slowest ranks
        assert not page["nodesHidden"]
        assert page["nodes"][0] == ["node5", SLOW_RANK]
        assert len(page["nodes"]) == NODES
        counts = [int(c) for c in page["counts"].split(",")]
        assert sum(counts) == WORLD and counts[-1] == 1  # the slow rank alone in the top bin
        assert page["rows"] < 200, page["rows"]  # never a row per rank
        # Drawn well within the refresh: the page keeps up with a push a second.
        assert page["renderMs"] < 1000, page["renderMs"]

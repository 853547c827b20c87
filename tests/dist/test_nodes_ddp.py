"""Data parallelism on 2 nodes x 2 ranks: hierarchical all-reduce trains as flat DDP and as one
process does, and the bytes each rank sends inside and across nodes are the formulas'
(plait.core.link_bytes) in the spans and in `plait top --json`."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from plait.daemon import telemetry_schema as names
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.testing.distributed import run_distributed
from plait.tools.daemon_commands import app
from tests.dist import nodes_workers
from tests.dist.nodes_workers import STEPS

pytestmark = pytest.mark.dist

LOSS_TOL = 1e-5
PARAM_TOL = 2e-5
RUNS = {"flat": "torch", "hierarchical": ""}  # "": the default choice on 2 x 2


def span_bytes(stub: Any, job_id: str) -> dict[tuple[int, int, str], list[int]]:
    """(rank, step, purpose) -> [intra, inter] summed over the backend-carried comm spans."""
    import grpc  # noqa: F401  (the stub's channel is open)

    trace = stub.CaptureTrace(daemon_pb2.CaptureTraceRequest(seconds=0, job_id=job_id))
    sums: dict[tuple[int, int, str], list[int]] = defaultdict(lambda: [0, 0])
    for event in json.loads(trace.chrome_trace_json)["traceEvents"]:
        args = event.get("args", {})
        if event.get("ph") != "X" or names.SPAN_COMM_OP not in args:
            continue
        if args.get(names.SPAN_COMM_ALGORITHM) != names.COMM_ALGORITHM_BACKEND:
            continue
        key = (event["pid"], args[names.SPAN_STEP], args[names.SPAN_COMM_PURPOSE])
        sums[key][0] += args[names.SPAN_COMM_BYTES_INTRA_NODE]
        sums[key][1] += args[names.SPAN_COMM_BYTES_INTER_NODE]
    return sums


def top_json(address: str, job_id: str) -> dict[str, Any]:
    result = CliRunner().invoke(
        app, ["top", "--json", "--host", address, "--job", job_id, "--window-steps", str(STEPS)]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.timeout(400)
def test_ddp_on_two_nodes_flat_and_hierarchical() -> None:
    with DaemonServer("127.0.0.1:0", host_interval=0.2) as daemon:
        ranks = run_distributed(
            nodes_workers.train_as_nodes, 4, 2, RUNS, daemon.address, timeout=300
        )
        (single,) = run_distributed(
            nodes_workers.train_as_nodes, 1, 0, {"one": "torch"}, "", timeout=120
        )
        reference = single["one"]
        for rank, result in enumerate(ranks):
            for job in RUNS:
                got = result[job]
                assert got["host_map"].startswith("2 × 2 ranks (node0: ranks 0-1")
                torch.testing.assert_close(
                    torch.tensor(got["losses"]), torch.tensor(reference["losses"]),
                    rtol=0, atol=LOSS_TOL, msg=lambda m, j=job: f"{j} losses: {m}",
                )  # fmt: skip
                torch.testing.assert_close(
                    got["parameters"], reference["parameters"], rtol=0, atol=PARAM_TOL,
                    msg=lambda m, j=job, r=rank: f"{j} parameters, rank {r}: {m}",
                )  # fmt: skip
            torch.testing.assert_close(
                result["hierarchical"]["parameters"], result["flat"]["parameters"],
                rtol=0, atol=PARAM_TOL,
            )  # fmt: skip

        # B: the model's gradient bytes; every tensor's length divides by 4 (and so does every
        # bucket's), so the formulas' chunks are whole and these are exact integers.
        B = ranks[0]["flat"]["gradient_bytes"]
        assert all(n % 4 == 0 for n in ranks[0]["flat"]["numels"])
        flat_inter = {0: 0, 1: 3 * B // 2, 2: 0, 3: 3 * B // 2}  # 2·(n−1)/n·B on a crossing hop
        channel_stub = daemon_pb2_grpc.DaemonStub(_channel(daemon.address))
        for job in RUNS:
            sums = span_bytes(channel_stub, job)
            for rank in range(4):
                for step in range(STEPS):
                    if job == "flat":
                        intra, inter = sums[(rank, step, "grad_bucket")]
                        assert (intra, inter) == (3 * B // 2 - flat_inter[rank], flat_inter[rank])
                    else:
                        # B/2 reduce-scatter + B/2 all-gather inside, (B/2)·2·(2−1)/2 across.
                        intra, inter = sums[(rank, step, "hierarchical/grad_bucket")]
                        assert (intra, inter) == (B, B // 2), (rank, step)
                        assert (rank, step, "grad_bucket") not in sums  # not counted twice
            document = top_json(daemon.address, job)
            expected_job = [0, 0]
            for row in document["ranks"]:
                totals = [0, 0]
                for (rank, _, _), (intra, inter) in sums.items():
                    if rank == row["rank"]:
                        totals[0] += intra
                        totals[1] += inter
                want = {"intra_node": totals[0] // STEPS, "inter_node": totals[1] // STEPS}
                assert row["comm_bytes_per_step"] == want, (job, row["rank"])
                expected_job[0] += want["intra_node"]
                expected_job[1] += want["inter_node"]
            (job_row,) = document["jobs"]
            assert job_row["comm_bytes_per_step"] == {
                "intra_node": expected_job[0],
                "inter_node": expected_job[1],
            }
            # The gradients dominate; the rest (loss, token counts) is a few scalars.
            gradient_inter = 3 * B if job == "flat" else 2 * B
            assert 0 <= expected_job[1] - gradient_inter < 1024


def _channel(address: str) -> Any:
    import grpc

    return grpc.insecure_channel(address)

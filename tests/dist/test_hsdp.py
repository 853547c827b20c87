"""HSDP (`parallel.dp_shard`) on 2 nodes x 2 ranks: ZeRO-3 (and ZeRO-1/2) sharded inside each
node and replicated across trains as one process does; the bytes each rank sends inside and across
nodes are `plait.plugins.collectives.step_bytes.sharded_step_bytes`' in the spans; the replica
all-reduce runs once per step, not per micro-batch; a shard group that spans nodes is refused by name."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.daemon import telemetry_schema as names
from plait.daemon.server import DaemonServer
from plait.plugins.collectives.step_bytes import sharded_step_inter_node
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.testing.distributed import run_distributed
from tests.dist import hsdp_workers
from tests.dist.hsdp_workers import STEPS

pytestmark = pytest.mark.dist

LOSS_TOL = 1e-5
PARAM_TOL = 2e-5
SHARDED = ("param_gather", "grad_bucket", "grad_shard")
RS = {"gradient_reduction": "reduce_scatter"}  # the GPU path, the formulas' reduce-scatter
JOBS: dict[str, dict[str, Any]] = {
    "flat": {"parallel": {"dp_strategy": "zero3"}, "zero": RS, "comm": {"algorithm": "torch"}},
    "hierarchical": {
        "parallel": {"dp_strategy": "zero3"},
        "zero": RS,
        "comm": {"algorithm": "hierarchical"},
    },
    "hsdp": {"parallel": {"dp_strategy": "zero3", "dp_shard": 2}, "zero": RS},
    # Gloo's default reduction (a summing all-reduce inside the node) with dp_shard = "node".
    "hsdp_node": {"parallel": {"dp_strategy": "zero3", "dp_shard": "node"}},
    "zero1_node": {"parallel": {"dp_strategy": "zero1", "dp_shard": "node"}},
    "zero2_node": {"parallel": {"dp_strategy": "zero2", "dp_shard": "node"}},
    # The optimizer state sharded over all four ranks (stage 2 on the reduce-scatter path).
    "zero1_optim": {
        "parallel": {"dp_strategy": "zero1", "dp_shard": "node"},
        "zero": {"shard_optimizer_across_replicas": True},
    },
    "zero2_optim": {
        "parallel": {"dp_strategy": "zero2", "dp_shard": "node"},
        "zero": {**RS, "shard_optimizer_across_replicas": True},
    },
}
ACROSS = ("zero1_optim", "zero2_optim")
SPLIT = ("hsdp", "hsdp_node", "zero1_node", "zero2_node", *ACROSS)


def comm_spans(address: str, job_id: str) -> dict[tuple[int, int, str], list[int]]:
    """(rank, step, purpose) -> [intra, inter, count] over the backend-carried comm spans; a
    purpose is named without the algorithm that issued it ("hierarchical/grad_bucket")."""
    import grpc

    stub = daemon_pb2_grpc.DaemonStub(grpc.insecure_channel(address))
    trace = stub.CaptureTrace(daemon_pb2.CaptureTraceRequest(seconds=0, job_id=job_id))
    sums: dict[tuple[int, int, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for event in json.loads(trace.chrome_trace_json)["traceEvents"]:
        args = event.get("args", {})
        if event.get("ph") != "X" or names.SPAN_COMM_OP not in args:
            continue
        if args.get(names.SPAN_COMM_ALGORITHM) != names.COMM_ALGORITHM_BACKEND:
            continue
        if names.SPAN_STEP not in args:  # the start's parameter broadcast
            continue
        purpose = args[names.SPAN_COMM_PURPOSE].split("/")[-1]
        key = (event["pid"], args[names.SPAN_STEP], purpose)
        sums[key][0] += args[names.SPAN_COMM_BYTES_INTRA_NODE]
        sums[key][1] += args[names.SPAN_COMM_BYTES_INTER_NODE]
        sums[key][2] += 1
    return sums


@pytest.mark.timeout(500)
def test_hsdp_on_two_nodes_trains_as_one_process_and_sends_the_formulas_bytes() -> None:
    with DaemonServer("127.0.0.1:0", host_interval=0.2) as daemon:
        ranks = run_distributed(hsdp_workers.train_jobs, 4, 2, JOBS, daemon.address, timeout=400)
        (single,) = run_distributed(hsdp_workers.train_jobs, 1, 0, {"one": {}}, "", timeout=120)
        reference = single["one"]
        for rank, result in enumerate(ranks):
            for job in JOBS:
                got = result[job]
                torch.testing.assert_close(
                    torch.tensor(got["losses"]), torch.tensor(reference["losses"]),
                    rtol=0, atol=LOSS_TOL, msg=lambda m, j=job: f"{j} losses: {m}",
                )  # fmt: skip
                # The norm counts each shard once although every replica holds it.
                torch.testing.assert_close(
                    torch.tensor(got["grad_norms"]), torch.tensor(reference["grad_norms"]),
                    rtol=1e-5, atol=0, msg=lambda m, j=job: f"{j} gradient norms: {m}",
                )  # fmt: skip
                torch.testing.assert_close(
                    got["parameters"], reference["parameters"], rtol=0, atol=PARAM_TOL,
                    msg=lambda m, j=job, r=rank: f"{j} parameters, rank {r}: {m}",
                )  # fmt: skip
            # dp_shard = 2 and "node" split dp alike: shard inside the node, replicas across.
            for job in SPLIT:
                got = result[job]
                node_first = rank - rank % 2
                assert got["shard_group"] == (node_first, node_first + 1), (job, rank)
                assert got["replica_group"] == (rank % 2, rank % 2 + 2), (job, rank)
                assert got["coordinates"]["dp_replicate"] == rank // 2
                assert got["coordinates"]["dp_shard"] == rank % 2
            assert result["flat"]["shard_group"] == (0, 1, 2, 3)
            assert "dp_shard" not in result["flat"]["coordinates"]  # unset: as before

        job_inter: dict[str, int] = {}
        for job in JOBS:
            sums = comm_spans(daemon.address, job)
            job_inter[job] = 0
            for rank, result in enumerate(ranks):
                got = result[job]
                for step in range(STEPS):
                    spans = [sums.get((rank, step, p), [0, 0, 0]) for p in SHARDED]
                    intra, inter = (sum(s[i] for s in spans) for i in (0, 1))
                    if got["expected"][0] is not None and job != "hsdp_node":
                        assert (intra, inter) == tuple(got["expected"]), (job, rank, step)
                    else:
                        # Gloo's all-reduce path (and stages 1 and 2) stay inside the node:
                        # only the replicas' all-reduce crosses.
                        assert inter == got["expected"][1], (job, rank, step)
                    _, shard_inter, shard_ops = spans[2]
                    if job in ACROSS:
                        # Once per step: a reduce-scatter per bucket across the replicas, and
                        # the all-gather of its updated sub-chunk back, as many bytes each.
                        assert shard_ops == got["units"], (job, rank, step)
                        assert 2 * shard_inter == inter > 0, (job, rank, step)
                    elif job in SPLIT:
                        # Once per step (2 micro-batches): one all-reduce per unit (stage 3) or
                        # bucket (stages 1, 2), all across.
                        assert shard_ops == got["units"], (job, rank, step)
                        assert shard_inter == inter > 0
                    else:
                        assert shard_ops == 0
                    job_inter[job] += inter
        B, M = ranks[0]["flat"]["model_bytes"], ranks[0]["flat"]["microbatches"]
        assert M == 2
        per_step = {job: total // STEPS for job, total in job_inter.items()}
        # HSDP: 2·B per step across nodes on 2 x 2, whatever the micro-batch count.
        assert per_step["hsdp"] == per_step["hsdp_node"] == 2 * B
        assert per_step["hsdp"] == sharded_step_inter_node(
            B, nodes=2, ranks_per_node=2, microbatches=M, layout="hsdp"
        )
        # Flat ZeRO-3 pays 4.5·B per micro-batch (3·B hierarchically), less the second gather
        # of the units kept gathered from forward to backward.
        for job, layout in (("flat", "flat"), ("hierarchical", "hierarchical")):
            bound = sharded_step_inter_node(
                B, nodes=2, ranks_per_node=2, microbatches=M, layout=layout
            )
            assert bound * 2 / 3 < per_step[job] < bound, (job, per_step[job], bound)
        # ZeRO-1/2 with the optimizer state across the replicas: the 2·B of HSDP, whose
        # all-reduce became a reduce-scatter and an all-gather; the state is half as large.
        for job, peer in (("zero1_optim", "zero1_node"), ("zero2_optim", "zero2_node")):
            B_buckets = ranks[0][job]["model_bytes"]
            assert per_step[job] == 2 * B_buckets, (job, per_step[job], B_buckets)
            assert per_step[peer] == 2 * ranks[0][peer]["model_bytes"], peer
            for result in ranks:
                held, replicated = result[job]["optimizer_state"], result[peer]["optimizer_state"]
                assert 0.45 * replicated < held < 0.55 * replicated, (job, held, replicated)
                # Gathered from four shards, the state is the one gathered from two.
                torch.testing.assert_close(
                    result[job]["moments"], result[peer]["moments"], rtol=0, atol=1e-6
                )
        print("cross-node bytes per step:", per_step, "B =", B)


@pytest.mark.timeout(200)
def test_a_shard_group_across_nodes_is_refused_by_name() -> None:
    # 4 nodes of one rank: dp_shard = 2 would shard across two nodes.
    errors = run_distributed(hsdp_workers.refused_split, 4, 4, 2, timeout=150)
    for error in errors:
        assert "dp_shard" in error and "set parallel.dp_shard to at most 1" in error, error


@pytest.mark.timeout(400)
def test_hsdp_checkpoint_is_written_by_one_replica_and_resumes_flat_and_in_one_process(
    tmp_path: Path,
) -> None:
    # Two checkpoints per spawn: ZeRO-3 under HSDP, and ZeRO-2 under HSDP with the optimizer
    # state sharded across the replicas (every rank then holds a piece no other rank has).
    hsdp_dir, across_dir = str(tmp_path / "hsdp"), str(tmp_path / "across")
    save: dict[str, Any] = {"stop_at": 5, "save_at": (3,), "resume": False}
    resume: dict[str, Any] = {"stop_at": 5, "save_at": (), "resume": True, "parallel": {}}
    across = {"shard_optimizer_across_replicas": True}
    written = run_distributed(
        hsdp_workers.checkpoint_rounds,
        4,
        (
            {"ckpt_dir": hsdp_dir, "parallel": {"dp_shard": 2}, **save},
            {"ckpt_dir": across_dir, "parallel": {"dp_shard": 2}, "dp_strategy": "zero2",
             "zero": across, **save},
        ),
        timeout=300,
    )  # fmt: skip
    flat = run_distributed(
        hsdp_workers.checkpoint_rounds,
        4,
        (
            {"ckpt_dir": hsdp_dir, **resume},
            {"ckpt_dir": across_dir, "dp_strategy": "zero2", **resume},  # flat ZeRO-2
        ),
        timeout=300,
    )
    (one,) = run_distributed(hsdp_workers.resume_each, 1, (hsdp_dir, across_dir), timeout=120)
    hsdp = [rounds[0] for rounds in written]
    # The first replica (ranks 0 and 1, one node) writes the shards; the second writes nothing.
    assert [r["replicated_over"] for r in hsdp] == [[("dp_replicate",)]] * 4
    assert hsdp[0]["written"] > 0 and hsdp[1]["written"] > 0
    assert hsdp[2]["written"] == hsdp[3]["written"] == 0
    # Across the replicas every rank writes its own sub-chunk of the optimizer state.
    assert all(rounds[1]["written"] > 0 for rounds in written)
    assert all(r[0]["written"] > 0 for r in flat)  # flat ZeRO-3: every rank holds its own shard
    for index, name in enumerate(("hsdp", "optimizer across replicas")):
        writer = written[0][index]
        for resumed in (*(r[index] for r in flat), one[index]):
            assert resumed["start"] == 3, name
            # Step 3's loss reads the parameters, step 4's also the optimizer state's update.
            for step in (3, 4):
                assert resumed["losses"][step] == pytest.approx(
                    writer["losses"][step], abs=LOSS_TOL
                ), (name, step)

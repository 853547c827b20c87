"""Bottleneck breakdown, straggler scores and hang detection against hand-computed answers."""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from plait.daemon import telemetry_schema as names
from plait.daemon.bottleneck import (
    RankContext,
    StepSpan,
    advice,
    job_dominant,
    merge,
    rank_breakdown,
    step_breakdown,
    subtract,
)
from plait.daemon.hangs import Heartbeat, InflightOp, find_hangs, merge_hangs
from plait.daemon.stragglers import RankTiming, score_ranks
from plait.proto.plait.v1 import daemon_pb2

MS = 1_000_000
BASE = 1_700_000_000 * 10**9


def phase(name: str, start: int, end: int) -> StepSpan:
    return StepSpan("phase", name, BASE + start * MS, BASE + end * MS)


def comm(
    purpose: str, start: int, end: int, *, blocking: bool, nbytes: int = 0, op: str = "all_reduce"
) -> StepSpan:
    return StepSpan("comm", op, BASE + start * MS, BASE + end * MS, purpose, blocking, nbytes)


# A data-parallel step of 100 ms (times in ms):
#   data 0-10 | forward 10-40 (a blocking metrics all-reduce 30-35 inside) | backward 40-80
#   | sync_gradients 80-92 | optimizer 92-98 (a blocking grad-norm all-reduce 93-94)
#   an async gradient bucket all-reduce runs 60-90: 20 ms hidden under backward, 10 exposed.
DP_STEP = [
    phase("data", 0, 10),
    phase("forward", 10, 40),
    phase("backward", 40, 80),
    phase("sync_gradients", 80, 92),
    phase("optimizer", 92, 98),
    comm("metrics", 30, 35, blocking=True),
    comm("grad_bucket", 60, 90, blocking=False, nbytes=4 * 2**20),
    comm("grad_norm", 93, 94, blocking=True),
]
DP_EXPECTED = {
    "compute": 0.065,  # 30 + 40 - 5 (the blocking all-reduce stalls forward)
    "exposed_comm": 0.016,  # 5 (metrics) + 10 (bucket tail 80-90) + 1 (grad norm)
    "data": 0.010,
    "pipeline_bubble": 0.0,
    "optimizer": 0.005,  # 6 - 1 (grad norm is communication)
    "host_other": 0.004,  # 90-92 inside sync_gradients and 98-100
}


def test_interval_arithmetic() -> None:
    assert merge([(5, 7), (0, 2), (1, 3), (7, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert subtract([(0, 10), (20, 30)], [(2, 4), (8, 22), (25, 26)]) == [
        (0, 2),
        (4, 8),
        (22, 25),
        (26, 30),
    ]


def test_data_parallel_step_breakdown_matches_hand_computation() -> None:
    result = step_breakdown(0, BASE, BASE + 100 * MS, DP_STEP)
    assert result.seconds == pytest.approx(DP_EXPECTED, abs=1e-12)
    assert sum(result.seconds.values()) == pytest.approx(0.1)
    assert result.comm_seconds == pytest.approx(0.036)  # 5 + 30 + 1, overlapped or not
    assert result.exposed_comm_by_purpose == pytest.approx(
        {"metrics": 0.005, "grad_bucket": 0.010, "grad_norm": 0.001}
    )
    summary = rank_breakdown([result, result])
    assert summary.dominant == "compute"
    assert summary.median_compute_seconds == pytest.approx(0.065)


def test_pipeline_step_is_bubble_bound_with_schedule_advice() -> None:
    # forward 0-10, waits on recv 10-50 (its recv op inside), idle 50-60, backward 60-90,
    # gradient sync 90-95 with the bucket all-reduce 85-95, optimizer 95-100.
    spans = [
        phase("forward", 0, 10),
        phase("recv", 10, 50),
        StepSpan("comm", "recv", BASE + 10 * MS, BASE + 50 * MS, "activation", False),
        phase("idle", 50, 60),
        phase("backward", 60, 90),
        phase("sync_gradients", 90, 95),
        comm("grad_bucket", 85, 95, blocking=False),
        phase("optimizer", 95, 100),
    ]
    result = step_breakdown(3, BASE, BASE + 100 * MS, spans)
    assert result.seconds == pytest.approx(
        {
            "compute": 0.040,
            "pipeline_bubble": 0.050,
            "exposed_comm": 0.005,
            "data": 0.0,
            "optimizer": 0.005,
            "host_other": 0.0,
        },
        abs=1e-12,
    )
    summary = rank_breakdown([result])
    assert summary.dominant == "pipeline_bubble"
    text = advice(summary, RankContext(degrees={"pp": 4}))
    assert "pp=4" in text and "(p-1)/(m+p-1) = 75%" in text and "micro-batch" in text


def test_exposed_gradient_sync_advice_names_buckets() -> None:
    spans = [
        phase("forward", 0, 10),
        phase("backward", 10, 30),
        phase("sync_gradients", 30, 90),
        comm("grad_bucket", 30, 90, blocking=False, nbytes=2**20),
        phase("optimizer", 90, 95),
    ]
    summary = rank_breakdown([step_breakdown(0, BASE, BASE + 100 * MS, spans)])
    assert summary.dominant == "exposed_comm"
    text = advice(summary, RankContext(comm_bytes_by_purpose={"grad_bucket": (8, 2**20)}))
    assert "8 buckets of ~1.00 MiB" in text and "bucket" in text and "overlap" in text


@pytest.mark.parametrize(
    ("purpose", "expected"),
    [("cp_kv", "context parallelism (cp=4)"), ("moe_dispatch", "expert-parallel all-to-alls")],
)
def test_exposed_context_and_expert_traffic_gets_its_own_advice(
    purpose: str, expected: str
) -> None:
    spans = [
        phase("forward", 0, 60),
        comm(purpose, 10, 60, blocking=True, nbytes=2**20),
        phase("backward", 60, 90),
        phase("optimizer", 90, 95),
    ]
    summary = rank_breakdown([step_breakdown(0, BASE, BASE + 100 * MS, spans)])
    assert summary.dominant == "exposed_comm"
    assert expected in advice(summary, RankContext(degrees={"cp": 4}))


# --------------------------------------------------------------------------------------------
# advice fits the device and the run
# --------------------------------------------------------------------------------------------

COMPUTE_BOUND = [phase("forward", 0, 40), phase("backward", 40, 90), phase("optimizer", 90, 95)]


@pytest.mark.parametrize(
    ("device", "dtype", "triton", "bf16"),
    [
        ("cpu", "float32", False, False),  # Triton needs a GPU; bf16 is slower on CPUs
        ("cuda:0", "float32", True, True),
        ("cuda:1", "bfloat16", True, False),  # already computes in bf16
    ],
)
def test_compute_advice_only_names_what_helps_on_the_device(
    device: str, dtype: str, triton: bool, bf16: bool
) -> None:
    summary = rank_breakdown([step_breakdown(0, BASE, BASE + 100 * MS, COMPUTE_BOUND)])
    assert summary.dominant == "compute"
    text = advice(summary, RankContext(device=device, compute_dtype=dtype))
    assert ("Triton" in text) is triton and ("bf16" in text) is bf16, text
    assert "micro-batches" in text


def tp_bound_step(ops: tuple[str, ...]) -> list[StepSpan]:
    """A forward stalled by synchronous tensor-parallel collectives of the given ops."""
    spans = [phase("forward", 0, 80), phase("backward", 80, 90), phase("optimizer", 90, 95)]
    for i, op in enumerate(ops):  # 70 of forward's 80 ms are spent in the collectives
        spans.append(comm("tp_activation", 5 + 37 * i, 40 + 37 * i, blocking=True, op=op))
    return spans


@pytest.mark.parametrize(
    ("ops", "suggests_sp"),
    [
        (("all_reduce", "all_reduce"), True),  # Megatron f/g without sequence parallel
        (("all_gather", "reduce_scatter"), False),  # sequence parallel is on
    ],
)
def test_tensor_parallel_advice_never_suggests_sequence_parallel_when_on(
    ops: tuple[str, ...], suggests_sp: bool
) -> None:
    summary = rank_breakdown([step_breakdown(0, BASE, BASE + 100 * MS, tp_bound_step(ops))])
    assert summary.dominant == "exposed_comm"
    assert summary.comm_ops_by_purpose == {"tp_activation": frozenset(ops)}
    text = advice(summary, RankContext(degrees={"tp": 2}, device="cuda:0"))
    assert ("sequence parallel" in text) is suggests_sp, text
    assert "tp=2" in text and "NVLink" in text
    assert "NVLink" not in advice(summary, RankContext(degrees={"tp": 2}, device="cpu"))


def test_job_advice_quotes_the_per_rank_figure_the_table_shows() -> None:
    # Two ranks each exposing 60 ms of gradient sync per step: the job's advice says 60, the
    # figure in each rank's row, not 120 (two ranks waiting at once is not twice the wait).
    spans = [
        phase("forward", 0, 10),
        phase("backward", 10, 30),
        comm("grad_bucket", 30, 90, blocking=False, nbytes=2**20),
        phase("optimizer", 90, 95),
    ]
    rank = rank_breakdown([step_breakdown(0, BASE, BASE + 100 * MS, spans)])
    job = job_dominant([rank, rank])
    assert job.seconds == pytest.approx(rank.seconds)
    assert job.step_seconds == pytest.approx(0.1)
    text = advice(job)
    assert "60.0 ms/step per rank" in text and "120.0" not in text


def test_optimizer_advice_offers_zero_only_where_it_can_help() -> None:
    def optimizer_bound(*extra: StepSpan) -> str:
        spans = [phase("forward", 0, 10), phase("backward", 10, 20), phase("optimizer", 20, 95)]
        summary = rank_breakdown([step_breakdown(0, BASE, BASE + 100 * MS, [*spans, *extra])])
        assert summary.dominant == "optimizer"
        return advice(summary, RankContext(degrees={"dp": 2}))

    assert "ZeRO" in optimizer_bound()
    # ZeRO's parameter all-gather after the step: optimizer state is sharded already.
    assert "ZeRO" not in optimizer_bound(
        comm("param_gather", 95, 97, blocking=False, op="all_gather")
    )
    summary = rank_breakdown(
        [step_breakdown(0, BASE, BASE + 100 * MS, [phase("optimizer", 0, 95)])]
    )
    assert "ZeRO" not in advice(summary, RankContext(degrees={"dp": 1}))  # nothing to shard over


def test_gradient_advice_skips_compression_when_an_algorithm_already_runs_the_buckets() -> None:
    def grad_bound(purpose: str) -> str:
        spans = [
            phase("forward", 0, 10),
            phase("backward", 10, 30),
            comm(purpose, 30, 90, blocking=False, nbytes=2**20),
        ]
        return advice(rank_breakdown([step_breakdown(0, BASE, BASE + 100 * MS, spans)]))

    assert "compress gradients" in grad_bound("grad_bucket")
    text = grad_bound("powersgd/grad_bucket")
    assert "compress gradients" not in text and "'powersgd'" in text


def test_breakdown_through_the_daemon_matches_hand_computation(daemon_server, daemon_stub) -> None:
    """The same step sent as OTLP spans: the daemon's GetBottleneck gives the same numbers."""
    resource = Resource.create({names.RESOURCE_JOB_ID: "synthetic", names.RESOURCE_RANK: 0,
                                names.RESOURCE_WORLD_SIZE: 1})  # fmt: skip
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=daemon_server.address, insecure=True, timeout=5)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    for step in range(2):
        offset = step * 100 * MS
        for span in DP_STEP:
            attributes: dict[str, object] = {names.SPAN_STEP: step}
            if span.kind == "phase":
                attributes[names.SPAN_PHASE] = span.name
            else:
                attributes |= {
                    names.SPAN_COMM_OP: span.name,
                    names.SPAN_COMM_PURPOSE: span.purpose,
                    names.SPAN_COMM_ASYNC: not span.blocking,
                    names.SPAN_COMM_BYTES: span.nbytes,
                }
            tracer.start_span(span.name, start_time=span.start_ns + offset,
                              attributes=attributes).end(end_time=span.end_ns + offset)  # fmt: skip
        step_attributes = {names.SPAN_STEP: step, names.SPAN_STEP_MODEL_FLOPS: 1e9}
        tracer.start_span("step", start_time=BASE + offset, attributes=step_attributes).end(
            end_time=BASE + offset + 100 * MS
        )
    provider.shutdown()
    response = daemon_stub.GetBottleneck(daemon_pb2.GetBottleneckRequest(job_id="synthetic"))
    (rank,) = response.ranks
    assert rank.steps == 2 and rank.dominant == "compute" and response.dominant == "compute"
    got = {
        "compute": rank.compute_seconds,
        "exposed_comm": rank.exposed_comm_seconds,
        "data": rank.data_wait_seconds,
        "pipeline_bubble": rank.pipeline_bubble_seconds,
        "optimizer": rank.optimizer_seconds,
        "host_other": rank.host_other_seconds,
    }
    assert got == pytest.approx(DP_EXPECTED, abs=1e-9)
    assert dict(rank.exposed_comm_by_purpose) == pytest.approx(
        {"metrics": 0.005, "grad_bucket": 0.010, "grad_norm": 0.001}, abs=1e-9
    )
    assert "compute-bound" in response.advice


def test_straggler_scores_against_the_job_median() -> None:
    def timing(rank: int, step: float, compute: float, job: str = "j") -> RankTiming:
        return RankTiming(job, rank, "h", 10, step, compute)

    # Synchronous training: step times equal, rank 2 computes 60% longer than the median.
    scores = score_ranks(
        [timing(0, 1.0, 0.50), timing(1, 1.0, 0.52), timing(2, 1.0, 0.80), timing(3, 1.0, 0.48),
         timing(0, 2.0, 1.0, job="alone")],
        threshold=0.2,
    )  # fmt: skip
    by_rank = {(s.timing.job_id, s.timing.rank): s for s in scores}
    assert [r for (job, r), s in sorted(by_rank.items()) if s.flagged] == [2]
    assert by_rank[("j", 2)].compute_score == pytest.approx(0.80 / 0.51 - 1)
    assert by_rank[("j", 2)].step_score == 0.0
    assert not by_rank[("alone", 0)].flagged  # a single rank has no peers


def test_hang_reports_missing_and_unreported_ranks() -> None:
    now = time.time_ns()
    group = ("dp", (0, 1, 2))
    stuck = InflightOp("dp", (0, 1, 2), "all_reduce", 7, "grad_bucket", now - 5 * 10**9)
    beats = {
        ("job", -1, 0): Heartbeat(now, (stuck,), {group: 7}),
        ("job", -1, 1): Heartbeat(now, (), {group: 6}),  # still before seq 7
    }
    (hang,) = find_hangs(beats, now_ns=now, timeout_seconds=2.0)
    assert (hang.op, hang.seq, hang.group) == ("all_reduce", 7, "dp")
    assert hang.entered_ranks == (0,) and hang.missing_ranks == (1,)
    assert hang.unreported_ranks == (2,)
    assert hang.waiting_seconds == pytest.approx(5.0)
    assert find_hangs(beats, now_ns=now, timeout_seconds=10.0) == []
    # Rank 2's daemon saw it enter: merged across daemons, only rank 1 is missing.
    other = find_hangs(
        {("job", -1, 2): Heartbeat(now, (stuck,), {group: 7})}, now_ns=now, timeout_seconds=2.0
    )
    (merged,) = merge_hangs([hang, *other])
    assert merged.entered_ranks == (0, 2) and merged.missing_ranks == (1,)
    assert merged.unreported_ranks == ()
    # Once every rank is in, it is no longer a missing-rank hang; stale heartbeats are ignored.
    beats[("job", -1, 1)] = Heartbeat(now, (), {group: 7})
    beats[("job", -1, 2)] = Heartbeat(now, (), {group: 7})
    assert find_hangs(beats, now_ns=now, timeout_seconds=2.0) == []
    assert find_hangs(beats, now_ns=now + 100 * 10**9, timeout_seconds=2.0) == []

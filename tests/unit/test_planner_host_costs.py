"""The strategies' fixed host costs in the time model, and their calibration by the bench.

Each figure is hand-computed from `time_model`'s accounting (per block pass, per ZeRO-3 unit and
micro-batch, per selectively recomputed block, per micro-batch); the calibration is checked by
recovering known costs from steps the model itself predicts with them.
"""

from __future__ import annotations

import dataclasses

import pytest

from plait.planner.devices import DeviceSpec, Link, device_spec
from plait.planner.layouts import PRECISIONS, Job, Layout
from plait.planner.published import resolve_shape
from plait.planner.search import plan, price, why_slower
from plait.planner.time_model import estimate_step_time
from plait.tools.bench import plan as bench

LAYERS = 4
COSTS = dict(
    tp_block_overhead=2e-3,
    zero3_unit_overhead=3e-3,
    selective_block_overhead=1e-3,
    microbatch_overhead=5e-3,
)


def _job(device: DeviceSpec, global_batch: int = 16) -> Job:
    model = resolve_shape(
        "llama:tiny", {"dim": 64, "n_layers": LAYERS, "n_heads": 4, "n_kv_heads": 2}
    )
    return Job(model=model, seq_len=128, global_batch=global_batch, world=4, per_node=4,
               device=device, precision=PRECISIONS["fp32"])  # fmt: skip


def _devices() -> tuple[DeviceSpec, DeviceSpec]:
    plain = dataclasses.replace(device_spec("H100-80GB"), block_overhead=0.0)
    return plain, dataclasses.replace(plain, **COSTS)


def test_each_strategy_pays_its_host_cost() -> None:
    plain, costly = _devices()
    job = _job(costly)
    mb = COSTS["microbatch_overhead"]
    # DDP: only the engine's per micro-batch cost, once per micro-batch.
    assert estimate_step_time(job, Layout(dp=4, micro_batch=4)).host_overhead == pytest.approx(mb)
    ddp_mb1 = estimate_step_time(job, Layout(dp=4, micro_batch=1))
    assert ddp_mb1.host_overhead == pytest.approx(4 * mb)
    # tp: forward + 2 × backward per block and the head, for each of the 2 micro-batches.
    tp = estimate_step_time(job, Layout(dp=2, tp=2, micro_batch=4))
    tp_cost = 2 * (LAYERS + 1) * 3 * COSTS["tp_block_overhead"] + 2 * mb
    assert tp.host_overhead == pytest.approx(tp_cost)
    # ... and per peer: tp 4 (two micro-batches of 8) waits on three peers at every pass
    tp4 = estimate_step_time(job, Layout(dp=1, tp=4, micro_batch=8))
    tp4_cost = 2 * (LAYERS + 1) * 3 * 3 * COSTS["tp_block_overhead"] + 2 * mb
    assert tp4.host_overhead == pytest.approx(tp4_cost)
    # ZeRO-3: every block unit once per micro-batch.
    zero3 = estimate_step_time(job, Layout(dp=4, zero=3, micro_batch=4))
    assert zero3.host_overhead == pytest.approx(LAYERS * COSTS["zero3_unit_overhead"] + mb)
    zero2 = estimate_step_time(job, Layout(dp=4, zero=2, micro_batch=4))
    assert zero2.host_overhead == pytest.approx(mb)
    # Selective recomputation: its policy's cost per block and micro-batch, in `recompute`.
    selective = Layout(dp=4, micro_batch=2, recompute="selective")
    extra = (
        estimate_step_time(job, selective).recompute
        - estimate_step_time(_job(plain), selective).recompute
    )
    assert extra == pytest.approx(2 * LAYERS * COSTS["selective_block_overhead"])
    # Nothing changes the model's FLOPs, and the terms still add up.
    assert tp.total == pytest.approx(sum(tp.terms().values()))
    assert (
        tp.model_flops
        == estimate_step_time(_job(plain), Layout(dp=2, tp=2, micro_batch=4)).model_flops
    )


def test_the_host_cost_is_named_when_it_makes_a_layout_slower() -> None:
    _, costly = _devices()
    job = _job(dataclasses.replace(costly, zero3_unit_overhead=0.05))
    zero2 = price(job, Layout(dp=4, zero=2, micro_batch=4))
    zero3 = price(job, Layout(dp=4, zero=3, micro_batch=4))
    assert why_slower(zero3, zero2).startswith("+200.0 ms host overhead")


def test_host_costs_are_stage_work_in_the_pipeline() -> None:
    plain, costly = _devices()
    layout = Layout(dp=1, tp=2, pp=2, micro_batch=4, schedule="1f1b")
    with_costs = estimate_step_time(_job(costly), layout)
    without = estimate_step_time(_job(plain), layout)
    assert with_costs.host_overhead > 0
    # the slowest stage's host work is on the critical path, and the bubble grows with it
    assert with_costs.total - without.total >= with_costs.host_overhead
    assert with_costs.pipeline_bubble > without.pipeline_bubble


def test_selective_recompute_replays_the_block_launches() -> None:
    plain, _ = _devices()
    launches = dataclasses.replace(plain, block_overhead=1e-3)
    layout = Layout(dp=4, micro_batch=4, recompute="selective")
    extra = (
        estimate_step_time(_job(launches), layout).recompute
        - estimate_step_time(_job(plain), layout).recompute
    )
    assert extra == pytest.approx(LAYERS * 1e-3)


def test_host_costs_change_the_ranking() -> None:
    plain, costly = _devices()
    costly = dataclasses.replace(costly, zero3_unit_overhead=0.05, selective_block_overhead=0.05)
    pairs = (  # (a strategy with a host cost, its peer without) at the same micro-batch
        (Layout(dp=4, zero=3, micro_batch=4), Layout(dp=4, zero=2, micro_batch=4)),
        (
            Layout(dp=4, zero=3, micro_batch=4, recompute="selective"),
            Layout(dp=4, zero=1, micro_batch=4),
        ),
    )
    for device, costs_count in ((plain, False), (costly, True)):
        order = [c.layout.describe() for c in plan(_job(device), per_mesh=False).ranked]
        for costly_layout, peer in pairs:
            behind = order.index(costly_layout.describe()) > order.index(peer.describe())
            # an H100 runs the tiny model's extra collectives and element-wise replay in
            # microseconds: without host costs both lead their peers; with them both fall behind
            assert behind == costs_count, (costly_layout.describe(), order[:8])


def _calibration_runs(job: Job) -> list[dict]:
    """What the bench's ranks would record if the model were right: per calibration layout,
    each rank's step times (one undisturbed step, the others slowed by load)."""
    steps = {}
    for name, (layout, batch) in bench.CALIBRATION_LAYOUTS.items():
        exact = estimate_step_time(dataclasses.replace(job, global_batch=batch), layout).total
        steps[name] = [exact * 1.4, exact, exact * 1.1]
    return [{"compute": {"strategies": steps}} for _ in range(4)]


def test_bench_calibration_recovers_the_host_costs() -> None:
    plain, costly = _devices()
    plain = dataclasses.replace(plain, block_overhead=2e-4)  # a block's launches, known
    costly = dataclasses.replace(costly, block_overhead=2e-4)
    fitted = bench.calibrate_overheads(_job(plain), _calibration_runs(_job(costly))).device
    for field, value in COSTS.items():
        assert getattr(fitted, field) == pytest.approx(value, rel=1e-6), field
    # none of the calibration steps is a layout the bench ranks
    ranked = {(layout, 16) for layout in bench.LAYOUTS.values()}
    assert not ranked & set(bench.CALIBRATION_LAYOUTS.values())


def _fake_ranks() -> list[dict]:
    def rank(alone: float, together: float) -> dict:
        gemms = [[g, 40e9 * g / (g + 1e6)] for g in (1e6, 1e7, 1e8, 1e9)]
        comm = [
            {"op": "all_reduce", "nbytes": n, "group": 4, "seconds": 1e-4 * 6 + 1.5 * n / 2e9}
            for n in (4096, 65536, 2**20, 4 * 2**20)
        ]
        compute = {
            "gemms": gemms,
            "attention_rate": 10e9,
            "bandwidth": 8e9,
            "block_overhead": 1e-3,
            "sharing_alone": alone,
            "sharing_together": together,
        }
        return {"compute": compute, "comm": comm}

    return [rank(80e9, 32e9), rank(80e9, 30e9), rank(80e9, 34e9)]


def test_bench_scales_rates_measured_alone_by_the_measured_sharing() -> None:
    device = bench.cpu_device(_fake_ranks())
    slowdown = 80 / 32
    assert device.oversubscription == pytest.approx(slowdown)
    # the rates a rank has alone, shared among the ranks busy at once; a fixed cost stretches
    assert device.memory_bandwidth == pytest.approx(8e9 / slowdown)
    assert device.block_overhead == pytest.approx(1e-3 * slowdown)
    assert device.peak_flops * device.attention_efficiency == pytest.approx(10e9 / slowdown)
    assert device.peak_flops < 40e9 / slowdown * 1.001


def test_zero_reduces_by_all_reduce_where_the_backend_lacks_reduce_scatter() -> None:
    plain, _ = _devices()
    slow = Link(alpha=1e-4, beta=1e8)  # so that ZeRO-3's collectives outlast its compute
    plain = dataclasses.replace(plain, intra_node=slow, inter_node=slow)
    gloo = dataclasses.replace(plain, grads_reduce_by_all_reduce=True)
    for zero in (1, 2, 3):
        layout = Layout(dp=4, zero=zero, micro_batch=4)
        nccl_like = estimate_step_time(_job(plain), layout).dp_comm
        assert estimate_step_time(_job(gloo), layout).dp_comm > nccl_like, zero
    ddp = Layout(dp=4, micro_batch=4)
    assert (
        estimate_step_time(_job(gloo), ddp).dp_comm == estimate_step_time(_job(plain), ddp).dp_comm
    )
    assert bench.cpu_device(_fake_ranks()).grads_reduce_by_all_reduce

"""The planner on several nodes: HSDP's dp_shard and hierarchical dp collectives priced per link
class from `plait.core.link_bytes`, chosen within the memory budget, written into the config
and shown by `plait plan`. Pure computation (no ranks)."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from plait.core.config import load_config
from plait.core.host_map import HostMap
from plait.core.link_bytes import op_link_bytes, point_to_point
from plait.planner.auto import (
    auto_config,
    layout_config,
    layout_from_config,
    layout_overrides,
    merge_sections,
)
from plait.planner.devices import DEVICES, Link
from plait.planner.explain import explain
from plait.planner.layouts import PRECISIONS, Job, Layout, SearchSpace, enumerate_layouts
from plait.planner.memory_model import estimate_memory
from plait.planner.published import resolve_shape
from plait.planner.search import plan, price
from plait.plugins.collectives.step_bytes import sharded_step_bytes, sharded_step_inter_node

# 4 layers of width 64: 204,288 parameters, divisible by every group size below
TINY = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}


def _tiny_job(ranks_per_node: int, microbatches: int = 1) -> Job:
    world = 2 * ranks_per_node
    return Job(
        model=resolve_shape("llama:tiny", TINY),
        seq_len=128,
        global_batch=world * microbatches,
        world=world,
        per_node=ranks_per_node,
        device=DEVICES["H100-80GB"],
        precision=PRECISIONS["fp32"],
    )


def _cross_node(job: Job, layout: Layout) -> int:
    return price(job, layout).time.cross_node_bytes


# ---------------------------------------------------------------------- bytes = link_bytes


@pytest.mark.parametrize("ranks_per_node", [2, 4])
def test_cross_node_bytes_per_step_are_link_bytes_formulas(ranks_per_node: int) -> None:
    k, m, micro = ranks_per_node, 2, 4
    job = _tiny_job(k, micro)
    n = m * k
    numel = job.model.num_params
    assert numel % (n * n) == 0  # every chunk divides: the closed forms are exact
    model_bytes = 4 * numel  # fp32 parameters and gradients
    host_map = HostMap.assumed(m, k)
    group = tuple(range(n))

    # DDP: one all-reduce of the gradients per step, every rank's send counted by link_bytes
    for algorithm, name in (("flat", "torch"), ("hierarchical", "hierarchical")):
        expected = sum(
            op_link_bytes("all_reduce", group, rank, numel=numel, itemsize=4, host_map=host_map,
                          algorithm=name).inter_node  # type: ignore[union-attr]
            for rank in group
        )  # fmt: skip
        layout = Layout(dp=n, micro_batch=1, dp_algorithm=algorithm)
        assert _cross_node(job, layout) == expected
    if k == 2:  # the figures on 2 nodes x 2: flat 3·B, hierarchical 2·B
        assert _cross_node(job, Layout(dp=4)) == 3 * model_bytes
        assert _cross_node(job, Layout(dp=4, dp_algorithm="hierarchical")) == 2 * model_bytes

    # ZeRO-3: two gathers and a reduce-scatter per micro-batch; HSDP's replicas once per step
    zero3 = {
        "flat": Layout(dp=n, zero=3),
        "hierarchical": Layout(dp=n, zero=3, dp_algorithm="hierarchical"),
        "hsdp": Layout(dp=n, zero=3, dp_shard=k),
    }
    for name, layout in zero3.items():
        closed = sharded_step_inter_node(
            model_bytes, nodes=m, ranks_per_node=k, microbatches=micro, layout=name
        )
        assert _cross_node(job, layout) == int(closed), name
        assert isinstance(_cross_node(job, layout), int)
    if k == 2:  # 4.5·B·M, 3·B·M and 2·B, M = 4
        assert [_cross_node(job, zero3[x]) // model_bytes for x in zero3] == [18, 12, 2]
    # HSDP's bytes do not grow with the micro-batches; flat ZeRO-3's do
    one = _tiny_job(k, 1)
    assert _cross_node(one, zero3["hsdp"]) == _cross_node(job, zero3["hsdp"])
    assert _cross_node(job, zero3["flat"]) == micro * _cross_node(one, zero3["flat"])

    # ZeRO-2 under HSDP: reduce-scatter and all-gather inside the node, the shard across
    shard_group, replica_group = tuple(range(k)), (0, k)
    per_rank = sharded_step_bytes(
        0, shard_group=shard_group, replica_group=replica_group, host_map=host_map,
        gathers=[], reductions=[numel], itemsize=4,
    )  # fmt: skip
    assert _cross_node(job, Layout(dp=n, zero=2, dp_shard=k)) == n * per_rank.inter_node


def test_pipeline_transfers_across_nodes_count_too() -> None:
    # 2 nodes x 2, pp 2: stage 0 is node 0, stage 1 node 1; dp stays inside each node
    job = _tiny_job(2, 4)
    layout = Layout(dp=2, pp=2, micro_batch=2, schedule="1f1b")
    host_map = HostMap.assumed(2, 2)
    activation = 2 * job.seq_len * job.model.dim * 4  # micro-batch x tokens x width, fp32
    microbatches = job.global_batch // (layout.dp * layout.micro_batch)
    sends = sum(point_to_point(rank, rank + 2, activation, host_map).inter_node for rank in (0, 1))
    assert _cross_node(job, layout) == 2 * microbatches * sends  # activations and gradients
    assert _cross_node(job, Layout(dp=4, pp=1, micro_batch=2, zero=3, dp_shard=2)) > 0
    inside = _tiny_job(4, 1)  # one node of 4 ranks holding both stages
    assert _cross_node(dataclasses.replace(inside, world=4), layout) == 0


# ------------------------------------------------------------------------ memory and search


def _seven_b(inter_beta: float, memory_gib: float = 80.0) -> Job:
    device = dataclasses.replace(
        DEVICES["H100-80GB"],
        inter_node=Link(alpha=15e-6, beta=inter_beta),
        memory_bytes=memory_gib * 2**30,
    )
    return Job(model=resolve_shape("llama:7b"), seq_len=4096, global_batch=32, world=16,
               per_node=8, device=device, precision=PRECISIONS["bf16"])  # fmt: skip


def _space(*zero: int) -> SearchSpace:
    return SearchSpace(
        zero_stages=zero, recompute=("full",), micro_batches=(1,),
        fixed={"tp": 1, "pp": 1, "cp": 1},
    )  # fmt: skip


def test_memory_shards_over_dp_shard_not_dp() -> None:
    job = _tiny_job(4)
    params = job.model.num_params
    for zero, sharded in ((1, ("optimizer_state",)), (3, ("parameters", "gradients"))):
        flat = estimate_memory(job, Layout(dp=8, zero=zero))
        hsdp = estimate_memory(job, Layout(dp=8, zero=zero, dp_shard=2))
        for field in sharded:
            assert getattr(hsdp, field) == pytest.approx(4 * getattr(flat, field))
    assert estimate_memory(job, Layout(dp=8, zero=3, dp_shard=2)).parameters == pytest.approx(
        4 * params / 2
    )


def test_enumeration_offers_shards_inside_a_node_and_hierarchical_where_it_matters() -> None:
    job = _seven_b(45e9)
    layouts = set(enumerate_layouts(job, _space(0, 3)))
    zero3 = {(x.dp_shard, x.dp_algorithm) for x in layouts if x.zero == 3}
    # dp_shard 16 is plain ZeRO-3 (0); HSDP's replica groups run flat rings (the hierarchical
    # algorithm takes over the dp axis's groups only), so no `shardN hierarchical` row
    assert zero3 == {(0, "flat"), (0, "hierarchical"), (2, "flat"), (4, "flat"), (8, "flat")}
    assert {x.dp_shard for x in layouts if x.zero == 0} == {0}
    # with cp > 1 gradients reduce over dp x cp, a group the algorithm does not take over
    with_cp = dataclasses.replace(_space(0, 3), fixed={"tp": 1, "pp": 1, "cp": 2})
    cp_layouts = list(enumerate_layouts(job, with_cp))
    assert cp_layouts and {x.dp_algorithm for x in cp_layouts} == {"flat"}
    one_node = dataclasses.replace(job, world=8)
    assert {(x.dp_shard, x.dp_algorithm) for x in enumerate_layouts(one_node, _space(3))} == {
        (0, "flat")
    }
    flat_only = dataclasses.replace(_space(3), hybrid_sharding=False, hierarchical=False)
    assert {(x.dp_shard, x.dp_algorithm) for x in enumerate_layouts(job, flat_only)} == {
        (0, "flat")
    }


def test_a_slow_cross_node_link_picks_hsdp_and_a_fast_one_plain_zero3() -> None:
    slow, fast = _seven_b(5e9), _seven_b(360e9)
    # hpZ left out: its prefetched gathers beat HSDP's exposed replica all-reduce here
    # (tests/unit/test_planner_zero_plus_plus.py)
    no_hpz = dataclasses.replace(_space(3), secondary_shard=False)
    best_slow = plan(slow, no_hpz).best
    assert best_slow.layout.dp_shard == 8  # HSDP: only the replicas' all-reduce crosses
    flat = price(slow, Layout(dp=16, zero=3, recompute="full"))
    assert best_slow.time.total < 0.5 * flat.time.total
    assert best_slow.time.cross_node_bytes < flat.time.cross_node_bytes / 3
    assert best_slow.time.cross_node_seconds < flat.time.cross_node_seconds
    # a link as fast as the node's own: plain ZeRO-3 hides its gathers under compute and holds
    # a quarter of HSDP's state, so it wins
    best_fast = plan(fast, _space(3)).best
    assert best_fast.layout.dp_shard == 0
    hsdp = price(fast, Layout(dp=16, zero=3, dp_shard=8, recompute="full"))
    assert best_fast.time.total < hsdp.time.total


def test_a_slow_link_picks_hierarchical_ddp() -> None:
    job = dataclasses.replace(_seven_b(2e9), model=resolve_shape("llama:1b"))
    best = plan(job, _space(0)).best
    assert best.layout.dp_algorithm == "hierarchical"
    flat = price(job, dataclasses.replace(best.layout, dp_algorithm="flat"))
    assert best.time.dp_comm < flat.time.dp_comm
    # 2 nodes x 8: a flat ring crosses 2·2·15/16·B, hierarchical 2·B
    ratio = best.time.cross_node_bytes / flat.time.cross_node_bytes
    assert ratio == pytest.approx(2 / 3.75, rel=1e-6)


def test_a_dp_shard_that_does_not_fit_is_not_chosen() -> None:
    job = _seven_b(5e9, memory_gib=16.0)  # 14.7 GiB usable
    usable = job.device.usable_memory
    assert estimate_memory(job, Layout(dp=16, zero=3, dp_shard=8, recompute="full")).total > usable
    result = plan(job, _space(3), per_mesh=False)
    assert result.ranked and all(c.memory.total <= usable for c in result.ranked)
    assert {c.layout.dp_shard for c in result.ranked} == {0}
    assert result.best.layout.dp_algorithm == "hierarchical"


# ------------------------------------------------------------------------------ config, CLI


def _tiny_config() -> dict:
    return {
        "model": {"name": "llama", "size": "tiny", "overrides": TINY},
        "data": {"seq_len": 128},
        "train": {"global_batch_size": 16, "steps": 3},
    }


def test_config_round_trips_dp_shard_and_algorithm() -> None:
    layouts = (
        Layout(dp=4, zero=3, dp_shard=2, micro_batch=4),
        Layout(dp=4, zero=1, dp_shard=2, micro_batch=2),
        Layout(dp=4, micro_batch=4, dp_algorithm="hierarchical"),
        Layout(dp=4, zero=3, micro_batch=4, dp_algorithm="hierarchical"),
        Layout(dp=4, zero=2, micro_batch=4),
    )
    for layout in layouts:
        sections = layout_config(layout)
        merged = merge_sections(_tiny_config(), sections)
        resolved = load_config(merged)
        assert resolved.parallel.dp_shard == (layout.dp_shard or None)
        algorithm = "hierarchical" if layout.dp_algorithm == "hierarchical" else "torch"
        assert resolved.comm.algorithm == algorithm
        assert layout_from_config(merged, world=4, per_node=2) == layout
    # what the runtime does with a config that leaves them to it, on 2 nodes x 2
    node = merge_sections(
        _tiny_config(), {"parallel": {"dp_strategy": "zero3", "dp_shard": "node"}}
    )
    assert layout_from_config(node, world=4, per_node=2).dp_shard == 2
    unset = merge_sections(_tiny_config(), {"parallel": {"dp_strategy": "ddp"}})
    assert layout_from_config(unset, world=4, per_node=2).dp_algorithm == "hierarchical"
    assert layout_from_config(unset, world=4, per_node=4).dp_algorithm == "flat"


def test_plan_prints_the_cross_node_columns(tmp_path, monkeypatch) -> None:
    from plait.tools.plan_commands import app

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    result = CliRunner().invoke(
        app, ["llama:small", "--world", "4", "--per-node", "2", "--global-batch", "16",
              "--seq-len", "128", "--precision", "fp32", "--zero", "0", "--recompute", "none",
              "--top", "50"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(line.strip("┃").split("┃") for line in lines if "x-node GB" in line)
    header = [cell.strip() for cell in header]
    assert "x-node s" in header
    job = Job(model=resolve_shape("llama:small"), seq_len=128, global_batch=16, world=4,
              per_node=2, device=DEVICES["H100-80GB"], precision=PRECISIONS["fp32"])  # fmt: skip
    ranked = plan(job, SearchSpace(zero_stages=(0,), recompute=("none",))).ranked
    ddp = next(c for c in ranked if c.layout.dp == 4)
    row = next(line for line in lines if f" {ddp.layout.describe()} " in line)
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    assert cells[header.index("x-node GB")] == f"{ddp.time.cross_node_bytes / 1e9:.2f}" != "0.00"
    assert cells[header.index("x-node s")] == f"{ddp.time.cross_node_seconds:.3f}"


def test_auto_on_two_nodes_writes_what_it_planned() -> None:
    config, result = auto_config(_tiny_config(), world=4, per_node=2, device=DEVICES["H100-80GB"])
    best = result.best.layout
    assert config["comm"]["algorithm"] in ("torch", "hierarchical")
    assert config["parallel"].get("dp_shard", 0) == best.dp_shard
    assert layout_from_config(config, world=4, per_node=2) == best


def test_auto_keeps_an_algorithm_the_planner_does_not_model() -> None:
    named = {**_tiny_config(), "comm": {"algorithm": "powersgd"}}
    config, result = auto_config(named, world=4, per_node=2, device=DEVICES["H100-80GB"])
    assert config["comm"]["algorithm"] == "powersgd"
    assert all(c.layout.dp_algorithm == "flat" for c in result.ranked)  # no hierarchical plans
    overrides = layout_overrides(result.best.layout, keep_algorithm=True)
    assert not any(o.startswith("comm.") for o in overrides)
    assert any(o.startswith("comm.algorithm=") for o in layout_overrides(result.best.layout))


def test_explain_counts_hsdp_and_hierarchical_sub_ops_as_dp_comm() -> None:
    job = _tiny_job(2)
    prediction = price(job, Layout(dp=4, zero=2, dp_shard=2, micro_batch=4)).time
    breakdown = _Breakdown(
        step_seconds=1.0,
        compute_seconds=0.5,
        exposed_comm_seconds=0.3,
        exposed_comm_by_purpose={"grad_shard": 0.1, "hierarchical/grad_bucket": 0.2},
    )
    rows = {row.term: row for row in explain(prediction, [breakdown]).rows}
    assert rows["dp_comm"].measured == pytest.approx(0.3)
    assert "other comm" not in rows


class _Breakdown:
    def __init__(self, **values: object) -> None:
        defaults = dict(step_seconds=0.0, compute_seconds=0.0, exposed_comm_seconds=0.0,
                        pipeline_bubble_seconds=0.0, optimizer_seconds=0.0, data_wait_seconds=0.0,
                        host_other_seconds=0.0, exposed_comm_by_purpose={})  # fmt: skip
        defaults.update(values)
        self.__dict__.update(defaults)

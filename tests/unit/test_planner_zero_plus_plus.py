"""The planner and ZeRO++: hpZ's secondary shards and the qwZ / qgZ codecs priced per link
class (bytes from `plait.core.link_bytes`, hpZ's memory from its secondary shards), chosen when
they cut the predicted step within the memory budget, the codecs only when quantized
communication is allowed, and written into the config `--auto` produces. Pure computation."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from typer.testing import CliRunner

from plait.core.config import load_config
from plait.core.host_map import HostMap
from plait.planner.auto import auto_config, layout_config, layout_from_config, merge_sections
from plait.planner.devices import DEVICES, Link
from plait.planner.layouts import PRECISIONS, Job, Layout, SearchSpace, enumerate_layouts
from plait.planner.memory_model import estimate_memory, stage_parameters
from plait.planner.published import resolve_shape
from plait.planner.search import QUANTIZED_MIN_GAIN, plan, price, why_slower
from plait.plugins.collectives.step_bytes import encoded_bytes, encoded_hierarchical_bytes
from plait.tools.plan_commands import quantized_notes

# 4 layers of width 64: 204,288 parameters (fp32), divisible by 4 ranks but not by 4·256, so
# every rank's chunk ends in a padded codec block
TINY = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}
SLOW, FAST = 5e9, 360e9  # bytes/s per rank across nodes


def _tiny_job(microbatches: int) -> Job:
    return Job(
        model=resolve_shape("llama:tiny", TINY),
        seq_len=128,
        global_batch=4 * microbatches,
        world=4,
        per_node=2,
        device=DEVICES["H100-80GB"],
        precision=PRECISIONS["fp32"],
    )


def _seven_b(inter_beta: float, memory_gib: float) -> Job:
    device = dataclasses.replace(
        DEVICES["H100-80GB"],
        inter_node=Link(alpha=15e-6, beta=inter_beta),
        memory_bytes=memory_gib * 2**30,
    )
    return Job(model=resolve_shape("llama:7b"), seq_len=4096, global_batch=32, world=16,
               per_node=8, device=device, precision=PRECISIONS["bf16"])  # fmt: skip


def _space(*, quantized: bool) -> SearchSpace:
    return SearchSpace(
        zero_stages=(3,), recompute=("full",), micro_batches=(1,),
        fixed={"tp": 1, "pp": 1, "cp": 1}, quantized_comm=quantized,
    )  # fmt: skip


HIER3 = Layout(dp=4, zero=3, dp_algorithm="hierarchical")


# ------------------------------------------------------------------------------------- bytes


def test_cross_node_bytes_are_the_zero_plus_plus_formulas_as_integers() -> None:
    m, k, micro = 2, 2, 4
    n = m * k
    job = _tiny_job(micro)
    numel = job.model.num_params
    assert numel % n == 0 and (numel // n) % 256  # whole chunks, a padded last block
    B = 4 * numel  # fp32 parameters and gradients
    chunk = numel // n

    def crossing(layout: Layout) -> int:
        got = price(job, layout).time.cross_node_bytes
        assert isinstance(got, int)
        return got

    def encoded(codec: str) -> int:  # one rank's across step: (m − 1) encodings of its chunk
        bits = {"int8": 8, "int4": 4}[codec]
        return (m - 1) * encoded_bytes(chunk, bits=bits, block=256)

    # docs/zero-plus-plus.md's rows, summed over the n ranks, M micro-batches per step
    assert crossing(HIER3) == 3 * micro * (m - 1) * B
    assert crossing(dataclasses.replace(HIER3, secondary_shard=True)) == 2 * micro * (m - 1) * B
    qwz = dataclasses.replace(HIER3, quantize_weights="int8")
    assert crossing(qwz) == micro * (n * 2 * encoded("int8") + (m - 1) * B)
    for grads in ("int8", "int4"):
        both = dataclasses.replace(qwz, quantize_gradients=grads)
        assert crossing(both) == micro * n * (2 * encoded("int8") + encoded(grads))
        hpz = dataclasses.replace(both, secondary_shard=True)
        assert crossing(hpz) == micro * n * (encoded("int8") + encoded(grads))
    # an int8 element with blocks of 256 costs 1 + 4/256 bytes: ≈ 0.254·B per encoded op
    both = dataclasses.replace(qwz, quantize_gradients="int8")
    assert crossing(both) / (micro * B) == pytest.approx(3 * 0.254, rel=2e-3)
    # ZeRO-2's qgZ: the gradient reduce-scatter's hop once per step; its all-gather unencoded
    zero2 = Layout(dp=4, zero=2, dp_algorithm="hierarchical", quantize_gradients="int4")
    assert crossing(zero2) == n * encoded("int4") + (m - 1) * B


def test_encoded_hierarchical_bytes_keep_the_inside_step_and_encode_the_across_one() -> None:
    host_map = HostMap.assumed(2, 2)
    hierarchy = host_map.hierarchy(range(4))
    assert hierarchy is not None
    for op in ("all_gather", "reduce_scatter"):
        for rank in range(4):
            sent = encoded_hierarchical_bytes(
                op, hierarchy, rank, numel=1001 * 4, itemsize=2, bits=4, block=64,
                host_map=host_map,
            )  # fmt: skip
            # inside: (k − 1)·⌈N/k⌉·itemsize; across: one int4 encoding of 1001 elements
            assert sent.intra_node == 2002 * 2
            assert sent.inter_node == 16 * 32 + 4 * 16 == encoded_bytes(1001, bits=4, block=64)
    with pytest.raises(ValueError, match="encodes an all_gather or a reduce_scatter"):
        encoded_hierarchical_bytes(
            "all_reduce", hierarchy, 0, numel=8, itemsize=4, bits=8, block=64, host_map=host_map
        )


# ------------------------------------------------------------------------------------ memory


def test_hpz_costs_a_node_share_of_the_parameters() -> None:
    job = _seven_b(SLOW, 80.0)
    plain = Layout(dp=16, zero=3, dp_algorithm="hierarchical", recompute="full")
    hpz = dataclasses.replace(plain, secondary_shard=True)
    extra = estimate_memory(job, hpz).total - estimate_memory(job, plain).total
    # 8 dp ranks per node keep 1/8 of the bf16 parameters each, on top of their 1/16
    assert extra == pytest.approx(stage_parameters(job, plain, 0) / 8 * 2, rel=1e-12)
    codecs = dataclasses.replace(plain, quantize_weights="int8", quantize_gradients="int8")
    assert estimate_memory(job, codecs).total == estimate_memory(job, plain).total


# ------------------------------------------------------------------------------------ search


def test_a_slow_link_with_room_for_hpz_but_not_for_hsdp_picks_hpz() -> None:
    job = _seven_b(SLOW, 16.0)  # 14.7 GiB usable: HSDP's shard8 state does not fit
    best = plan(job, _space(quantized=False)).best
    assert best.layout.secondary_shard and best.layout.dp_algorithm == "hierarchical"
    assert not best.layout.quantized and best.layout.dp_shard == 0
    without = price(job, dataclasses.replace(best.layout, secondary_shard=False))
    assert best.time.total < without.time.total
    # per micro-batch bf16 gathers (2 bytes) forward and backward, fp32 gradients (4): hpZ
    # keeps the backward gather inside the node, 2 + 4 of the 2 + 2 + 4 bytes still cross
    assert best.time.cross_node_bytes * 4 == without.time.cross_node_bytes * 3
    assert best.memory.total > without.memory.total


def test_no_room_for_the_secondary_shards_means_no_hpz() -> None:
    job = _seven_b(SLOW, 13.5)  # 12.4 GiB usable: ZeRO-3 fits, its secondary shards do not
    hpz = Layout(dp=16, zero=3, dp_algorithm="hierarchical", recompute="full",
                 secondary_shard=True)  # fmt: skip
    assert estimate_memory(job, hpz).total > job.device.usable_memory
    result = plan(job, _space(quantized=False), per_mesh=False)
    assert result.ranked and not any(c.layout.secondary_shard for c in result.ranked)
    assert result.best.layout.dp_algorithm == "hierarchical"


def test_a_fast_link_keeps_plain_zero3_even_when_codecs_are_allowed() -> None:
    for quantized in (False, True):
        best = plan(_seven_b(FAST, 80.0), _space(quantized=quantized)).best
        assert not best.layout.secondary_shard and not best.layout.quantized, best.layout


def test_codecs_are_planned_only_when_quantized_comm_is_allowed() -> None:
    job = _seven_b(SLOW, 13.5)
    assert not any(x.quantized for x in enumerate_layouts(job, _space(quantized=False)))
    offered = {
        (x.quantize_weights, x.quantize_gradients)
        for x in enumerate_layouts(job, _space(quantized=True))
        if x.quantized
    }
    assert offered == {
        ("int8", "none"), ("int8", "int8"), ("int8", "int4"), ("none", "int8"), ("none", "int4")
    }  # fmt: skip
    # only where the runtime encodes: hierarchical ZeRO over every dp rank
    for x in enumerate_layouts(job, _space(quantized=True)):
        if x.quantized:
            assert x.dp_algorithm == "hierarchical" and x.dp_shard == 0 and x.zero == 3
    cp2 = dataclasses.replace(_space(quantized=True), fixed={"tp": 1, "pp": 1, "cp": 2})
    assert not any(x.quantized for x in enumerate_layouts(job, cp2))  # ZeRO's group is dp × cp
    allowed = plan(job, _space(quantized=True)).best
    exact = plan(job, _space(quantized=False)).best
    assert allowed.layout.quantized and allowed.layout.quantize_weights == "int8"
    assert allowed.time.total < exact.time.total
    assert allowed.time.cross_node_bytes < exact.time.cross_node_bytes / 2


def test_codecs_that_gain_under_the_margin_rank_below_exact_numerics() -> None:
    # one micro-batch of 8 per rank: the gathers hide under compute, qwZ saves only the first
    job = dataclasses.replace(_seven_b(SLOW, 80.0), global_batch=128)
    space = dataclasses.replace(_space(quantized=True), micro_batches=(8,))
    ranked = plan(job, space, per_mesh=False).ranked
    best = ranked[0]
    assert not best.layout.quantized and not best.layout.secondary_shard
    quantized = next(c for c in ranked if c.layout.quantized)
    assert best.time.total * (1 - QUANTIZED_MIN_GAIN) < quantized.time.total < best.time.total
    assert why_slower(quantized, best).endswith("faster, under 2%: exact numerics ranked first")
    hpz = next(c for c in ranked if c.layout.secondary_shard and not c.layout.quantized)
    assert hpz.time.total == best.time.total
    assert why_slower(hpz, best) == "as fast, +1.6 GiB of memory"


def test_one_node_offers_no_zero_plus_plus() -> None:
    job = dataclasses.replace(_seven_b(SLOW, 80.0), world=8)
    for x in enumerate_layouts(job, _space(quantized=True)):
        assert not x.secondary_shard and not x.quantized


# ------------------------------------------------------------------------------ config, CLI


def _tiny_config() -> dict:
    return {
        "model": {"name": "llama", "size": "tiny", "overrides": TINY},
        "data": {"seq_len": 128},
        "train": {"global_batch_size": 16, "steps": 3},
    }


def test_config_round_trips_hpz_and_the_codecs() -> None:
    layouts = (
        dataclasses.replace(HIER3, micro_batch=4, secondary_shard=True),
        dataclasses.replace(HIER3, micro_batch=4, quantize_weights="int8",
                            quantize_gradients="int4", quantize_block=64),
        Layout(dp=4, zero=2, micro_batch=4, dp_algorithm="hierarchical",
               quantize_gradients="int8"),
    )  # fmt: skip
    for layout in layouts:
        merged = merge_sections(_tiny_config(), layout_config(layout))
        resolved = load_config(merged).model_dump(mode="json")["zero"]
        assert resolved["secondary_shard"] == ("node" if layout.secondary_shard else "none")
        assert resolved["quantize_weights"] == layout.quantize_weights
        assert resolved["quantize_gradients"] == layout.quantize_gradients
        assert layout_from_config(merged, world=4, per_node=2) == layout
    # a plan without them overrides a config's own
    own = {**_tiny_config(), "zero": {"secondary_shard": "node", "quantize_gradients": "int8"}}
    merged = merge_sections(own, layout_config(dataclasses.replace(HIER3, micro_batch=4)))
    assert layout_from_config(merged, world=4, per_node=2) == dataclasses.replace(
        HIER3, micro_batch=4
    )


def _slow_device(beta: float = 1e6) -> object:
    return dataclasses.replace(DEVICES["H100-80GB"], inter_node=Link(alpha=15e-6, beta=beta))


def test_auto_writes_the_codecs_only_when_allowed() -> None:
    device = _slow_device()
    config, result = auto_config(_tiny_config(), world=4, per_node=2, device=device)
    assert not any(c.layout.quantized for c in result.ranked)
    assert config.get("zero", {}).get("quantize_weights", "none") == "none"
    config, result = auto_config(
        _tiny_config(), world=4, per_node=2, device=device, allow_quantized_comm=True
    )
    best = result.best.layout
    assert best.quantized
    assert config["zero"]["quantize_weights"] == best.quantize_weights
    assert config["zero"]["quantize_gradients"] == best.quantize_gradients
    assert layout_from_config(config, world=4, per_node=2) == best
    # a config that names a codec already is the user's permission
    named = {**_tiny_config(), "zero": {"quantize_gradients": "int8"}}
    _, result = auto_config(named, world=4, per_node=2, device=device)
    assert result.best.layout.quantized


def _plan_cli(tmp_path, monkeypatch, *extra: str) -> list[str]:
    from plait.planner.comm_model import LinkCalibration, LinkFit
    from plait.tools.plan_commands import app

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    links = tmp_path / "slow.json"
    inter = LinkFit(alpha=15e-6, beta=1e6, samples=2, rms_error_seconds=0.0)
    LinkCalibration(intra=None, inter=inter, source="test", measured_at=0.0).save(links)
    json.loads(links.read_text())  # a real calibration file
    result = CliRunner().invoke(
        app, ["llama:tiny", "--world", "4", "--per-node", "2", "--global-batch", "16",
              "--seq-len", "128", "--precision", "fp32", "--zero", "3", "--recompute", "none",
              "--top", "3", "--links", str(links), *extra],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_plan_shows_the_codecs_and_says_they_change_the_numerics(tmp_path, monkeypatch) -> None:
    lines = _plan_cli(tmp_path, monkeypatch, "--allow-quantized-comm")
    text = " ".join(" ".join(lines).split())  # the console wraps long notes
    assert "qwZ-int8" in text or "qgZ-int" in text, text
    assert re.search(r"#1(, #\d)* quantize what crosses nodes \(allowed by --allow-quant", text)
    assert "absmax/254" in text or "absmax/14" in text
    assert "of each block of 256 (docs/zero-plus-plus.md)" in text
    lines = _plan_cli(tmp_path, monkeypatch)
    text = " ".join(" ".join(lines).split())
    assert "qwZ-" not in text and "qgZ-" not in text
    # No printed row here can take a codec (HSDP, or cp > 1): no hint either.
    assert "--allow-quantized-comm" not in text
    # Where the best row is hierarchical ZeRO-3 over every dp rank, the plan says how to have
    # the codecs planned.
    unquantized = plan(_seven_b(SLOW, 13.5), _space(quantized=False))  # 12.4 GiB usable
    assert unquantized.best.layout.dp_algorithm == "hierarchical"
    assert not unquantized.best.layout.dp_shard
    (hint,) = quantized_notes(unquantized, top=1, allowed=False)
    assert "--allow-quantized-comm lets the plan quantize" in hint

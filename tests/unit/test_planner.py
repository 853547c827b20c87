"""The planner's models, search, calibration and CLI, as pure computation (no ranks).

Figures are checked against hand-computed ones from the formulas in the module docstrings, so a
change of accounting shows up here; the measured accuracy lives in `tools/bench/plan.py`.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from plait.core.config import load_config
from plait.core.errors import ConfigError
from plait.planner.auto import auto_config, layout_config, layout_from_config, merge_sections
from plait.planner.comm_model import (
    CommSample,
    LinkCalibration,
    collective_seconds,
    fit_links,
    group_is_intra_node,
)
from plait.planner.daemon_client import samples_from_trace
from plait.planner.devices import DEVICES, Link, device_spec, efficiency_from_gemm_rates
from plait.planner.explain import explain
from plait.planner.layouts import PRECISIONS, Job, Layout, SearchSpace, enumerate_layouts
from plait.planner.memory_model import (
    activation_ratios,
    estimate_memory,
    formula_saved_bytes,
    layers_on_stage,
    stage_parameters,
)
from plait.planner.published import resolve_shape
from plait.planner.schedule_model import max_in_flight, pipeline_makespan
from plait.planner.search import plan, price, why_slower
from plait.planner.time_model import estimate_step_time

TINY = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}


def _job(**overrides: object) -> Job:
    values: dict[str, object] = dict(
        model=resolve_shape("llama:tiny", TINY),
        seq_len=128,
        global_batch=16,
        world=4,
        per_node=4,
        device=device_spec("H100-80GB"),
        precision=PRECISIONS["fp32"],
    )
    values.update(overrides)
    return Job(**values)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- model shape


def test_shape_matches_the_model_family_counts() -> None:
    from plait.plugins.models import resolve_model_config

    for spec, family, size in (("llama:7b", "llama", "7b"), ("gpt2:small", "gpt2", "small")):
        shape = resolve_shape(spec)
        config = resolve_model_config(family, size, {})
        assert shape.num_params == config.num_params()
        assert shape.dense_active_params == config.num_params(exclude_embeddings=True)
    moe = resolve_shape("moe:mixtral-8x7b")
    assert moe.num_experts == 8 and moe.active_params_per_layer < moe.params_per_layer


def test_bad_model_names_say_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match="family:size"):
        resolve_shape("llama")
    with pytest.raises(ConfigError, match=r"model\.name"):
        resolve_shape("bert:base")


# ------------------------------------------------------------------------------------ memory


def test_model_state_by_zero_stage_and_precision() -> None:
    job = _job()
    params = job.model.num_params
    expected = {  # (params, grads, optimizer) elements per rank, dp = 4
        0: (params, params, params),
        1: (params, params, params / 4),
        2: (params, params / 4, params / 4),
        3: (params / 4, params / 4, params / 4),
    }
    for zero, (p, g, o) in expected.items():
        memory = estimate_memory(job, Layout(dp=4, zero=zero, micro_batch=4))
        assert memory.parameters == pytest.approx(4 * p)
        assert memory.gradients == pytest.approx(4 * g)
        assert memory.optimizer_state == pytest.approx(8 * o)
        assert memory.master_weights == 0
    mixed = estimate_memory(_job(precision=PRECISIONS["bf16"]), Layout(dp=4, zero=1))
    assert mixed.parameters == pytest.approx(2 * params)
    assert mixed.master_weights == pytest.approx(4 * params / 4)


def test_activations_by_recompute_sp_cp_and_schedule() -> None:
    job = _job()
    model = job.model
    tokens = 4 * 128
    h, kv, f = model.dim, model.kv_dim, model.ffn_dim
    per_token = 4 * h + (2 * h + 2 * kv + 3 * f)  # norms in/out + q,k,v, attention out, SwiGLU
    none = estimate_memory(job, Layout(dp=4, micro_batch=4))
    assert none.activations == pytest.approx(model.n_layers * per_token * tokens * 4)
    full = estimate_memory(job, Layout(dp=4, micro_batch=4, recompute="full"))
    assert full.activations == pytest.approx((model.n_layers * h + per_token) * tokens * 4)
    selective = estimate_memory(job, Layout(dp=4, micro_batch=4, recompute="selective"))
    assert full.activations < selective.activations < none.activations
    # sequence parallelism shards the norm tensors too; cp shards the sequence
    tp = estimate_memory(job, Layout(dp=2, tp=2, micro_batch=4)).activations
    sp = estimate_memory(job, Layout(dp=2, tp=2, micro_batch=4, sequence_parallel=True))
    assert sp.activations == pytest.approx(none.activations / 2)
    assert sp.activations < tp < none.activations
    cp = estimate_memory(job, Layout(dp=2, cp=2, micro_batch=4)).activations
    assert cp == pytest.approx(none.activations / 2)
    # a 1F1B first stage keeps pp micro-batches' activations of its layers, GPipe all of them
    one_f = estimate_memory(job, Layout(dp=1, pp=4, micro_batch=1, schedule="1f1b"))
    gpipe = estimate_memory(job, Layout(dp=1, pp=4, micro_batch=1, schedule="gpipe"))
    one_layer = per_token * 128 * 4
    assert one_f.stage == 0 or one_f.activations >= 4 * one_layer
    assert max_in_flight("1f1b", stages=4, microbatches=16, virtual=1, rank=0) == 4
    assert max_in_flight("1f1b", stages=4, microbatches=16, virtual=1, rank=3) == 1
    assert max_in_flight("gpipe", stages=4, microbatches=16, virtual=1, rank=0) == 16
    assert gpipe.activations > one_f.activations


def test_activation_classes_calibrated_apart_price_tp_as_measured() -> None:
    # An implementation that keeps 1.7× the formula's width-h tensors (a norm's normalised
    # output besides its input) and 1.25× its tp-sharded ones (SwiGLU's silu output).
    job = _job()
    truth = dataclasses.replace(job, hidden_activation_ratio=1.7, activation_ratio=1.25)
    alone, tp2 = Layout(dp=1), Layout(dp=2, tp=2, micro_batch=2)
    measured = [(layout, formula_saved_bytes(job, layout)) for layout in (alone, tp2)]
    measured = [(layout, count.hidden * 1.7 + count.sharded * 1.25) for layout, count in measured]
    hidden, sharded = activation_ratios(measured, job)
    assert (hidden, sharded) == (pytest.approx(1.7), pytest.approx(1.25))
    calibrated = dataclasses.replace(job, hidden_activation_ratio=hidden, activation_ratio=sharded)
    tp4 = Layout(dp=1, tp=4, micro_batch=8)
    expected = estimate_memory(truth, tp4).activations
    assert estimate_memory(calibrated, tp4).activations == pytest.approx(expected)
    # one ratio fitted without tp, as before, under-prices tp4: its replicated share is larger
    single = dataclasses.replace(
        job, activation_ratio=measured[0][1] / formula_saved_bytes(job, alone).total
    )
    assert estimate_memory(single, tp4).activations < 0.97 * expected
    assert estimate_memory(single, alone).activations == pytest.approx(
        estimate_memory(truth, alone).activations
    )
    # two layouts with the same tp cannot separate the classes
    assert activation_ratios([measured[0], (Layout(dp=2), measured[0][1])], job) is None


def test_uneven_layer_split_and_stage_parameters() -> None:
    assert [layers_on_stage(126, 16, s) for s in range(16)].count(8) == 14
    assert sum(layers_on_stage(126, 16, s) for s in range(16)) == 126
    assert layers_on_stage(126, 16, 0) == 7 and layers_on_stage(126, 16, 15) == 7
    job = _job()
    layout = Layout(dp=1, pp=2, tp=2, micro_batch=4, schedule="1f1b")
    both = stage_parameters(job, layout, 0) + stage_parameters(job, layout, 1)
    assert both == pytest.approx(job.model.num_params / 2)


# ------------------------------------------------------------------------------ time & comm


def test_collective_formulas() -> None:
    link = Link(alpha=1e-5, beta=1e9)
    assert collective_seconds("all_reduce", 4, 1e6, link) == pytest.approx(6e-5 + 1.5e-3)
    assert collective_seconds("all_gather", 4, 1e6, link) == pytest.approx(3e-5 + 0.75e-3)
    assert collective_seconds("send", 2, 1e6, link) == pytest.approx(1e-5 + 1e-3)
    assert collective_seconds("all_reduce", 1, 1e6, link) == 0.0
    assert group_is_intra_node(8, 1, 8) and not group_is_intra_node(2, 8, 8)


def test_pipeline_makespan_is_the_simulated_schedule() -> None:
    # 1F1B without transfer costs: (m + p - 1)·(f + b) (Narayanan et al. 2021)
    for m, p in ((8, 4), (16, 4), (4, 4)):
        got = pipeline_makespan(
            "1f1b", stages=p, microbatches=m, virtual=1, forward=1.0, backward=2.0, p2p=0.0
        )
        assert got == pytest.approx((m + p - 1) * 3.0)
    # interleaving shrinks the bubble; a transfer cost lengthens the step
    plain = pipeline_makespan(
        "1f1b", stages=4, microbatches=8, virtual=1, forward=1.0, backward=2.0, p2p=0.0
    )
    interleaved = pipeline_makespan(
        "interleaved_1f1b", stages=4, microbatches=8, virtual=2, forward=0.5, backward=1.0, p2p=0.0
    )
    assert interleaved < plain
    slow = pipeline_makespan(
        "1f1b", stages=4, microbatches=8, virtual=1, forward=1.0, backward=2.0, p2p=0.5
    )
    assert slow > plain


def test_step_time_terms_respond_to_the_layout() -> None:
    job = _job(model=resolve_shape("llama:7b"), seq_len=4096, global_batch=64, world=16,
               per_node=8, precision=PRECISIONS["bf16"])  # fmt: skip
    base = estimate_step_time(job, Layout(dp=16, zero=1, micro_batch=1))
    assert base.tp_comm == 0 and base.pipeline_bubble == 0 and base.dp_comm > 0
    tp = estimate_step_time(job, Layout(dp=8, tp=2, zero=1, micro_batch=1))
    assert tp.tp_comm > 0
    # all-gather + reduce-scatter move what an all-reduce moves, in as many steps
    sp = estimate_step_time(job, Layout(dp=8, tp=2, zero=1, micro_batch=1, sequence_parallel=True))
    assert sp.tp_comm == pytest.approx(tp.tp_comm)
    pp = estimate_step_time(job, Layout(dp=4, pp=4, zero=1, micro_batch=1, schedule="1f1b"))
    assert pp.pipeline_bubble > 0
    full = estimate_step_time(job, Layout(dp=16, zero=1, micro_batch=1, recompute="full"))
    assert full.recompute > 0 and full.hfu > full.mfu
    assert full.model_flops == base.model_flops
    assert base.total == pytest.approx(sum(base.terms().values()))
    assert 0 < base.mfu < 1


def test_link_fit_recovers_alpha_and_beta() -> None:
    alpha, beta = 2e-5, 5e9
    samples = [
        CommSample(op=op, nbytes=n, group=g, intra_node=True,
                   seconds=collective_seconds(op, g, n, Link(alpha=alpha, beta=beta)))
        for op in ("all_reduce", "all_gather", "send")
        for g in (2, 4)
        for n in (1e3, 1e5, 1e7)
    ]  # fmt: skip
    samples.append(CommSample(op="all_reduce", nbytes=1e6, group=8, seconds=4e-4, intra_node=False))
    samples.append(
        CommSample(op="all_reduce", nbytes=1e7, group=8, seconds=3.5e-3, intra_node=False)
    )
    fit = fit_links(samples)
    assert fit.intra is not None and fit.inter is not None
    assert fit.intra.alpha == pytest.approx(alpha, rel=1e-3)
    assert fit.intra.beta == pytest.approx(beta, rel=1e-3)
    assert fit.inter.samples == 2


def test_each_collective_family_gets_its_own_fit() -> None:
    # Gloo-like: its all-gather moves a byte several times slower than its all-reduce, and a
    # send has a latency of its own; one α–β for all of them prices each off by a factor.
    truth = {
        "all_reduce": Link(alpha=1e-3, beta=1e9),
        "all_gather": Link(alpha=1.5e-3, beta=3e8),
        "send": Link(alpha=6e-4, beta=4e9),
    }
    samples = [
        CommSample(op=op, nbytes=n, group=g, intra_node=True,
                   seconds=collective_seconds(op, g, n, link))
        for op, link in truth.items()
        for g in ((2,) if op == "send" else (2, 4))
        for n in (6.5e4, 1e6, 4e6)
    ]  # fmt: skip
    # a family seen at one size only cannot separate α from β: it keeps the shared fit
    samples.append(
        CommSample(op="reduce_scatter", nbytes=1e6, group=4, seconds=8e-3, intra_node=True)
    )
    fit = fit_links(samples).intra
    assert fit is not None
    link = fit.link()
    for op, true_link in truth.items():
        for group, nbytes in ((4, 2e6), (2, 1e5)):
            expected = collective_seconds(op, group, nbytes, true_link)
            assert collective_seconds(op, group, nbytes, link) == pytest.approx(expected, rel=1e-6)
    assert collective_seconds("isend", 2, 1e6, link) == collective_seconds("send", 2, 1e6, link)
    assert {f.op for f in fit.by_op} == set(truth)
    assert link.for_op("reduce_scatter") == (fit.alpha, fit.beta)


def test_calibration_round_trip(tmp_path) -> None:
    samples = [
        CommSample(op="send", nbytes=n, group=2, seconds=1e-5 + n / 1e9, intra_node=True)
        for n in (1e3, 1e6)
    ]
    calibration = fit_links(samples, source="test")
    assert calibration.intra is not None and calibration.intra.by_op  # the sends' own fit
    calibration.save(tmp_path / "links.json")
    loaded = LinkCalibration.load(tmp_path / "links.json")
    assert loaded.intra == calibration.intra and loaded.inter is None
    assert loaded.intra.link() == calibration.intra.link()
    # a file written before per-collective fits existed still loads
    data = json.loads((tmp_path / "links.json").read_text())
    del data["intra"]["by_op"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = LinkCalibration.load(tmp_path / "old.json").intra
    assert old is not None and old.by_op == () and old.alpha == calibration.intra.alpha


def test_trace_spans_become_samples_by_host() -> None:
    def meta(rank: int, host: str) -> dict:
        name = f"rank {rank} ({host}, job j)"
        return {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}}

    def span(pid: int, ranks: list[int], nbytes: int, us: float, op: str = "all_reduce") -> dict:
        args = {"plait.comm.op": op, "plait.comm.bytes": nbytes, "plait.comm.group_ranks": ranks}
        return {"name": op, "cat": "comm", "ph": "X", "ts": 0, "dur": us, "pid": pid, "args": args}

    document = {
        "traceEvents": [
            meta(0, "a"), meta(1, "a"), meta(2, "b"),
            span(0, [0, 1], 1000, 10.0), span(0, [0, 1, 2], 2000, 30.0),
            span(0, [0], 10, 1.0, op="barrier"),
        ]
    }  # fmt: skip
    samples = samples_from_trace([document])
    assert [(s.group, s.intra_node, s.seconds) for s in samples] == [
        (2, True, 1e-5),
        (3, False, 3e-5),
    ]


def test_gemm_efficiency_fit() -> None:
    peak, e_max, half = 1e12, 0.8, 2e9
    rates = [(g, peak * e_max * g / (g + half)) for g in (1e8, 1e9, 1e10, 1e11)]
    fitted = efficiency_from_gemm_rates(rates, peak)
    assert fitted == pytest.approx((e_max, half), rel=1e-6)


# ------------------------------------------------------------------------------------ search


def test_enumeration_rules() -> None:
    job = _job(world=16, per_node=4, global_batch=32)
    layouts = list(enumerate_layouts(job))
    assert layouts
    for layout in layouts:
        assert layout.world == 16
        assert layout.tp <= 4 and job.model.n_heads % layout.tp == 0
        assert job.global_batch % (layout.dp * layout.micro_batch) == 0
        if layout.schedule == "1f1b":
            assert job.global_batch // (layout.dp * layout.micro_batch) >= layout.pp
        assert not (layout.zero == 3 and layout.pp > 1)
    assert {layout.tp for layout in layouts} == {1, 2, 4}
    wide = _job(world=16, per_node=8, global_batch=32)  # 4 heads: no tp 8 even in a node of 8
    assert max(layout.tp for layout in enumerate_layouts(wide)) == 4
    fixed = list(enumerate_layouts(job, SearchSpace(fixed={"tp": 2, "pp": 2})))
    assert fixed and all(layout.tp == 2 and layout.pp == 2 for layout in fixed)


def test_bad_search_input_names_the_field() -> None:
    with pytest.raises(ConfigError, match="recompute"):
        SearchSpace(recompute=("sometimes",))
    with pytest.raises(ConfigError, match="fixed"):
        SearchSpace(fixed={"xp": 2})
    with pytest.raises(ConfigError, match="per-node"):
        _job(world=12, per_node=8)
    with pytest.raises(ConfigError, match="--device"):
        device_spec("H100")


def test_plan_prunes_by_memory_and_ranks_by_time() -> None:
    job = _job(model=resolve_shape("llama:7b"), seq_len=4096, global_batch=64, world=16,
               per_node=8, precision=PRECISIONS["bf16"], device=DEVICES["A100-40GB"])  # fmt: skip
    result = plan(job, per_mesh=False)
    assert result.rejected_for_memory > 0
    times = [c.time.total for c in result.ranked]
    assert times == sorted(times)
    assert all(c.memory.total <= job.device.usable_memory for c in result.ranked)
    # DDP with fp32 masters cannot hold a 7B model's 18 bytes per parameter in 40 GB
    assert all(c.layout.zero or c.layout.tp * c.layout.pp > 1 for c in result.ranked)
    best = result.ranked[0]
    assert why_slower(best, best) == "fastest"
    assert "ms" in why_slower(result.ranked[-1], best) or " s " in why_slower(
        result.ranked[-1], best
    )
    per_mesh = plan(job)
    assert len({c.layout.degrees for c in per_mesh.ranked}) == len(per_mesh.ranked)
    assert per_mesh.ranked[0].time.total == pytest.approx(best.time.total)


# ------------------------------------------------------------------------ auto and explain


def _tiny_config() -> dict:
    return {
        "model": {"name": "llama", "size": "tiny", "overrides": TINY},
        "data": {"seq_len": 128},
        "train": {"global_batch_size": 16, "steps": 3},
    }


def test_layout_config_round_trips_through_the_engine_config() -> None:
    for layout in (
        Layout(dp=2, tp=2, micro_batch=4, sequence_parallel=True, recompute="selective"),
        Layout(dp=1, pp=4, micro_batch=2, schedule="interleaved_1f1b", virtual_stages=1),
        Layout(dp=4, zero=3, micro_batch=1),
    ):
        merged = merge_sections(_tiny_config(), layout_config(layout))
        load_config(merged)  # every field the layout writes is a real config field
        assert layout_from_config(merged, world=4) == layout


def test_auto_config_writes_the_best_layout() -> None:
    config, result = auto_config(_tiny_config(), world=4, per_node=4, device=DEVICES["H100-80GB"])
    assert layout_from_config(config, world=4) == result.best.layout
    assert config["model"] == _tiny_config()["model"]
    assert config["train"]["steps"] == 3  # the rest of the section is kept
    tiny_device = dataclasses.replace(DEVICES["H100-80GB"], memory_bytes=1e3)
    with pytest.raises(ConfigError, match="no layout"):
        auto_config(_tiny_config(), world=4, per_node=4, device=tiny_device)


class _Breakdown:
    def __init__(self, **values: object) -> None:
        defaults = dict(step_seconds=0.0, compute_seconds=0.0, exposed_comm_seconds=0.0,
                        pipeline_bubble_seconds=0.0, optimizer_seconds=0.0, data_wait_seconds=0.0,
                        host_other_seconds=0.0, exposed_comm_by_purpose={})  # fmt: skip
        defaults.update(values)
        self.__dict__.update(defaults)


def test_explain_names_the_term_that_was_off() -> None:
    job = _job()
    prediction = price(job, Layout(dp=4, micro_batch=4)).time
    terms = prediction.terms()
    right = dict(
        step_seconds=prediction.total,
        compute_seconds=terms["compute"],
        optimizer_seconds=terms["optimizer"],
        exposed_comm_seconds=terms["dp_comm"],
        exposed_comm_by_purpose={"grad_bucket": terms["dp_comm"]},
    )
    slow_comm = {**right, "exposed_comm_by_purpose": {"grad_bucket": 10 * terms["dp_comm"] + 1}}
    explanation = explain(prediction, [_Breakdown(**slow_comm), _Breakdown(**slow_comm)])
    assert explanation.worst.term == "dp_comm" and "underestimated" in explanation.verdict()
    slow_compute = {**right, "compute_seconds": 3 * terms["compute"]}
    assert explain(prediction, [_Breakdown(**slow_compute)]).worst.term == "compute"
    with pytest.raises(ValueError, match="no step"):
        explain(prediction, [])


# ------------------------------------------------------------------------------------- CLI


def test_cli_plan_defaults_to_search_and_reports_errors(tmp_path, monkeypatch) -> None:
    from plait.tools.plan_commands import app

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    runner = CliRunner()
    result = runner.invoke(
        app, ["llama:7b", "--world", "16", "--global-batch", "64", "--seq-len", "4096",
              "--top", "3"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "fastest" in result.output and "tp" in result.output
    bad = runner.invoke(app, ["llama:7b", "--world", "16", "--global-batch", "64",
                              "--device", "TPU"])  # fmt: skip
    assert bad.exit_code == 2 and "--device" in bad.output
    none_fit = runner.invoke(app, ["gpt3-175b", "--world", "8", "--global-batch", "8",
                                   "--device", "A100-40GB"])  # fmt: skip
    assert none_fit.exit_code == 1 and "no layout fits" in none_fit.output
    links = tmp_path / "plan-links.json"
    links.write_text(json.dumps({"intra": {"alpha": 1e-3, "beta": 1e6, "samples": 3,
                                           "rms_error_seconds": 0.0}, "inter": None,
                                 "source": "test", "measured_at": 0.0}))  # fmt: skip
    slow = runner.invoke(app, ["search", "llama:7b", "--world", "16", "--global-batch", "64",
                               "--seq-len", "4096", "--top", "1"])  # fmt: skip
    assert slow.exit_code == 0 and "links from" in slow.output


def test_cli_calibrate_and_explain_read_the_daemon(tmp_path, monkeypatch) -> None:
    from plait.planner import daemon_client
    from plait.tools.plan_commands import app

    link = Link(alpha=5e-5, beta=2e9)
    events = [
        {"name": "process_name", "ph": "M", "pid": r, "tid": 0,
         "args": {"name": f"rank {r} (node0, job j)"}}
        for r in range(2)
    ] + [
        {"name": "all_reduce", "cat": "comm", "ph": "X", "ts": 0, "pid": 0,
         "dur": collective_seconds("all_reduce", 2, n, link) * 1e6,
         "args": {"plait.comm.op": "all_reduce", "plait.comm.bytes": n,
                  "plait.comm.group_ranks": [0, 1]}}
        for n in (1e4, 1e6, 1e8)
    ]  # fmt: skip
    monkeypatch.setattr(
        daemon_client, "capture_trace", lambda host, job="": {"traceEvents": events}
    )
    out = tmp_path / "links.json"
    runner = CliRunner()
    result = runner.invoke(app, ["calibrate", "--host", "h:1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    fitted = LinkCalibration.load(out).intra
    assert fitted is not None and fitted.beta == pytest.approx(2e9, rel=1e-3)

    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\nname = "llama"\nsize = "tiny"\n[train]\nglobal_batch_size = 8\n'
        '[parallel]\ndp_strategy = "zero1"\n'
    )
    breakdown = _Breakdown(step_seconds=1.0, compute_seconds=0.9, exposed_comm_seconds=0.05)
    monkeypatch.setattr(daemon_client, "measured_breakdowns", lambda *a, **k: [breakdown])
    result = runner.invoke(
        app,
        ["explain", "--config", str(config), "--world", "2", "--per-node", "2",
         "--host", "h:1", "--links", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "tp1 pp1 dp2 zero1" in result.output and "compute was off most" in result.output


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_shapes_count_what_the_built_model_holds(family: str) -> None:
    from plait.core.kernels import Kernels
    from plait.core.plugins import Plugins
    from plait.planner.model_shape import shape_from_config
    from plait.plugins.models import gpt2, llama, resolve_model_config

    config = resolve_model_config(family, "small", {"dim": 64, "n_heads": 4, "n_layers": 2})
    build = llama.build_llama if family == "llama" else gpt2.build_gpt2
    with torch.device("meta"):
        model = build(config, Kernels(Plugins.create(autoload=False)))
    shape = shape_from_config(family, config)
    block = next(iter(model.layers.values()))
    assert shape.params_per_layer == sum(p.numel() for p in block.parameters())
    ffn = sum(p.numel() for p in block.feed_forward.parameters() if p.dim() == 2)
    assert ffn == shape.ffn_matrices * shape.dim * shape.ffn_dim

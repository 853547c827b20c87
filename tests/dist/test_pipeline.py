"""Pipeline parallelism: stage split, every schedule against a single process, pp × dp, errors.

Tolerance: fp32 on CPU. A pipeline runs the very same operations per micro-batch as one process
and accumulates gradients in the same micro-batch order, so losses agree to rounding; 1e-5
absolute/relative covers the different summation order of the data-parallel all-reduce and of
the zero-bubble weight gradient (summed from saved intermediate gradients).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.core.errors import ConfigError
from plait.testing.distributed import run_distributed
from plait.plugins.models.llama import Llama, LlamaConfig
from plait.plugins.pipeline.split import build_chunk, partition, plan_stages
from plait.plugins.pipeline.timeline import theoretical_bubble_fraction
from tests.dist import pp_workers

TOL = 1e-5
STEPS = 5
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]


def _meta_llama(**overrides: Any) -> Llama:
    config = LlamaConfig.from_preset("tiny", {**pp_workers.MODEL, **overrides})
    with torch.device("meta"):
        return Llama(config, kernels=None)  # type: ignore[arg-type]


def _runs(pp: int, global_batch: int = 4) -> list[dict[str, Any]]:
    return [
        {
            "schedule": s,
            "pp": pp,
            "virtual": 2 if s == "interleaved_1f1b" else 1,
            "global_batch": global_batch,
        }
        for s in SCHEDULES
    ]


@pytest.fixture(scope="module")
def single_process() -> dict[int, dict[str, Any]]:
    """The reference: one process, gradient accumulation, for the global batches used below."""
    runs = [{"schedule": "accumulate", "pp": 1, "global_batch": b} for b in (4, 8)]
    (results,) = run_distributed(pp_workers.train, 1, runs, STEPS, timeout=120)
    return {4: results[0], 8: results[1]}


def _same_shard(full: torch.Tensor, *, like: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The tensor-parallel shard of `full` this rank holds (the whole tensor if replicated)."""
    for dim, (whole, part) in enumerate(zip(full.shape, like.shape, strict=True)):
        if whole != part:
            return full.narrow(dim, tp_rank * part, part)
    return full


def _assert_matches(run: dict[str, Any], reference: dict[str, Any], *, covered: set[str]) -> None:
    what = f"{run['schedule']} pp={run['pp']}"
    torch.testing.assert_close(
        torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=TOL, atol=TOL
    )
    torch.testing.assert_close(
        torch.tensor(run["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=TOL, atol=TOL
    )
    assert len(run["grads"]) == STEPS
    for step, (got, want) in enumerate(zip(run["grads"], reference["grads"], strict=True)):
        for name, grad in got.items():
            torch.testing.assert_close(
                grad,
                _same_shard(want[name], like=grad, tp_rank=run["tp_rank"]),
                rtol=TOL,
                atol=TOL,
                msg=lambda m, s=step, n=name: f"{what} step {s} {n}: {m}",
            )
        covered.update(got)
    # The measured bubble can exceed the schedule's theory (P2P latency, uneven stages), but it
    # cannot be much below it: the dependencies force that much idle time on some rank. A
    # measurement that counted waits as work, or timed the wrong window, falls under this.
    theory, _ = theoretical_bubble_fraction(
        run["schedule"],
        num_stages=run["pp"],
        num_microbatches=run["num_microbatches"],
        virtual_stages=run.get("virtual", 1),
    )
    assert all(0.5 * theory <= b < 1.0 for b in run["bubbles"]), (what, theory, run["bubbles"])
    assert run["idle_spans"] > 0, f"{what}: waits for peers must appear as 'idle' spans"
    # every compute action is timed under its kind, and the kinds make up the busy time
    chunks = run["num_microbatches"] * run.get("virtual", 1)
    split = run["schedule"].startswith("zb")
    expected = (
        {"forward": chunks, "backward_input": chunks, "backward_weight": chunks}
        if split
        else {"forward": chunks, "backward": chunks}
    )
    assert run["kind_counts"] == expected and run["kinds_add_up"], (what, run["kind_counts"])
    assert run["waits_in_window"], f"{what}: waits for peers counted outside the compute window"


# -- the split, on the meta device -------------------------------------------------------------


def test_split_balances_cost_and_keeps_every_layer() -> None:
    # A 4096-token vocabulary makes the head cost about three blocks: the last stage must take
    # fewer blocks than the first, and the split is reported as uneven.
    model = _meta_llama(vocab_size=4096)
    plan = plan_stages(model, num_stages=2, virtual_stages=1, balance="flops", seq_len=16)
    first, last = plan.chunks
    assert len(first.layers) > len(last.layers)
    assert [n for c in plan.chunks for n in c.layers] == [str(i) for i in range(8)]
    assert "embeddings, layers 0-" in plan.describe() and "head" in plan.describe()
    by_count = partition([1.0] * 8, 2, first_extra=0.0, last_extra=0.0)
    assert by_count == [4, 4]

    stage = build_chunk(model, last)
    names = [n for n, _ in stage.named_parameters()]
    assert stage.tok_embeddings is None and stage.norm is not None
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == set(last.layers)
    assert "output.weight" in names


def test_split_by_params_and_explicit_layers() -> None:
    model = _meta_llama()
    plan = plan_stages(model, num_stages=2, virtual_stages=2, balance="params", seq_len=16)
    assert [c.rank for c in plan.chunks] == [0, 1, 0, 1]
    assert [c.chunk for c in plan.chunks] == [0, 0, 1, 1]
    explicit = plan_stages(
        model,
        num_stages=2,
        virtual_stages=1,
        balance="flops",
        seq_len=16,
        layers_per_stage=[6, 2],
    )
    assert [len(c.layers) for c in explicit.chunks] == [6, 2]
    with pytest.raises(ConfigError, match="summing to the model's 8 layers"):
        plan_stages(
            model,
            num_stages=2,
            virtual_stages=1,
            balance="flops",
            seq_len=16,
            layers_per_stage=[6, 1],
        )


def test_fewer_layers_than_chunks_is_an_error() -> None:
    with pytest.raises(ConfigError, match="8 transformer blocks but pp=4 × virtual_stages=4"):
        plan_stages(_meta_llama(), num_stages=4, virtual_stages=4, balance="flops", seq_len=16)


# -- against a single process ------------------------------------------------------------------


@pytest.mark.dist
def test_every_schedule_pp2_matches_single_process(single_process: dict[int, Any]) -> None:
    # The configuration errors are checked in the same spawn, after the schedules.
    runs = [*_runs(2), {"errors": True}]
    ranks = run_distributed(pp_workers.train, 2, runs, STEPS, timeout=180)
    for index, schedule in enumerate(SCHEDULES):
        covered: set[str] = set()
        for rank_runs in ranks:
            run = rank_runs[index]
            _assert_matches(run, single_process[4], covered=covered)
            if run["virtual"] == 1:
                # One activation and one gradient per micro-batch cross the stage boundary.
                assert run["ops_per_step"]["activation"] == 4, run["ops_per_step"]
                assert run["ops_per_step"]["activation_grad"] == 4, run["ops_per_step"]
            # Receives are posted ahead of the compute before them; only a receive that opens
            # the action list (stage 1's first activation) is posted by its own action.
            assert run["late_receives"] <= 1, (schedule, run["late_receives"])
        assert covered == set(single_process[4]["grads"][0]), f"{schedule}: parameters missing"
    for rank_runs in ranks:
        found = rank_runs[-1]
        assert "'1f1b' with pp=2 needs at least as many micro-batches" in found["microbatches"]
        assert "needs 16 chunks of at least one block" in found["layers"]


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list[list[dict[str, Any]]]]:
    """One 4-rank spawn for pp=4 and pp2×dp2 (starting ranks costs more than their steps)."""
    pp4 = _runs(4)
    pp2_dp2 = [r for r in _runs(2, global_batch=8) if r["schedule"] != "gpipe"]
    pp2_tp2 = [
        {"schedule": s, "pp": 2, "tp": 2, "global_batch": 4, "sequence_parallel": sp}
        for s, sp in (("1f1b", False), ("zb_h1", False), ("1f1b", True))
    ]
    runs = [*pp4, *pp2_dp2, *pp2_tp2]
    ranks = run_distributed(pp_workers.train, 4, runs, STEPS, timeout=240)
    bounds = {"pp4": (0, len(pp4)), "pp2_dp2": (len(pp4), len(pp4) + len(pp2_dp2))}
    bounds["pp2_tp2"] = (bounds["pp2_dp2"][1], len(runs))
    return {
        key: [rank_runs[start:end] for rank_runs in ranks] for key, (start, end) in bounds.items()
    }


@pytest.mark.dist
def test_every_schedule_pp4_matches_single_process(
    single_process: dict[int, Any], four_ranks: dict[str, Any]
) -> None:
    ranks = four_ranks["pp4"]
    for index, schedule in enumerate(SCHEDULES):
        covered: set[str] = set()
        for rank_runs in ranks:
            _assert_matches(rank_runs[index], single_process[4], covered=covered)
        assert covered == set(single_process[4]["grads"][0]), f"{schedule}: parameters missing"
    interleaved = ranks[0][SCHEDULES.index("interleaved_1f1b")]
    assert interleaved["plan"] == [(str(i),) for i in range(8)]


@pytest.mark.dist
def test_pp2_dp2_matches_single_process(
    single_process: dict[int, Any], four_ranks: dict[str, Any]
) -> None:
    ranks = four_ranks["pp2_dp2"]
    for index in range(len(ranks[0])):
        covered: set[str] = set()
        for rank_runs in ranks:
            run = rank_runs[index]
            _assert_matches(run, single_process[8], covered=covered)
            # Whatever the schedule, every gradient bucket is reduced exactly once per step.
            assert run["num_buckets"] >= 1
            assert run["ops_per_step"]["grad_bucket"] == run["num_buckets"], run["ops_per_step"]
        assert covered == set(single_process[8]["grads"][0]), f"{ranks[0][index]}: missing"


@pytest.mark.dist
def test_pp2_tp2_matches_single_process(
    single_process: dict[int, Any], four_ranks: dict[str, Any]
) -> None:
    # One KV head over tp=2 is replicated: its partial gradients are summed over tp from
    # gradient hooks, which the zero-bubble weight half must fire too.
    ranks = four_ranks["pp2_tp2"]
    for index in range(len(ranks[0])):
        covered: set[str] = set()
        for rank_runs in ranks:
            _assert_matches(rank_runs[index], single_process[4], covered=covered)
        assert covered == set(single_process[4]["grads"][0]), f"{ranks[0][index]}: missing"

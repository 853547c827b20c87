"""Three-dimensional layouts on 8 Gloo ranks against one process: pp2 × dp2 × tp2 (1F1B and
zero-bubble), cp2 × dp2 × tp2 with sequence parallelism, cp2 × pp2 × dp2, and the MoE model with
its experts over ep2 inside dp2 beside tp2 × pp2, and over ep4 beside tp2. Each: the loss within
1e-5 and every gradient a rank holds within 2e-5 of the one-process run at each of 5 steps.

`PLAIT_EIGHT_RANK_SCALE` picks the size: `tiny` (the default, this suite on 2 cores), `large`
(`tools/gpu_check.py` on a 16-core node: a wider, deeper model on longer sequences) or
`rehearsal` (the first case only, tiny: `gpu_check --rehearse` proves its plumbing)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import cp_workers, moe_workers

pytestmark = pytest.mark.dist

STEPS = 5
WORLD = 8
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 2e-5
SCALE = os.environ.get("PLAIT_EIGHT_RANK_SCALE", "tiny")
TIMEOUT = 900.0 if SCALE == "large" else 300.0

if SCALE == "large":
    LLAMA = {"dim": 128, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "max_seq_len": 128}
    MOE = {"dim": 128, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "max_seq_len": 128,
           "num_experts": 8, "expert_hidden_dim": 64}  # fmt: skip
    SEQ, BATCH = 64, 16
else:
    LLAMA, MOE, SEQ, BATCH = {}, {}, 16, 8


def _llama(**parallel: Any) -> dict[str, Any]:
    extra = parallel.pop("extra", {})
    return {
        "model": {"name": "llama", "size": "tiny", "overrides": LLAMA},
        "data": {"seq_len": SEQ},
        "train": {"global_batch_size": BATCH, "micro_batch_size": 2},
        **({"parallel": parallel} if parallel else {}),
        **extra,
    }


def _moe(**parallel: Any) -> dict[str, Any]:
    extra = parallel.pop("extra", {})
    return {
        "model": {"name": "moe", "size": "tiny", "overrides": MOE},
        "data": {"seq_len": SEQ},
        "train": {"global_batch_size": BATCH, "micro_batch_size": 2},
        "parallel": {"transforms": {"ep": "ep"}, **parallel},
        **extra,
    }


ONE_F_ONE_B = {"schedule": {"name": "1f1b"}}
LLAMA_CASES = {
    "pp2-dp2-tp2-1f1b": _llama(pp=2, dp=2, tp=2, extra=ONE_F_ONE_B),
    "pp2-dp2-tp2-zb": _llama(pp=2, dp=2, tp=2, extra={"schedule": {"name": "zb_h1"}}),
    "cp2-dp2-tp2-sp": _llama(cp=2, dp=2, tp=2, extra={"tp": {"sequence_parallel": True}}),
    "cp2-pp2-dp2": _llama(cp=2, pp=2, dp=2, extra=ONE_F_ONE_B),
}
MOE_CASES = {
    "ep2-dp2-tp2-pp2": _moe(ep=2, tp=2, pp=2, extra=ONE_F_ONE_B),
    "ep4-dp4-tp2": _moe(ep=4, tp=2),
}
if SCALE == "rehearsal":
    LLAMA_CASES, MOE_CASES = dict(list(LLAMA_CASES.items())[:1]), {}


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Any]]:
    """One process: the Llama and the MoE model, each trained alone."""
    (llama,) = run_distributed(
        cp_workers.train_and_record, 1, {"llama": _llama()}, STEPS, timeout=TIMEOUT
    )
    results = dict(llama)
    if MOE_CASES:
        (moe,) = run_distributed(
            moe_workers.train_and_record, 1, {"moe": _moe()}, STEPS, timeout=TIMEOUT
        )
        results |= moe
    return results


@pytest.fixture(scope="module")
def eight_ranks() -> list[dict[str, dict[str, Any]]]:
    """One spawn of 8 ranks trains every case (starting ranks costs more than their steps)."""
    return run_distributed(_train_all, WORLD, LLAMA_CASES, MOE_CASES, timeout=TIMEOUT)


def _train_all(
    rank: int, world_size: int, llama: dict[str, Any], moe: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    results = cp_workers.train_and_record(rank, world_size, llama, STEPS)
    return results | moe_workers.train_and_record(rank, world_size, moe, STEPS)


def _pieces(held: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, slices, gradient) of every piece a rank recorded at one step; the two workers
    record a list of pieces and a single piece per parameter."""
    found = []
    for name, value in held.items():
        for slices, grad in value if isinstance(value, list) else [value]:
            found.append((name, slices, grad))
    return found


def _whole(reference_step: dict[str, Any]) -> dict[str, Any]:
    return {name: pieces[0][2] for name, pieces in _group(_pieces(reference_step)).items()}


def _group(pieces: list[tuple[str, Any, Any]]) -> dict[str, list[tuple[str, Any, Any]]]:
    grouped: dict[str, list[tuple[str, Any, Any]]] = {}
    for piece in pieces:
        grouped.setdefault(piece[0], []).append(piece)
    return grouped


def _assert_matches(case: str, ranks: list[dict[str, Any]], single: dict[str, Any]) -> None:
    compared, over = 0, []
    for rank, results in enumerate(ranks):
        got = results[case]
        worst = max(abs(a - b) for a, b in zip(got["losses"], single["losses"], strict=True))
        assert worst <= LOSS_TOLERANCE, (case, rank, got["losses"], single["losses"])
        for a, b in zip(got["grad_norms"], single["grad_norms"], strict=True):
            assert abs(a - b) <= GRAD_TOLERANCE, (case, rank, "grad norm", a, b)
        assert len(got["grads"]) == STEPS, (case, rank)
        for step, (held, whole) in enumerate(zip(got["grads"], single["grads"], strict=True)):
            full = _whole(whole)
            for name, slices, grad in _pieces(held):
                index = tuple(slice(offset, offset + size) for offset, size in slices)
                expected = full[name][index]
                difference = (expected - grad).abs().max().item()
                if difference > GRAD_TOLERANCE:
                    over.append((difference, step, rank, name, expected.abs().max().item()))
                compared += 1
    assert compared, f"{case}: no gradient was compared"
    # Every gradient over the bound, worst first, with its size: a drift that grows step by
    # step reads differently from one wrong tensor.
    largest = sorted(over, reverse=True)[:8]
    assert not over, f"{case}: (difference, step, rank, name, largest |gradient|) {largest}"


@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.parametrize("case", [*LLAMA_CASES, *MOE_CASES])
def test_eight_ranks_match_one_process(
    case: str, eight_ranks: list[dict[str, Any]], reference: dict[str, dict[str, Any]]
) -> None:
    single = reference["moe" if case in MOE_CASES else "llama"]
    _assert_matches(case, eight_ranks, single)


def test_every_rank_holds_a_share_of_every_layout(eight_ranks: list[dict[str, Any]]) -> None:
    """Each case ran on all 8 ranks, and every rank compared some gradient."""
    assert len(eight_ranks) == WORLD
    for case in [*LLAMA_CASES, *MOE_CASES]:
        assert all(results[case]["grads"][0] for results in eight_ranks), case

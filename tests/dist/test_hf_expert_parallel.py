"""Expert parallelism for `transformers` MoE models through their experts interface, against the
user's plain single-process loop: Mixtral at ep 2 (alone, under ZeRO-2, and with
`output_router_logits=True`, whose load-balancing loss covers both ranks' tokens), Qwen2-MoE
(shared expert, gated), Qwen3-MoE (`norm_topk_prob`) and GPT-OSS (transposed experts with
biases and a gate of its own). Every case: 5 steps, fp32, the loss within 1e-5, every gradient
a rank holds within 2e-5 at each step (ZeRO: the global gradient norm) and every parameter
piece after them. Then a Mixtral checkpoint saved at ep 2 resumes at ep 1 on the plain loop's
losses, and a Mixtral trained at ep 2 exports a folder `from_pretrained` loads with the trained
model's logits. One spawn of 2 ranks runs everything."""

from __future__ import annotations

from typing import Any

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import hf_parallel_workers
from tests.dist.test_hf_context_parallel import assert_matches_plain_loop

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

TIMEOUT = 420.0
EP2 = {"parallel": {"ep": 2}}
CASES = {
    "mixtral-ep2": {"family": "mixtral", "config": EP2},
    "mixtral-ep2-zero2": {
        "family": "mixtral",
        "config": {"parallel": {"ep": 2, "dp_strategy": "zero2"}},
    },
    "mixtral-ep2-router-aux-loss": {
        "family": "mixtral",
        "model": {"output_router_logits": True, "router_aux_loss_coef": 0.1},
        "config": EP2,
    },
    "qwen2_moe-ep2-shared-expert": {"family": "qwen2_moe", "config": EP2},
    "qwen3_moe-ep2-norm-topk": {
        "family": "qwen3_moe",
        "model": {"norm_topk_prob": True},
        "config": EP2,
    },
    "gpt_oss-ep2": {"family": "gpt_oss", "config": EP2},
}
# Each step routes 4 sequences × 16 tokens to 2 experts each, summed over both ranks.
ASSIGNMENTS_PER_STEP = hf_parallel_workers.GLOBAL_BATCH * hf_parallel_workers.SEQ * 2


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("hf-ep")
    return run_distributed(hf_parallel_workers.expert_runs, 2, CASES, str(out), timeout=TIMEOUT)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_matches_the_plain_loop(case: str, two_ranks: Any) -> None:
    assert_matches_plain_loop(two_ranks, case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tokens_travel_by_all_to_all_and_the_load_is_reported(case: str, two_ranks: Any) -> None:
    for results in two_ranks:
        got = results[case]
        assert got["comm"].get("all_to_all/moe_dispatch", 0) > 0, got["comm"]
        assert got["comm"].get("all_to_all/moe_combine", 0) > 0, got["comm"]
        load = got["expert_load"]
        assert sorted(load) == ["model.layers.0.mlp", "model.layers.1.mlp"], load
        assert all(sum(counts) == ASSIGNMENTS_PER_STEP for counts in load.values()), load
        assert all(len(counts) == 4 for counts in load.values()), load


def test_router_aux_loss_is_taken_over_both_ranks_tokens(two_ranks: Any) -> None:
    for results in two_ranks:
        assert results["mixtral-ep2-router-aux-loss"]["comm"].get("all_gather/moe_aux_loss", 0)
        assert "all_gather/moe_aux_loss" not in results["mixtral-ep2"]["comm"]


def test_checkpoint_saved_at_ep2_resumes_at_ep1(two_ranks: Any) -> None:
    for results in two_ranks:
        resume = results["resume"]
        assert resume["start"] == 3
        assert resume["experts_held_after_resume"] == 4  # ep 1: every expert on every rank
        assert resume["loss"] <= 1e-5, resume


def test_export_after_ep2_loads_in_transformers_with_the_same_logits(two_ranks: Any) -> None:
    export = two_ranks[0]["export"]
    assert export["experts_held"] == 2  # trained with half of the experts on each rank
    assert export["class"] == "MixtralForCausalLM" and export["experts_loaded"] == 4
    assert export["logits"] <= 1e-5, export


def test_exported_folder_is_what_save_pretrained_writes(two_ranks: Any) -> None:
    export = two_ranks[0]["export"]
    # transformers saves Mixtral's fused experts back as per-expert tensors; so does the export.
    assert export["tensors"] == export["save_pretrained_tensors"]
    assert any(".experts.3.w1.weight" in name for name in export["tensors"])

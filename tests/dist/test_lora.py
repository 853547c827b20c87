"""LoRA adapters (peft) under DDP, ZeRO-1/2/3 and context parallelism on 2 Gloo ranks equal one
process; the frozen base takes no gradient bucket, no reduction and no optimizer state.

Adapters come from plait's `lora` transform (`[peft]`) or from the user's own `PeftModel`.
Figures checked: optimizer state = 8 bytes (fp32 Adam's two moments) per adapter parameter,
summed over the ranks that shard it; gradient bytes reduced per step = 4 per adapter parameter.
"""

from __future__ import annotations

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist import lora_workers

pytest.importorskip("transformers")
pytest.importorskip("peft")

LORA = {"parallel": {"transforms": {"adapter": "lora"}}, "peft": {
    "r": lora_workers.RANK, "alpha": 16, "target_modules": lora_workers.TARGETS,
}}  # fmt: skip
SHARDED = ("zero1", "zero2", "zero3")
CASES = {
    "ddp": {"config": {**LORA, "parallel": {**LORA["parallel"], "dp_strategy": "ddp"}}},
    **{
        name: {"config": {**LORA, "parallel": {**LORA["parallel"], "dp_strategy": name}}}
        for name in SHARDED
    },
    # Context parallelism: each rank holds half of every sequence, the adapters whole.
    "cp2": {"config": {**LORA, "parallel": {**LORA["parallel"], "cp": 2}}},
    "users_peft_model_ddp": {"users_model": True, "config": {"parallel": {"dp_strategy": "ddp"}}},
    "users_peft_model_zero2": {
        "users_model": True,
        "config": {"parallel": {"dp_strategy": "zero2"}},
    },
    "users_peft_model_zero3": {
        "users_model": True,
        "config": {"parallel": {"dp_strategy": "zero3"}},
    },
}


@pytest.fixture(scope="module")
def reference() -> dict:
    return lora_workers.plain_loop()


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """Every case on 2 ranks, in one start-up (rank 1's base starts perturbed: see the worker)."""
    return run_distributed(lora_workers.train_cases, 2, CASES, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(CASES))
def test_lora_equals_one_process(name: str, reference: dict, runs: list[dict]) -> None:
    ranks = [run[name] for run in runs]
    assert all(r["cp"] == (2 if name == "cp2" else 1) for r in ranks)
    adapters = reference["adapters"]
    adapter_numel = sum(t.numel() for t in adapters.values())
    for result in ranks:
        assert result["module_class"] == "PeftModelForCausalLM"
        assert result["adapter_numel"] == adapter_numel  # the adapters alone train
        assert result["frozen_numel"] == result["base_numel"]  # the whole base is frozen
        assert result["frozen_unchanged"], "a frozen base weight changed or differs by rank"
        worst = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True))
        assert worst <= 1e-5, (result["losses"], reference["losses"])
        # Only the adapters' gradients travel: 4 bytes (fp32) each, once per step.
        assert sum(result["gradient_bytes_last_step"].values()) == 4 * adapter_numel
    # fp32 Adam: two moments of 4 bytes per adapter parameter, held once across the ranks.
    held = [r["optimizer_state_bytes"] for r in ranks]
    sharded = name.split("_")[-1] in SHARDED
    assert (sum(held) if sharded else held[0]) == 8 * adapter_numel
    if not sharded:
        assert held[0] == held[1]
    # The trained adapters equal the plain loop's, piece by piece, and the ranks cover them.
    covered = {n: 0 for n in adapters}
    for result in ranks:
        for entry_name, pieces in result["adapter_pieces"].items():
            full = adapters[entry_name].reshape(-1)
            for (start, end), values in pieces:
                assert torch.allclose(values, full[start:end], atol=1e-5, rtol=0), entry_name
                covered[entry_name] += end - start if sharded else 0
    if sharded:
        assert covered == {n: t.numel() for n, t in adapters.items()}
    # Checkpoints leave the base out when the transform added the adapters (it is hashed);
    # a user's own PeftModel is checkpointed whole.
    assert all((r["frozen_in_checkpoints"] == 0) != name.startswith("users") for r in ranks)
    # The frozen base: whole on every rank, but sharded by ZeRO-3 (each rank holds its half).
    base_numel = ranks[0]["base_numel"]
    if name.endswith("zero3"):
        assert sum(r["frozen_held"] for r in ranks) == base_numel
        assert all(r["frozen_held"] < base_numel for r in ranks)
        assert all(r["frozen_bytes"] <= 4 * (base_numel // 2 + 64) for r in ranks)
    else:
        assert all(r["frozen_held"] == base_numel for r in ranks)

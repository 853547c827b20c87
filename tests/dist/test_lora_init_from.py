"""LoRA on plait's built-in Llama from a pretrained plait checkpoint (`checkpoint_io.init_from`)
on 2 Gloo ranks (DDP, ZeRO-3, pp = 2, tp = 2): the frozen base holds the pretrained weights,
the losses equal one process's that wrote them in by hand, the base's record is the hash of
those weights, and a job resumed from its own adapter checkpoint (the base from `init_from`
first) equals the uninterrupted one; resumed without `init_from`, its base fails the hash
check. With the head a module to save (ZeRO-3), its trained copy starts from the pretrained head
and resumes from the job's checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist import lora_init_from_workers as workers

pytest.importorskip("peft")

LAYOUTS = {
    "ddp": {"parallel": {"dp_strategy": "ddp"}},
    "zero3": {"parallel": {"dp_strategy": "zero3"}},
    # The base's record taken over the stages' tensors, and over whole tensors of tp slices.
    "pp2": {"parallel": {"pp": 2}, "schedule": {"name": "gpipe"}, "train": {"micro_batch_size": 2}},
    "tp2": {"parallel": {"tp": 2}},
    # The head trained in full beside the attention's adapters: its trained copy starts from the
    # pretrained head, its frozen original is hashed as the base's.
    "zero3_saved_head": {
        "parallel": {"dp_strategy": "zero3"},
        "peft": {"target_modules": ["wq", "wk", "wv", "wo"], "modules_to_save": ["output"]},
    },
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("pretrained")
    weights = workers.pretrain(str(folder))
    return str(folder), weights


@pytest.fixture(scope="module")
def references(pretrained: tuple[str, dict[str, torch.Tensor]]) -> dict[str, dict]:
    """One process's job for each `[peft]` of `LAYOUTS` (by layout name)."""
    adapters = workers.reference(pretrained[1])
    return {
        name: workers.reference(pretrained[1], layout) if "peft" in layout else adapters
        for name, layout in LAYOUTS.items()
    }


@pytest.fixture(scope="module")
def runs(
    pretrained: tuple[str, dict[str, torch.Tensor]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict]]:
    folder, weights = pretrained
    return {
        name: run_distributed(
            workers.train,
            2,
            {
                "layout": layout,
                "pretrained": folder,
                "weights": weights,
                "folder": str(tmp_path_factory.mktemp(f"lora_{name}") / "ckpt"),
            },
            timeout=120,
        )
        for name, layout in LAYOUTS.items()
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_lora_from_a_pretrained_checkpoint(
    name: str,
    pretrained: tuple[str, dict[str, torch.Tensor]],
    references: dict[str, dict],
    runs: dict[str, list[dict]],
) -> None:
    ranks, reference = runs[name], references[name]
    for result in ranks:
        whole = result["whole"]
        assert whole["start"] == 0
        losses = [whole["losses"][step] for step in sorted(whole["losses"])]
        worst = max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True))
        assert worst <= 1e-5, (losses, reference["losses"])
        assert whole["base_same"], "the frozen base does not hold the pretrained weights"
        # The head's trained copy starts from the pretrained head.
        assert whole["copy_is_base"] is ("peft" in LAYOUTS[name] or None)
        # The base's record: the hash of the weights loaded, and where they came from.
        per_tensor = whole["record"].get("scheme") == "per-tensor"
        assert per_tensor == (name in ("pp2", "tp2"))
        assert whole["record"]["sha256"] == reference["per_tensor" if per_tensor else "sha256"]
        assert Path(whole["record"]["loaded_from"]).parent == Path(pretrained[0])
    base_held = [r["whole"]["base_held"] for r in ranks]
    if name in ("zero3", "tp2", "pp2", "zero3_saved_head"):  # each rank loaded its part
        assert base_held[0] < sum(base_held) and base_held[1] < sum(base_held)
    else:
        assert base_held[0] == base_held[1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_resumed_lora_job_equals_the_uninterrupted_one(
    name: str, runs: dict[str, list[dict]]
) -> None:
    for result in runs[name]:
        whole, stopped, resumed = result["whole"], result["stopped"], result["resumed"]
        assert sorted(stopped["losses"]) == list(range(workers.STOP))
        assert resumed["start"] == workers.STOP
        assert resumed["base_same"], "the resumed job's base is not the pretrained one"
        # The trained copy is the checkpoint's, not the pretrained head (compared below).
        assert resumed["copy_is_base"] is (False if "peft" in LAYOUTS[name] else None)
        for step, loss in resumed["losses"].items():
            assert loss == pytest.approx(whole["losses"][step], abs=1e-6), step
        assert resumed["record"] == whole["record"]
        for entry, pieces in resumed["adapters"].items():
            for (region, values), (_, expected) in zip(
                pieces, whole["adapters"][entry], strict=True
            ):
                assert torch.allclose(values, expected, atol=1e-6, rtol=0), (entry, region)
        # Without init_from the base is the random init: the adapters are refused for it.
        assert "set checkpoint_io.init_from" in (result["without_init_from"] or "")

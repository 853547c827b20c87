"""LoRA on plait's built-in Llama from a pretrained plait checkpoint (`checkpoint_io.init_from`)
under DDP and ZeRO-3 on 2 Gloo ranks: the frozen base holds the pretrained weights, the losses
equal one process's that wrote them in by hand, the base's record is the hash of those weights,
and a job resumed from its own adapter checkpoint (the base from `init_from` first) equals the
uninterrupted one; resumed without `init_from`, its base fails the hash check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist import lora_init_from_workers as workers

pytest.importorskip("peft")

STRATEGIES = ("ddp", "zero3")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("pretrained")
    weights = workers.pretrain(str(folder))
    return str(folder), weights


@pytest.fixture(scope="module")
def reference(pretrained: tuple[str, dict[str, torch.Tensor]]) -> dict:
    return workers.reference(pretrained[1])


@pytest.fixture(scope="module")
def runs(
    pretrained: tuple[str, dict[str, torch.Tensor]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict]]:
    folder, weights = pretrained
    return {
        strategy: run_distributed(
            workers.train,
            2,
            {
                "dp_strategy": strategy,
                "pretrained": folder,
                "weights": weights,
                "folder": str(tmp_path_factory.mktemp(f"lora_{strategy}") / "ckpt"),
            },
            timeout=120,
        )
        for strategy in STRATEGIES
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_from_a_pretrained_checkpoint(
    strategy: str,
    pretrained: tuple[str, dict[str, torch.Tensor]],
    reference: dict,
    runs: dict[str, list[dict]],
) -> None:
    ranks = runs[strategy]
    for result in ranks:
        whole = result["whole"]
        assert whole["start"] == 0
        assert whole["base_same"], "the frozen base does not hold the pretrained weights"
        losses = [whole["losses"][step] for step in sorted(whole["losses"])]
        worst = max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True))
        assert worst <= 1e-5, (losses, reference["losses"])
        # The base's record: the hash of the weights loaded, and where they came from.
        assert whole["record"]["sha256"] == reference["sha256"]
        assert Path(whole["record"]["loaded_from"]).parent == Path(pretrained[0])
    base_held = [r["whole"]["base_held"] for r in ranks]
    if strategy == "zero3":  # each rank holds and loaded its half of the base
        assert base_held[0] < sum(base_held) and base_held[1] < sum(base_held)
    else:
        assert base_held[0] == base_held[1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_resumed_lora_job_equals_the_uninterrupted_one(
    strategy: str, runs: dict[str, list[dict]]
) -> None:
    for result in runs[strategy]:
        whole, stopped, resumed = result["whole"], result["stopped"], result["resumed"]
        assert sorted(stopped["losses"]) == list(range(workers.STOP))
        assert resumed["start"] == workers.STOP
        assert resumed["base_same"], "the resumed job's base is not the pretrained one"
        for step, loss in resumed["losses"].items():
            assert loss == pytest.approx(whole["losses"][step], abs=1e-6), step
        assert resumed["record"] == whole["record"]
        for name, pieces in resumed["adapters"].items():
            for (region, values), (_, expected) in zip(
                pieces, whole["adapters"][name], strict=True
            ):
                assert torch.allclose(values, expected, atol=1e-6, rtol=0), (name, region)
        # Without init_from the base is the random init: the adapters are refused for it.
        assert "set checkpoint_io.init_from" in (result["without_init_from"] or "")

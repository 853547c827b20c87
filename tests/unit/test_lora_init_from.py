"""A LoRA job on plait's built-in Llama keeps its frozen base in the state layout as left out of
checkpoints: a weights-only load (`init_from`) fills it, by the base's own names, every tensor
required; the adapters keep their init; a full load and a checkpoint leave the base alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import plait
from plait.core.errors import CheckpointError
from plait.core.state_chunks import layout_for

pytest.importorskip("peft")

CONFIG = {
    "model": {"name": "llama", "size": "tiny", "overrides": {
        "dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "multiple_of": 16,
        "max_seq_len": 32, "vocab_size": 64,
    }},
    "data": {"seq_len": 8},
    "train": {"device": "cpu", "seed": 5, "global_batch_size": 2},
    "telemetry": {"enabled": False},
    "parallel": {"transforms": {"adapter": "lora"}},
    "peft": {"r": 4, "alpha": 8, "target_modules": ["wq", "wv"]},
}  # fmt: skip


def engine() -> Any:
    return plait.initialize(
        None, config=CONFIG, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    )


def pretrained_base(root: Path, *, drop: str | None = None) -> dict[str, torch.Tensor]:
    """Weights for every frozen tensor of the job (but `drop`), as a base checkpoint at `root`."""
    from plait.plugins.checkpoint.offline import write_checkpoint

    job = engine()
    generator = torch.Generator().manual_seed(11)
    weights = {
        entry.name: torch.randn(entry.value.global_shape, generator=generator)
        for entry in layout_for(job).left_out
    }
    job.close()
    kept = {f"model.{name}": w for name, w in weights.items() if name != drop}
    write_checkpoint(root, 1, kept)
    return weights


def load_init_from(job: Any, root: Path) -> None:
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig

    Checkpointer(job, None, CheckpointIOConfig(init_from=str(root))).maybe_resume()


def test_the_base_is_left_out_of_checkpoints_under_its_own_names() -> None:
    job = engine()
    layout = layout_for(job)
    frozen = {n for n, p in job.module.named_parameters() if not p.requires_grad}
    assert {e.name for e in layout.left_out} == {
        n.removeprefix("base_model.model.").replace(".base_layer.", ".") for n in frozen
    }
    assert "layers.0.attention.wq.weight" in {e.name for e in layout.left_out}
    # What checkpoints write is unchanged: the adapters alone.
    assert all(".lora_" in name for name in layout.by_name())
    job.close()


def test_init_from_fills_the_base_and_the_adapters_keep_their_init(tmp_path: Path) -> None:
    weights = pretrained_base(tmp_path / "base")
    job, fresh = engine(), engine()
    load_init_from(job, tmp_path / "base")
    for entry in layout_for(job).left_out:
        assert torch.equal(entry.value.pieces[0].read(), weights[entry.name]), entry.name
    for (name, loaded), (_, built) in zip(
        job.module.named_parameters(), fresh.module.named_parameters(), strict=True
    ):
        if loaded.requires_grad:
            assert torch.equal(loaded, built), name
    record = next(r for r in job.runtimes if r.name == "lora").record["base"]  # type: ignore[attr-defined]
    assert Path(record["loaded_from"]).parent == tmp_path / "base"
    job.close()
    fresh.close()


def test_init_from_names_a_missing_base_tensor(tmp_path: Path) -> None:
    pretrained_base(tmp_path / "base", drop="layers.0.attention.wq.weight")
    job = engine()
    with pytest.raises(
        CheckpointError, match=r"1 parameter\(s\).*layers\.0\.attention\.wq\.weight"
    ):
        load_init_from(job, tmp_path / "base")
    job.close()


def test_init_from_starts_a_module_to_saves_trained_copy_from_the_base(tmp_path: Path) -> None:
    """`modules_to_save = ["output"]`: the base's `output.weight` is where the head's trained
    copy starts (as peft's copy of a loaded module would); the record hashes it as the frozen
    original's, the tensor the base had it arrived loaded."""
    from plait.plugins.lora.state import base_hash, base_weight_name

    saving = {**CONFIG, "peft": {**CONFIG["peft"], "modules_to_save": ["output"]}}

    def saving_engine() -> Any:
        return plait.initialize(
            None, config=saving, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)
        )

    job = saving_engine()
    left_out = layout_for(job).left_out_by_name()
    copy = "base_model.model.output.modules_to_save.default.weight"
    assert left_out["output.weight"].param is dict(job.module.named_parameters())[copy]
    assert copy in layout_for(job).by_name()  # and saved, under peft's name
    weights = pretrained_base(tmp_path / "base")
    assert set(weights) == set(left_out)
    built = job.module.base_model.model.output.modules_to_save["default"].weight.detach().clone()
    load_init_from(job, tmp_path / "base")
    trained = job.module.base_model.model.output.modules_to_save["default"].weight
    assert torch.equal(trained, weights["output.weight"])
    assert not torch.equal(built, weights["output.weight"])
    frozen = [(n, p) for n, p in job.module.named_parameters() if not p.requires_grad]
    assert "base_model.model.output.original_module.weight" in dict(frozen)
    record = next(r for r in job.runtimes if r.name == "lora").record["base"]  # type: ignore[attr-defined]
    assert record["sha256"] == base_hash([(n, weights[base_weight_name(n)]) for n, _ in frozen])
    job.close()

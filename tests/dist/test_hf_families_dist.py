"""HF folders through sharded jobs: a GPT-2 that transformers saved is read region by region
(tensor-parallel head blocks of the fused c_attn, ZeRO-2 flat ranges) and exported back whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist import hf_family_workers

pytestmark = pytest.mark.dist


def test_gpt2_folder_loads_into_tp2_and_zero2_and_exports_unchanged(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from plait.plugins.huggingface.weights import import_hf

    config = transformers.GPT2Config(
        vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=32, tie_word_embeddings=False
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    model.save_pretrained(tmp_path / "hf")

    ranks = run_distributed(
        hf_family_workers.gpt2_through_tp2_and_zero2, 2, str(tmp_path / "hf"),
        str(tmp_path / "out"), timeout=150,
    )  # fmt: skip

    # Tensor parallelism really split the projections the fused c_attn holds.
    assert ranks[0]["tp_local_shapes"]["layers.0.attention.wq.weight"] == (16, 32)
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    expected = import_hf(tmp_path / "hf").weights
    for result in ranks:
        assert result["zero2"].keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(result["zero2"][name], tensor), name

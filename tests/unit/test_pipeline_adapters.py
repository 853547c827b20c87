"""Pipeline stages of models plait did not write, on one process: two stages chained give the
whole model's forward and loss, and models plait cannot cut are refused by name."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from plait.core.errors import ConfigError
from plait.plugins.pipeline.adapters import adapter_for
from plait.plugins.pipeline.split import SplitPoints, plan_blocks
from tests.dist.pp_any_workers import ChainModel, NamedStack, Residual

VOCAB, SEQ = 96, 12


def _hf_model(family: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "mistral":  # a sliding window shorter than the sequence
        config = transformers.MistralConfig(**common, sliding_window=4)
        model = transformers.MistralForCausalLM(config)
    elif family == "qwen2":  # sliding-window layers after two full-attention ones
        config = transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=4, max_window_layers=2
        )
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64
        )
        model = transformers.GPT2LMHeadModel(config)
    return model.eval()


def _batches() -> dict[str, dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding: the mask changes the other tokens' attention
    labels = ids.clone()
    labels[1, 8:] = -100
    return {
        "plain": {"input_ids": ids, "labels": ids},
        "padded": {"input_ids": ids, "labels": labels, "attention_mask": mask},
        "positions": {
            "input_ids": ids,
            "labels": ids,
            "position_ids": torch.arange(3, 3 + SEQ).expand(2, SEQ),
        },
    }


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
def test_two_stages_give_the_models_own_forward_and_loss(family: str) -> None:
    model = _hf_model(family)
    adapter = adapter_for(model, blocks_path="", split_points=[], hidden_size=0)
    assert adapter.family == family
    names = [name for name, _ in adapter.blocks]
    first = adapter.stage(model, names[:1], first=True, last=False)
    last = adapter.stage(model, names[1:], first=False, last=True)
    for what, batch in _batches().items():
        with torch.no_grad():
            want = model(**batch)
            hidden = first(None, batch)
            assert hidden.shape == (2, SEQ, adapter.hidden_size)
            got = last(hidden, batch)
        torch.testing.assert_close(got.logits, want.logits, msg=f"{family} {what}")
        torch.testing.assert_close(got.loss, want.loss, msg=f"{family} {what}")
    # The stages hold the model's own modules under its own names, and nothing twice.
    own = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    held = [n for s in (first, last) for n, _ in s.named_parameters()]
    assert set(held) <= own
    assert not {n for n, _ in first.named_parameters()} & {n for n, _ in last.named_parameters()}


def test_a_plain_chain_is_traced_into_embed_blocks_head() -> None:
    adapter = adapter_for(ChainModel(), blocks_path="", split_points=[], hidden_size=0)
    assert [n for n, _ in adapter.before] == ["embed"]
    assert [n for n, _ in adapter.blocks] == [f"blocks.{i}" for i in range(4)]
    assert [n for n, _ in adapter.after] == ["head"]
    assert adapter.hidden_size == 16
    named = adapter_for(NamedStack(), blocks_path="", split_points=["mix"], hidden_size=0)
    assert [n for n, _ in named.blocks] == ["embed", "first", "mix", "out"]


def test_models_plait_cannot_cut_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"not a plain chain.*'add'"):
        adapter_for(Residual(), blocks_path="", split_points=[], hidden_size=0)
    with pytest.raises(ConfigError, match="found no repeated blocks in NamedStack"):
        adapter_for(NamedStack(), blocks_path="", split_points=[], hidden_size=0)
    with pytest.raises(ConfigError, match=r"pipeline.blocks = 'trunk'"):
        adapter_for(ChainModel(), blocks_path="trunk", split_points=[], hidden_size=0)
    other = ChainModel()
    other.config = SimpleNamespace(model_type="gemma")  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"model_type 'gemma'.*llama, mistral, qwen2 and gpt2"):
        adapter_for(other, blocks_path="", split_points=[], hidden_size=0)


def test_split_points_choose_where_stages_begin() -> None:
    names = [f"blocks.{i}" for i in range(6)]

    def plan(points: list[str]) -> list[tuple[str, ...]]:
        result = plan_blocks(
            names,
            qualified=names,
            embeddings=1.0,
            blocks=[1.0] * 6,
            head=1.0,
            num_stages=3,
            virtual_stages=1,
            balance="flops",
            layers_per_stage=SplitPoints(tuple(points)),
        )
        return [c.layers for c in result.chunks]

    assert plan(["blocks.1", "blocks.5"]) == [
        ("blocks.0",),
        ("blocks.1", "blocks.2", "blocks.3", "blocks.4"),
        ("blocks.5",),
    ]
    with pytest.raises(ConfigError, match=r"\['head'\] name no block"):
        plan(["blocks.2", "head"])
    with pytest.raises(ConfigError, match="must name 2 distinct blocks in model order"):
        plan(["blocks.4", "blocks.2"])
    with pytest.raises(ConfigError, match="must name 2 distinct blocks"):
        plan(["blocks.0", "blocks.2"])

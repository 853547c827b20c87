"""Context and expert parallelism for `transformers` models, the parts one process can check:
a micro-batch prepared whole (labels shifted across piece boundaries, the pieces' weighed loss,
padding accepted or refused by name), the attention function transformers calls (scale,
refusals), models that cannot take part refused by name, and the schedule `parallel.pp > 1`
picks when none is named."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.core.config import load_config
from plait.core.errors import ConfigError, PlaitError
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.core.transforms import ContextParallelism
from plait.plugins.context_parallel.attention import ContextParallelAttention
from plait.plugins.context_parallel.hf_attention import (
    AttentionWatch,
    TransformersAttention,
    check_transformers_model,
)
from plait.plugins.context_parallel.hf_batches import prepare_causal_lm_batch
from plait.training.banner import transform_names

transformers = pytest.importorskip("transformers")

SEQ = 16


def _layout(rank: int, degree: int = 2) -> ContextParallelism:
    prepare = partial(
        prepare_causal_lm_batch, degree=degree, model_name="TinyLM", loss_reads_shift_labels=True
    )
    return ContextParallelism(
        degree=degree, rank=rank, strategy="ring", ring_degree=degree, prepare=prepare
    )


def _batch(rows: int = 2) -> dict[str, torch.Tensor]:
    tokens = torch.arange(rows * SEQ).view(rows, SEQ) + 1000
    return {"input_ids": tokens, "labels": tokens.clone()}


def test_each_position_is_scored_against_the_next_token_even_across_pieces() -> None:
    batch = _batch()
    for rank in range(2):
        layout = _layout(rank)
        inputs, targets = layout.shard_microbatch(batch, batch["labels"], SEQ)
        positions = layout.positions(SEQ)
        # Rank 0 holds chunks 0 and 3 of 4 (positions 0-3, 12-15): position 3's label is the
        # token at position 4, which rank 1 holds; position 15, the last, scores nothing.
        following = positions + 1
        for row in range(2):
            token = batch["input_ids"][row][following.clamp(max=SEQ - 1)]
            want = torch.where(following < SEQ, token, -100)
            assert inputs["shift_labels"][row].tolist() == want.tolist()
        assert torch.equal(targets, inputs["shift_labels"])
        assert inputs["position_ids"][0].tolist() == positions.tolist()
        # The core weighs each rank's mean loss by its scored tokens (plait.core.token_loss):
        # no token count of plait's own goes to the model's loss.
        assert "num_items_in_batch" not in inputs


def test_the_loss_of_the_pieces_is_the_loss_of_the_sequence() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    batch = _batch()
    logits = torch.randn(2, SEQ, 4000, generator=torch.Generator().manual_seed(0))
    whole = ForCausalLMLoss(logits, batch["labels"], 4000)
    pieces = []
    for rank in range(2):
        layout = _layout(rank)
        inputs, _ = layout.shard_microbatch(batch, batch["labels"], SEQ)
        mine = logits.index_select(1, layout.positions(SEQ))
        loss = ForCausalLMLoss(mine, inputs["labels"], 4000, shift_labels=inputs["shift_labels"])
        scored = (inputs["shift_labels"] != -100).sum()
        pieces.append((loss * scored, scored))
    # Each piece's mean weighed by its scored tokens, as the core does, is the whole mean.
    total = sum(loss for loss, _ in pieces) / sum(scored for _, scored in pieces)
    assert total.item() == pytest.approx(whole.item(), abs=1e-6)


def test_a_given_token_count_is_shared_out_over_the_cp_ranks() -> None:
    batch = {**_batch(), "num_items_in_batch": torch.tensor(120)}
    inputs, _ = _layout(0).shard_microbatch(batch, batch["labels"], SEQ)
    assert float(inputs["num_items_in_batch"]) == 60.0


def test_right_padding_is_taken_and_other_padding_is_refused_by_name() -> None:
    batch = _batch()
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 10:] = 0
    padded = {
        **batch,
        "attention_mask": mask,
        "labels": batch["labels"].masked_fill(mask == 0, -100),
    }
    inputs, _ = _layout(0).shard_microbatch(padded, padded["labels"], SEQ)
    assert inputs["attention_mask"].shape == (2, SEQ // 2)

    scored = {**batch, "attention_mask": mask}  # labels still set on the padding
    with pytest.raises(PlaitError, match="scores padded positions"):
        _layout(0).shard_microbatch(scored, None, SEQ)
    left = {**batch, "attention_mask": mask.flip(1)}
    with pytest.raises(PlaitError, match="pads on the left"):
        _layout(0).shard_microbatch(left, None, SEQ)
    four_d = {**batch, "attention_mask": torch.ones(2, 1, SEQ, SEQ)}
    with pytest.raises(PlaitError, match="4-D"):
        _layout(0).shard_microbatch(four_d, None, SEQ)
    with pytest.raises(PlaitError, match="dict batches"):
        _layout(0).shard_microbatch(batch["input_ids"], batch["labels"], SEQ)


def test_a_loss_that_does_not_read_shift_labels_is_refused() -> None:
    layout = _layout(0)
    other = replace(
        layout,
        prepare=partial(
            prepare_causal_lm_batch, degree=2, model_name="TinyLM", loss_reads_shift_labels=False
        ),
    )
    batch = _batch()
    with pytest.raises(PlaitError, match="loss_function is another one"):
        other.shard_microbatch(batch, batch["labels"], SEQ)
    # Without labels there is nothing to shift: the batch passes.
    inputs, _ = other.shard_microbatch({"input_ids": batch["input_ids"]}, None, SEQ)
    assert "shift_labels" not in inputs


def _attention(degree: int = 1) -> TransformersAttention:
    kernels = Kernels(Plugins.create(autoload=False))
    layout = ContextParallelism(degree=degree, rank=0, strategy="ring", ring_degree=degree)
    return TransformersAttention(
        attend=ContextParallelAttention(kernels=kernels), layout=layout, model_name="TinyLM"
    )


def test_the_attention_function_keeps_the_models_own_scale_and_layout() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, SEQ, 8, generator=generator) for _ in range(3))
    module = SimpleNamespace(is_causal=True)
    out, weights = _attention()(module, q, k, v, None, scaling=0.2)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
    assert weights is None
    assert out.shape == (2, SEQ, 4, 8)  # transformers' (batch, seq, heads, head_dim)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"dropout": 0.1}, "attention dropout"),
        ({"softcap": 30.0}, "attention logit soft-capping"),
        ({"sliding_window": 8}, "sliding-window attention \\(window 8\\) over sequences of 32"),
        ({"is_causal": False}, "bidirectional attention"),
        ({"s_aux": torch.zeros(4)}, "attention sinks"),
    ],
)
def test_the_attention_function_refuses_what_it_cannot_cut(kwargs: dict, what: str) -> None:
    q = torch.randn(1, 4, SEQ, 8)
    with pytest.raises(PlaitError, match=f"with TinyLM: {what}"):
        _attention(degree=2)(SimpleNamespace(is_causal=True), q, q, q, None, **kwargs)
    with pytest.raises(PlaitError, match="an attention mask reaching attention"):
        _attention()(SimpleNamespace(), q, q, q, torch.zeros(1, 1, SEQ, SEQ))
    # A window the whole sequence fits in is plain causal attention.
    _attention(degree=2)(SimpleNamespace(), q, q, q, None, sliding_window=32)


class TinyConfig(transformers.PretrainedConfig):
    model_type = "tiny-own-attention"


class TinySelfAttention(nn.Module):
    """Attention computed in place, as remote-code models often do (no attention interface)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)


class TinyOwnAttentionModel(transformers.PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.attention = TinySelfAttention()


def test_a_model_computing_its_own_attention_is_refused_by_name() -> None:
    model = TinyOwnAttentionModel(TinyConfig())
    layout = ContextParallelism(degree=2, rank=0, strategy="ulysses", ring_degree=1)
    with pytest.raises(
        ConfigError, match=r"TinyOwnAttentionModel .* computes its attention itself"
    ):
        check_transformers_model(model, layout)


def test_a_forward_that_never_reached_the_attention_function_fails() -> None:
    function = _attention()
    watch = AttentionWatch(function)
    module = nn.Linear(2, 2)
    watch.before(module, ())
    with pytest.raises(PlaitError, match="never called its attention implementation"):
        watch.after(module, (), None)
    watch.before(module, ())
    function.calls += 1
    watch.after(module, (), None)


def test_attention_dropout_in_the_config_is_refused_before_training() -> None:
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, attention_dropout=0.1,
        )
    )  # fmt: skip
    layout = ContextParallelism(degree=2, rank=0, strategy="ring", ring_degree=2)
    with pytest.raises(ConfigError, match=r"config\.attention_dropout = 0\.1"):
        check_transformers_model(model, layout)


def test_expert_parallelism_refuses_a_model_without_interface_experts() -> None:
    from plait.plugins.expert_parallel.hf_experts import transformers_moe_layers

    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2,
        )
    )  # fmt: skip
    kernels = Kernels(Plugins.create(autoload=False))
    with pytest.raises(ConfigError, match="LlamaForCausalLM \\(transformers model_type 'llama'\\)"):
        transformers_moe_layers(model, kernels)


def test_pipeline_parallelism_picks_1f1b_when_no_schedule_is_named() -> None:
    chosen = load_config({"parallel": {"pp": 2}})
    assert chosen.schedule.name == "1f1b" and chosen.schedule.chosen_by_default
    assert chosen.model_dump()["schedule"]["name"] == "1f1b"  # the resolved config says it
    # Reloading keeps it a default: other degrees choose again.
    assert load_config(chosen, ["parallel.pp=1"]).schedule.name == "accumulate"
    named = load_config({"parallel": {"pp": 2}, "schedule": {"name": "gpipe"}})
    assert named.schedule.name == "gpipe" and not named.schedule.chosen_by_default
    plain = load_config({})
    assert plain.schedule.name == "accumulate"

    sizes = {"tp": 1, "cp": 1, "pp": 2}
    engine = SimpleNamespace(
        config=chosen, mesh=SimpleNamespace(size=lambda a: sizes[a], host_map=None)
    )
    banner = " · ".join(transform_names(engine, {}))  # type: ignore[arg-type]
    assert "schedule 1f1b (the default with parallel.pp > 1)" in banner
    engine.config = named
    assert "schedule gpipe · " in " · ".join(transform_names(engine, {}))  # type: ignore[arg-type]

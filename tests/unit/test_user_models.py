"""Users' own models and loops through `plait.initialize`, on one process.

Each case is checked against the loop a user would write without plait.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import plait
from plait.core.blocks import find_block_container
from plait.core.errors import ConfigError, PlaitError

VOCAB, SEQ = 64, 12
CONFIG = {"telemetry": {"enabled": False}, "train": {"device": "cpu"}}


class OwnLossLM(nn.Module):
    """nanoGPT's convention: `model(idx, targets)` returns `(logits, loss)`; called with one
    tensor it predicts the next token of that same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx[:, :-1])
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        logits = self.head(x)
        # Scaled so gradient norms exceed 1: a default clip at 1.0 would change the result.
        return 25.0 * nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())


def _sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.02)


def _batches(count: int, rows: int = 4) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (rows, SEQ), generator=generator) for _ in range(count)]


def test_a_model_returning_its_loss_trains_on_a_single_tensor_batch() -> None:
    torch.manual_seed(0)
    model = OwnLossLM()
    reference = copy.deepcopy(model)
    optimizer = _sgd(reference.parameters())
    expected = []
    for tokens in _batches(5):
        loss = reference(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    engine = plait.initialize(model, config=CONFIG, optimizer=_sgd)
    got = [engine.train_step(tokens) for tokens in _batches(5)]
    # No clipping and one micro-batch unless asked: the user's own loop, to the last bit.
    assert got == expected
    assert engine.last_report is not None and engine.last_report.grad_norm > 1.0
    assert engine.flops_per_token > 0, "FLOPs of a user's model are counted, never 0"


def test_engine_call_backward_step_accumulates_like_train_step() -> None:
    torch.manual_seed(0)
    model = OwnLossLM()
    twin = copy.deepcopy(model)
    config = {**CONFIG, "train": {"device": "cpu", "gradient_accumulation_steps": 2}}
    manual = plait.initialize(model, config=config, optimizer=_sgd)
    scheduled = plait.initialize(
        twin, config={**CONFIG, "train": {"device": "cpu", "micro_batch_size": 2}}, optimizer=_sgd
    )
    for tokens in _batches(3):
        stepped = []
        for half in tokens.split(2):
            loss = manual(half)
            manual.backward(loss)
            stepped.append(manual.step())
        assert stepped == [False, True]
        scheduled.train_step(tokens)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert manual.global_step == scheduled.global_step == 3
    with pytest.raises(PlaitError, match=r"engine\.backward\(loss\) without a forward"):
        manual.backward(torch.tensor(1.0, requires_grad=True))


def test_a_model_without_a_loss_gets_an_error_that_says_what_it_returned() -> None:
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    engine = plait.initialize(model, config=CONFIG, optimizer=_sgd)
    with pytest.raises(PlaitError, match=r"returned a tensor of shape \(4, 12, 64\).*loss_fn"):
        engine.train_step(_batches(1)[0])
    # With targets, logits get token cross-entropy.
    tokens = _batches(1)[0]
    assert engine.train_step((tokens, tokens)) > 0


def test_dict_batches_are_passed_by_keyword_and_split_per_micro_batch() -> None:
    seen: list[dict[str, tuple[int, ...]]] = []

    class KeywordModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(SEQ, 1)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):  # type: ignore[no-untyped-def]
            seen.append({"input_ids": tuple(input_ids.shape), "mask": tuple(mask.shape)})
            return {"loss": (self.linear(input_ids.float() * mask) - labels).pow(2).mean()}

    config = {**CONFIG, "train": {"device": "cpu", "micro_batch_size": 2}}
    engine = plait.initialize(KeywordModel(), config=config, optimizer=_sgd)
    batch = {"input_ids": _batches(1)[0], "labels": torch.zeros(4, 1), "mask": torch.ones(4, SEQ)}
    engine.train_step(batch)
    assert seen == [{"input_ids": (2, SEQ), "mask": (2, SEQ)}] * 2
    with pytest.raises(PlaitError, match="same size along dim 0"):
        engine.train_step({**batch, "mask": torch.ones(3, SEQ)})


def test_blocks_are_found_from_no_split_modules_or_the_longest_uniform_list() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    path, blocks = find_block_container(transformers.LlamaForCausalLM(config))
    assert path == "model.layers" and len(blocks) == 2
    assert find_block_container(OwnLossLM())[0] == "blocks"
    assert find_block_container(OwnLossLM(), "blocks")[0] == "blocks"
    with pytest.raises(ConfigError, match=r"checkpoint\.blocks = 'layers'"):
        find_block_container(OwnLossLM(), "layers", field="checkpoint.blocks")

"""Packed rows of plait's own models in one process: equal to every document alone, and sealed.

Llama and GPT-2 train one step through `Engine.train_step` on `({"tokens", "positions"},
targets)` packed batches (documents of 1, 2 and prime lengths, one spanning its row, trailing
padding as a segment of its own, targets -100 at each document's last token and on padding);
the loss and every parameter gradient must equal each document run alone through the plain
model, the losses combined as the mean over every scored token (fp32, 1e-5).

The contamination probe changes one document's tokens and requires every other document's
logits to stay bit for bit the same. Its negative controls show that it, and the comparison
with documents alone, catch what they guard against: documents dropped before attention,
positions that do not restart (the batch then looks unpacked), and a loss that is the mean of
row means instead of the token-weighted mean.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from plait.core.engine import Engine
from plait.core.kernels import Kernels
from plait.plugins.models import GPT2, Llama, resolve_model_config

SEQ, VOCAB, TOLERANCE = 16, 256, 1e-5
PADDING = 0  # a row's tail past its documents: a segment of its own, never scored
# Document lengths per row; what is left of a row of SEQ is padding.
LENGTHS = [[5, 1, 7, 3], [16], [2, 11, 2], [1, 1, 3, 5]]


def packed(lengths: list[list[int]], seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A packed batch: tokens, restarting positions, next-token targets inside documents."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (len(lengths), SEQ), generator=generator)
    targets = torch.full_like(tokens, -100)
    positions = torch.zeros_like(tokens)
    for row, documents in enumerate(lengths):
        start = 0
        for n in [*documents, SEQ - sum(documents)]:
            positions[row, start : start + n] = torch.arange(n)
            start += n
        start = 0
        for n in documents:
            targets[row, start : start + n - 1] = tokens[row, start + 1 : start + n]
            start += n
        tokens[row, start:] = PADDING
    return {"tokens": tokens, "positions": positions}, targets


def spans(lengths: list[list[int]]) -> list[tuple[int, slice]]:
    """(row, columns) of every document."""
    out = []
    for row, documents in enumerate(lengths):
        start = 0
        for n in documents:
            out.append((row, slice(start, start + n)))
            start += n
    return out


def alone(model: nn.Module, lengths: list[list[int]], batch: Any) -> torch.Tensor:
    """Each document through the plain model by itself (positions 0…n−1, nothing else in the
    row), the summed token losses over every scored token of the batch."""
    inputs, targets = batch
    total = torch.zeros(())
    for row, columns in spans(lengths):
        logits = model(inputs["tokens"][row : row + 1, columns])
        total = total + nn.functional.cross_entropy(
            logits.flatten(0, 1), targets[row, columns], ignore_index=-100, reduction="sum"
        )
    return total / (targets != -100).sum()


class RecordingSGD(torch.optim.SGD):
    """Keeps the gradients of the step it is given (learning rate 0: the model stays put)."""

    def __init__(self, params: Any) -> None:
        super().__init__(list(params), lr=0.0)
        self.grads: dict[int, torch.Tensor] = {}

    def step(self, closure: Any = None) -> Any:
        self.grads = {id(p): p.grad.clone() for g in self.param_groups for p in g["params"]}
        return super().step(closure)


def engine_for(family: str, micro_batch_size: int) -> tuple[Engine, list[RecordingSGD]]:
    holder: list[RecordingSGD] = []

    def optimizer(params: Any) -> RecordingSGD:
        holder.append(RecordingSGD(params))
        return holder[0]

    config = {
        "model": {"name": family, "size": "tiny", "overrides": {"max_seq_len": 32}},
        "data": {"seq_len": SEQ},
        "train": {"device": "cpu", "global_batch_size": 4, "micro_batch_size": micro_batch_size},
        "telemetry": {"enabled": False},
    }
    return Engine(config=config, optimizer=optimizer), holder


def step_against_alone(family: str, micro_batch_size: int) -> tuple[float, float, float]:
    """(plait's loss, the reference loss, the largest gradient difference)."""
    engine, holder = engine_for(family, micro_batch_size)
    reference = copy.deepcopy(engine.module)
    batch = packed(LENGTHS)
    loss = engine.train_step(batch)
    expected = alone(reference, LENGTHS, batch)
    expected.backward()
    grads = {name: holder[0].grads[id(p)] for name, p in engine.module.named_parameters()}
    worst = max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    engine.close()
    return loss, expected.item(), worst


@pytest.mark.parametrize("micro_batch_size", [1, 4])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_rows_equal_every_document_alone(family: str, micro_batch_size: int) -> None:
    loss, expected, worst = step_against_alone(family, micro_batch_size)
    assert loss == pytest.approx(expected, abs=TOLERANCE)
    assert worst <= TOLERANCE


def test_mean_of_row_means_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: without token weights the step is the mean of micro-batch (here row)
    means, which the comparison with documents alone rejects."""
    monkeypatch.setattr("plait.core.engine.token_weights", lambda *args, **kwargs: None)
    loss, expected, worst = step_against_alone("llama", 1)
    assert abs(loss - expected) > 1e-3
    assert worst > 1e-4


# -- the contamination probe -------------------------------------------------------------------


def model_of(plugins: Any, family: str) -> nn.Module:
    config = resolve_model_config(family, "tiny", {"max_seq_len": 32})
    torch.manual_seed(0)
    return {"llama": Llama, "gpt2": GPT2}[family](config, Kernels(plugins)).eval()  # type: ignore[arg-type]


def leaked(model: nn.Module, positions: torch.Tensor, changed: int = 2) -> float:
    """Change the tokens of document `changed` only: the largest change of any other
    document's logits (0.0 when nothing leaks across a boundary)."""
    inputs, _ = packed(LENGTHS)
    tokens = inputs["tokens"]
    row, columns = spans(LENGTHS)[changed]
    edited = tokens.clone()
    edited[row, columns] = (edited[row, columns] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(tokens, positions), model(edited, positions)
    others = torch.ones(tokens.shape, dtype=torch.bool)
    others[row, columns] = False
    return (before - after)[others].abs().max().item()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_no_document_sees_another(plugins: Any, family: str) -> None:
    model = model_of(plugins, family)
    assert leaked(model, packed(LENGTHS)[0]["positions"]) == 0.0
    # The probe can see a change: the edited document's own logits move.
    inputs, _ = packed(LENGTHS)
    edited = inputs["tokens"].clone()
    edited[0, 0] += 1
    with torch.no_grad():
        assert not torch.equal(model(edited, inputs["positions"]), model(**inputs))


def test_probe_catches_documents_dropped(plugins: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: attention given no documents attends across the whole row."""
    monkeypatch.setattr("plait.plugins.models.llama.documents_for", lambda *args: None)
    assert leaked(model_of(plugins, "llama"), packed(LENGTHS)[0]["positions"]) > 1e-4


def test_probe_catches_positions_not_restarted(plugins: Any) -> None:
    """Negative control: positions 0 … T−1 across the row show no documents to mask."""
    whole_rows = torch.arange(SEQ).expand(len(LENGTHS), SEQ)
    assert leaked(model_of(plugins, "llama"), whole_rows) > 1e-4


def test_learned_positions_need_restarting_positions(plugins: Any) -> None:
    """Negative control: GPT-2 given the documents but positions that run on across the row
    gives a later document other logits than it has alone."""
    from plait.core.documents import Documents

    model = model_of(plugins, "gpt2")
    inputs, _ = packed(LENGTHS)
    documents = Documents.from_positions(inputs["positions"])
    whole_rows = torch.arange(SEQ).expand(len(LENGTHS), SEQ)
    row, columns = spans(LENGTHS)[2]
    with torch.no_grad():
        by_itself = model(inputs["tokens"][row : row + 1, columns])[0]
        restarted = model(**inputs)[row, columns]
        running_on = model(inputs["tokens"], whole_rows, documents)[row, columns]
    torch.testing.assert_close(restarted, by_itself, atol=TOLERANCE, rtol=0)
    assert (running_on - by_itself).abs().max() > 1e-3

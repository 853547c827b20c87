"""Packed rows of `transformers` models through `plait.initialize`, against every document alone.

Batches are in transformers' own convention, made by `DataCollatorWithFlattening` row by row:
`input_ids`, `labels` with -100 at each document's first position and restarting
`position_ids`. One row or several; documents of 1, 2 and prime lengths, one spanning its row,
trailing padding (a segment of its own, labels -100). The reference is each document run alone
through the plain model (no cache), the losses combined as the mean over every scored token:
plait's loss and every parameter gradient must match it (fp32, 1e-5). A family, an attention
implementation or a batch for which transformers would not mask between documents is refused by
name, and the reported bug (a KV cache made transformers skip the packed mask) stays fixed.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import plait  # noqa: E402
from plait.core.errors import PlaitError  # noqa: E402

VOCAB = 96
TOLERANCE = 1e-5
PAD = 0
CONFIG = {"train": {"device": "cpu", "seed": 0}, "telemetry": {"enabled": False}}
DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
GPT2 = {
    "vocab_size": VOCAB,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
FAMILIES: dict[str, Any] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**DECODER, sliding_window=None)
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)),
}
# Document lengths per row (rows of 16 tokens; what is left of a row is padding), and the rows
# per micro-batch: micro-batches of one step score different numbers of tokens.
LAYOUTS = {
    "one_row": ([[1, 2, 3, 5, 2]], None),
    "rows": ([[5, 1, 7, 3], [16], [2, 11, 2, 1], [3, 13]], 2),
    "padding": ([[7, 2], [13], [1, 1, 1], [2, 3, 5]], 1),
}
SEQ = 16


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]()


def documents(layout: list[list[int]], seed: int = 1) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randint(1, VOCAB, (n,), generator=generator) for n in row] for row in layout]


def packed_batch(rows: list[list[torch.Tensor]], seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Each row flattened by transformers' own collator, then padded to `seq` on the right with
    a segment of its own (restarting positions, labels -100)."""
    collator = transformers.DataCollatorWithFlattening(return_tensors="pt")
    pieces = []
    for row in rows:
        piece = collator([{"input_ids": document.tolist()} for document in row])
        padding = seq - piece["input_ids"].shape[1]
        if padding:
            piece = {
                "input_ids": torch.cat([piece["input_ids"], torch.full((1, padding), PAD)], 1),
                "labels": torch.cat([piece["labels"], torch.full((1, padding), -100)], 1),
                "position_ids": torch.cat([piece["position_ids"], torch.arange(padding)[None]], 1),
            }
        pieces.append(piece)
    return {key: torch.cat([piece[key] for piece in pieces]) for key in pieces[0]}


def alone(model: nn.Module, rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """Every document through the plain model by itself, the losses weighed by scored tokens
    (a document of n tokens scores n - 1): the mean over every scored token of the batch."""
    scored = sum(len(document) - 1 for row in rows for document in row)
    total = torch.zeros(())
    for row in rows:
        for document in row:
            if len(document) > 1:
                ids = document[None]
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                total = total + loss * (len(document) - 1) / scored
    return total


class RecordingSGD(torch.optim.SGD):
    """Keeps the gradients of the step it is given (learning rate 0: the model stays put)."""

    def __init__(self, params: Any) -> None:
        super().__init__(list(params), lr=0.0)
        self.grads: dict[int, torch.Tensor] = {}

    def step(self, closure: Any = None) -> Any:
        self.grads = {id(p): p.grad.clone() for g in self.param_groups for p in g["params"]}
        return super().step(closure)


def train_step(model: nn.Module, batch: dict[str, torch.Tensor], **train: Any) -> tuple[float, Any]:
    """One plait step on `model`: its loss and its gradients by parameter name."""
    holder: list[RecordingSGD] = []

    def optimizer(params: Any) -> RecordingSGD:
        holder.append(RecordingSGD(params))
        return holder[0]

    config = {**CONFIG, "train": {**CONFIG["train"], **train}}
    engine = plait.initialize(model, config=config, optimizer=optimizer)
    loss = engine.train_step(batch)
    names = {id(p): name for name, p in engine.module.named_parameters()}
    grads = {names[i]: grad for i, grad in holder[0].grads.items()}
    engine.close()
    return loss, grads


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_rows_equal_every_document_alone(family: str, layout: str) -> None:
    lengths, micro_batch_size = LAYOUTS[layout]
    rows = documents(lengths)
    batch = packed_batch(rows)
    model = build(family)
    reference = copy.deepcopy(model)
    loss, grads = train_step(model, batch, micro_batch_size=micro_batch_size)

    expected = alone(reference, rows)
    expected.backward()
    assert loss == pytest.approx(expected.item(), abs=TOLERANCE)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=TOLERANCE, rtol=0, msg=name)


def test_the_collator_marks_documents_as_the_reference_scores_them() -> None:
    """The batch under test is transformers' convention: first positions unscored."""
    batch = packed_batch(documents([[3, 1, 2]]))
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, *range(10)]]
    labels = batch["labels"][0].tolist()
    assert [labels[i] for i in (0, 3, 4)] == [-100, -100, -100]
    assert labels[6:] == [-100] * 10


def test_kv_cache_bug_stays_fixed() -> None:
    """The reported bug: Llama's config asks for a KV cache by default, and with one
    transformers skips the packed mask, so training attended across documents (the loss came
    out lower). Through plait the first-step loss is transformers' own with `use_cache=False`."""
    generator = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(4):
        cuts = sorted(torch.randperm(63, generator=generator)[:5].add(1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, 64], strict=True)]
        rows.append([torch.randint(1, 512, (n,), generator=generator) for n in lengths])
    batch = packed_batch(rows, seq=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**DECODER, "vocab_size": 512})
    )
    assert model.config.use_cache, "the default this bug needs"
    with torch.no_grad():
        cached = model(**batch, use_cache=True).loss.item()
        correct = model(**batch, use_cache=False).loss.item()
        reference = alone(model, rows).item()

    loss, _ = train_step(model, batch)
    assert correct == pytest.approx(reference, abs=TOLERANCE)
    assert loss == pytest.approx(correct, abs=TOLERANCE), (loss, correct, cached)
    assert abs(loss - cached) > 1e-3, (loss, cached)


def _bloom() -> nn.Module:
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    return transformers.BloomForCausalLM(config)


def test_family_that_ignores_packed_positions_is_refused_by_name() -> None:
    """Bloom (ALiBi) takes no position ids: a packed row would attend across documents."""
    rows = documents([[5, 11]])
    batch = packed_batch(rows)
    model = _bloom()
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], use_cache=False).logits[0, 5:]
        by_itself = model(input_ids=rows[0][1][None], use_cache=False).logits[0]
    assert (packed - by_itself).abs().max() > 1e-4, "bloom would have masked after all"

    engine = plait.initialize(model, config=CONFIG)
    with pytest.raises(PlaitError, match=r"BloomForCausalLM \(transformers model_type 'bloom'\)"):
        engine.train_step(batch)
    # Rows of one sequence each still train.
    tokens = batch["input_ids"]
    assert torch.isfinite(torch.tensor(engine.train_step({"input_ids": tokens, "labels": tokens})))


def test_attention_without_a_packed_mask_is_refused() -> None:
    """An attention function registered by a user gets no packed mask from transformers."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    transformers.AttentionInterface.register("user_sdpa", sdpa_attention_forward)
    model = build("llama")
    model.set_attn_implementation("user_sdpa")
    engine = plait.initialize(model, config=CONFIG)
    with pytest.raises(PlaitError, match="attention implementation 'user_sdpa'"):
        engine.train_step(packed_batch(documents([[5, 11]])))


def test_attention_mask_beside_packed_positions_is_refused() -> None:
    """Given a 2-D attention_mask, transformers does not look for documents at all."""
    rows = documents([[5, 11]])
    batch = packed_batch(rows)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    model = build("llama")
    with torch.no_grad():
        masked = model(**batch, use_cache=False).loss
    assert abs(masked.item() - alone(model, rows).item()) > 1e-4, "transformers masked after all"

    engine = plait.initialize(model, config=CONFIG)
    with pytest.raises(PlaitError, match="2-D attention_mask"):
        engine.train_step(batch)


def test_flash_attention_takes_packed_micro_batches_of_one_row_only() -> None:
    """transformers' flash-attention path finds documents in one row's position ids only."""
    model = build("llama")
    # No flash-attention kernel on this machine: the step is refused before any forward.
    model.config._attn_implementation = "flash_attention_2"
    engine = plait.initialize(model, config=CONFIG)
    with pytest.raises(PlaitError, match="of one row only, and this one has 4"):
        engine.train_step(packed_batch(documents(LAYOUTS["rows"][0])))


def test_varlen_offsets_alone_are_refused_where_the_attention_ignores_them() -> None:
    """sdpa attention never reads cu_seq_lens_q/k: documents given only that way would mix."""
    rows = documents([[5, 11]])
    batch = packed_batch(rows)
    positions = batch.pop("position_ids")
    starts = (positions.flatten() == 0).nonzero().flatten()
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.cat(
        [starts, torch.tensor([positions.numel()])]
    ).int()
    model = build("llama")
    with torch.no_grad():
        mixed = model(**batch, use_cache=False).loss
    assert abs(mixed.item() - alone(model, rows).item()) > 1e-4, "sdpa read the offsets after all"

    engine = plait.initialize(model, config=CONFIG)
    with pytest.raises(PlaitError, match="given only as cu_seq_lens_q/k"):
        engine.train_step(batch)


def test_flattened_batch_with_varlen_offsets_and_positions_trains_as_documents_alone() -> None:
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True): one row, restarting
    position_ids and the varlen offsets beside them — one micro-batch, masked by its positions."""
    rows = documents([[5, 1, 3, 7]])
    batch = packed_batch(rows)
    starts = (batch["position_ids"].flatten() == 0).nonzero().flatten()
    offsets = torch.cat([starts, torch.tensor([batch["position_ids"].numel()])]).int()
    batch.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=7, max_length_k=7)
    model = build("llama")
    reference = copy.deepcopy(model)
    loss, _ = train_step(model, batch)
    assert loss == pytest.approx(alone(reference, rows).item(), abs=TOLERANCE)
    with pytest.raises(PlaitError, match="cannot be split into 2 micro-batches"):
        two_rows = packed_batch(documents([[5, 11], [16]]))
        two_rows.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets)
        train_step(build("llama"), two_rows, micro_batch_size=1)


def test_the_manual_loop_refuses_what_train_step_refuses() -> None:
    """`engine(**batch)` / `backward` / `step` takes the same packed-batch check as train_step."""
    batch = packed_batch(documents([[5, 11]]))
    engine = plait.initialize(_bloom(), config=CONFIG)
    with pytest.raises(PlaitError, match=r"BloomForCausalLM \(transformers model_type 'bloom'\)"):
        engine(**batch)
    llama = plait.initialize(build("llama"), config=CONFIG)
    engine_loss = llama(**batch).loss
    assert torch.isfinite(engine_loss)

"""Packed rows of a `transformers` causal LM under context parallelism, the parts one process can
check: the micro-batch prepared whole (documents from restarting position_ids or cu_seq_lens,
position ids kept and cut, labels as transformers' DataCollatorWithFlattening makes them, no
token count of plait's own), refusals by name (pipeline stages, differing varlen offsets, a
model that does not hand the documents to its attention), and the attention function masking
with the documents it is handed."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from plait.core.documents import Documents
from plait.core.errors import PlaitError
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.core.transforms import ContextParallelism
from plait.plugins.context_parallel.attention import ContextParallelAttention
from plait.plugins.context_parallel.hf_attention import AttentionWatch, TransformersAttention
from plait.plugins.context_parallel.hf_batches import DOCUMENTS_KEY, prepare_causal_lm_batch
from plait.plugins.kernels_torch.ops import attention

transformers = pytest.importorskip("transformers")

SEQ = 16
LENGTHS = ([3, 5, 8], [1, 2, 13])  # row 0's boundary at 8 is a shard edge of cp 2 (chunks of 4)


def _layout(rank: int, *, pipelined: bool = False) -> ContextParallelism:
    prepare = partial(
        prepare_causal_lm_batch,
        degree=2,
        model_name="TinyLM",
        loss_reads_shift_labels=True,
        documents_reach_attention=not pipelined,
    )
    return ContextParallelism(degree=2, rank=rank, strategy="ring", ring_degree=2, prepare=prepare)


def _positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])


def _packed() -> dict[str, torch.Tensor]:
    tokens = torch.arange(2 * SEQ).view(2, SEQ) + 1000
    return {"input_ids": tokens, "labels": tokens.clone(), "position_ids": _positions()}


def test_restarting_position_ids_give_documents_of_the_whole_rows() -> None:
    batch = _packed()
    for rank in range(2):
        layout = _layout(rank)
        inputs, _ = layout.shard_microbatch(batch, batch["labels"], SEQ)
        documents = inputs[DOCUMENTS_KEY]
        # Computed before the cut: every rank holds the whole rows' structure.
        assert isinstance(documents, Documents) and documents.seq_len == SEQ
        assert documents.lengths().tolist() == [3, 5, 8, 1, 2, 13]
        # The restarting position ids are kept and cut with the rest (RoPE reads them).
        held = layout.positions(SEQ)
        assert torch.equal(inputs["position_ids"], _positions().index_select(1, held))
        # The core weighs each rank's tokens itself: no num_items_in_batch of plait's own.
        assert "num_items_in_batch" not in inputs


def test_plain_rows_carry_no_documents() -> None:
    tokens = torch.arange(2 * SEQ).view(2, SEQ)
    for given in (None, torch.arange(SEQ), torch.arange(SEQ).expand(2, SEQ)):
        batch = {"input_ids": tokens, "labels": tokens.clone()}
        if given is not None:
            batch["position_ids"] = given
        inputs, _ = _layout(0).shard_microbatch(batch, batch["labels"], SEQ)
        assert DOCUMENTS_KEY not in inputs
        assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] * 2
    # Restarting position ids given once for every row, (seq,), are packed rows too.
    one = {"input_ids": tokens, "position_ids": _positions()[0]}
    inputs, _ = _layout(0).shard_microbatch(one, None, SEQ)
    assert inputs[DOCUMENTS_KEY].lengths().tolist() == [3, 5, 8, 3, 5, 8]


def test_the_flattening_collators_labels_never_cross_a_document() -> None:
    from transformers import DataCollatorWithFlattening

    features = [
        {"input_ids": list(range(10 * i + 1, 10 * i + 1 + n))} for i, n in enumerate([3, 5, 8])
    ]
    for feature in features:
        feature["labels"] = list(feature["input_ids"])
    batch = DataCollatorWithFlattening(return_tensors="pt")(features)
    assert batch["position_ids"].tolist() == [_positions()[0].tolist()]
    layout = _layout(0)
    prepared, shift = layout.prepare(batch, batch["labels"], SEQ)  # type: ignore[misc]
    # The collator sets every document's first label to -100, so the shifted label of each
    # document's last token is -100: no prediction crosses into the next document.
    for end in (2, 7, 15):
        assert int(shift[0, end]) == -100
    # Inside a document, each token predicts the next.
    assert shift[0, :2].tolist() == [2, 3] and shift[0, 8:10].tolist() == [22, 23]
    assert prepared[DOCUMENTS_KEY].lengths().tolist() == [3, 5, 8]


def test_labels_that_do_not_separate_documents_are_scored_as_given() -> None:
    """A batch whose labels do not mark document starts scores each document's last token
    against the next document's first, as the model's own loss over the whole row would."""
    batch = _packed()
    _, shift = _layout(0).prepare(batch, batch["labels"], SEQ)  # type: ignore[misc]
    assert int(shift[0, 2]) == int(batch["input_ids"][0, 3])
    assert int(shift[0, SEQ - 1]) == -100  # the row's last token has no next


def test_varlen_offsets_give_documents_and_restarting_positions() -> None:
    tokens = torch.arange(2 * SEQ).view(2, SEQ)
    offsets = torch.tensor([0, 3, 8, 16, 17, 19, 32], dtype=torch.int32)
    batch = {
        "input_ids": tokens,
        "cu_seq_lens_q": offsets,
        "cu_seq_lens_k": offsets.clone(),
        "max_length_q": 13,
        "max_length_k": 13,
    }
    prepared, _ = _layout(0).prepare(batch, None, SEQ)  # type: ignore[misc]
    assert prepared[DOCUMENTS_KEY].lengths().tolist() == [3, 5, 8, 1, 2, 13]
    assert torch.equal(prepared["position_ids"], _positions())
    assert not {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q"} & set(prepared)
    with pytest.raises(PlaitError, match="cu_seq_lens_k differs from cu_seq_lens_q"):
        _layout(0).prepare({**batch, "cu_seq_lens_k": offsets.flip(0)}, None, SEQ)  # type: ignore[misc]


def test_packed_rows_in_pipeline_stages_are_refused_by_name() -> None:
    batch = _packed()
    with pytest.raises(PlaitError, match="TinyLM in pipeline stages: the batch holds packed"):
        _layout(0, pipelined=True).shard_microbatch(batch, batch["labels"], SEQ)
    plain = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    _layout(0, pipelined=True).shard_microbatch(plain, plain["labels"], SEQ)


def test_a_token_count_the_batch_carries_is_shared_out_over_the_cp_ranks() -> None:
    batch = {**_packed(), "num_items_in_batch": torch.tensor(30)}
    inputs, _ = _layout(0).shard_microbatch(batch, batch["labels"], SEQ)
    assert float(inputs["num_items_in_batch"]) == 15.0


def _function() -> TransformersAttention:
    kernels = Kernels(Plugins.create(autoload=False))
    layout = ContextParallelism(degree=1, rank=0, strategy="ring", ring_degree=1)
    attend = ContextParallelAttention(kernels=kernels, layout=layout)
    return TransformersAttention(attend=attend, layout=layout, model_name="TinyLM")


def test_the_attention_function_masks_with_the_documents_it_is_handed() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, SEQ, 8, generator=generator) for _ in range(3))
    documents = Documents.from_positions(_positions())
    module = SimpleNamespace(is_causal=True)
    out, _ = _function()(module, q, k, v, None, **{DOCUMENTS_KEY: documents})
    want = attention(q, k, v, True, document_ids=documents.document_ids)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-5)
    plain, _ = _function()(module, q, k, v, None)
    assert (plain - out).abs().max() > 1e-2


def test_a_model_that_drops_the_documents_on_the_way_is_refused_by_name() -> None:
    function = _function()
    watch = AttentionWatch(function)
    documents = Documents.from_positions(_positions())
    model = torch.nn.Linear(2, 2)
    watch.before(model, (), {"input_ids": None, DOCUMENTS_KEY: documents})
    q = torch.randn(2, 4, SEQ, 8)

    class TinyAttention(torch.nn.Module):
        is_causal = True

    with pytest.raises(PlaitError, match=r"TinyLM: packed rows: TinyAttention does not hand"):
        function(TinyAttention(), q, q, q, None)
    # Handed on, it runs; after the forward, a forward without documents expects none.
    function(TinyAttention(), q, q, q, None, **{DOCUMENTS_KEY: documents})
    watch.after(model, (), None)
    watch.before(model, (), {"input_ids": None})
    function(TinyAttention(), q, q, q, None)

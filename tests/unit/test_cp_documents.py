"""Document-masked ring attention on one process: the ring's own forward and backward run for
every ring position in threads that pass K/V blocks through in-memory mailboxes, against the
torch kernel's document-masked attention over the whole rows; the blocks it skips, the work it
counts, the log-sum-exp merge of blocks that see no key, and the attention function's
document handling (Ulysses' portion ids, a transformers model that drops the documents)."""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from plait.core.documents import Documents
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.core.transforms import ContextParallelism
from plait.plugins.context_parallel.attention import ContextParallelAttention
from plait.plugins.context_parallel.ring import (
    Ring,
    RingDocuments,
    block_pairs,
    merge,
    ring_backward,
    ring_forward,
)
from plait.plugins.kernels_torch.ops import attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
NEG_INF = float("-inf")


def packed_positions(rows: list[list[int]]) -> torch.Tensor:
    """Position ids restarting at every document of the given lengths, row by row."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


# 32 tokens per row: lengths 1, 2 and primes; a document that spans the row; documents whose
# boundaries fall exactly on the chunk edges of a 2- and 4-ring (multiples of 4 and 8).
ROWS = [
    [1, 2, 3, 5, 7, 11, 3],
    [32],
    [8, 8, 4, 4, 8],
    [13, 1, 1, 17],
]


class Mailboxes:
    """Point-to-point messages between threads, matched in posting order per (src, dst)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.sent: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
        self.posted: dict[tuple[int, int], int] = defaultdict(int)


class Done:
    def wait(self) -> None:
        return None


class Receive:
    def __init__(self, boxes: Mailboxes, channel: tuple[int, int], index: int, buffer: Any):
        self.boxes, self.channel, self.index, self.buffer = boxes, channel, index, buffer

    def wait(self) -> None:
        with self.boxes.lock:
            self.boxes.lock.wait_for(
                lambda: len(self.boxes.sent[self.channel]) > self.index, timeout=30
            )
            self.buffer.copy_(self.boxes.sent[self.channel][self.index])


class ThreadComm:
    """The two ops `Ring` uses, between threads of one process."""

    def __init__(self, rank: int, boxes: Mailboxes) -> None:
        self.rank, self.boxes = rank, boxes

    def send(self, tensor: torch.Tensor, *, dst: int, **_: Any) -> Done:
        with self.boxes.lock:
            self.boxes.sent[(self.rank, dst)].append(tensor.clone())
            self.boxes.lock.notify_all()
        return Done()

    def recv(self, tensor: torch.Tensor, *, src: int, **_: Any) -> Receive:
        with self.boxes.lock:
            index = self.boxes.posted[(src, self.rank)]
            self.boxes.posted[(src, self.rank)] += 1
        return Receive(self.boxes, (src, self.rank), index, tensor)


def _kernels() -> Kernels:
    return Kernels(Plugins.create(autoload=False))


def _layout(ring_degree: int, position: int, balanced: bool = True) -> ContextParallelism:
    return ContextParallelism(
        degree=ring_degree,
        rank=position,
        strategy="ring",
        ring_degree=ring_degree,
        load_balanced=balanced,
    )


def _rings(ring_degree: int, balanced: bool = True) -> list[Ring]:
    boxes, kernels = Mailboxes(), _kernels()
    group = SimpleNamespace(ranks=list(range(ring_degree)), size=ring_degree)
    return [
        Ring(
            comm=ThreadComm(position, boxes),  # type: ignore[arg-type]
            group=group,  # type: ignore[arg-type]
            kernels=kernels,
            chunks_of=_layout(ring_degree, position, balanced).ring_chunks,
            position=position,
        )
        for position in range(ring_degree)
    ]


def _in_threads(work: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(work)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a ring position hung"
    if errors:
        raise errors[0]
    return results


def _tensors(seq: int, rows: int = len(ROWS)) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(rows, HEADS, seq, HEAD_DIM, generator=generator, dtype=torch.float64)
    k, v = (
        torch.randn(rows, KV_HEADS, seq, HEAD_DIM, generator=generator, dtype=torch.float64)
        for _ in range(2)
    )
    dout = torch.randn(rows, HEADS, seq, HEAD_DIM, generator=generator, dtype=torch.float64)
    return q, k, v, dout


def _run_ring(
    ring_degree: int,
    documents: Documents | None,
    balanced: bool = True,
    rows: list[list[int]] = ROWS,
) -> tuple[list[Ring], list[torch.Tensor], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Every ring position's forward and backward: (rings, positions held, whole output and
    lse, whole dq/dk/dv), scattered back to global positions."""
    seq = len(packed_positions(rows)[0])
    q, k, v, dout = _tensors(seq, len(rows))
    rings = _rings(ring_degree, balanced)
    layouts = [_layout(ring_degree, p, balanced) for p in range(ring_degree)]
    held = [layout.positions(seq) for layout in layouts]
    chunks = (
        None
        if documents is None
        else RingDocuments.of(documents.document_ids, layouts[0].num_chunks)
    )

    def forward(p: int) -> Any:
        def go() -> Any:
            mine = [t.index_select(2, held[p]) for t in (q, k, v)]
            return ring_forward(rings[p], *mine, chunks)

        return go

    forwards = _in_threads([forward(p) for p in range(ring_degree)])

    def backward(p: int) -> Any:
        def go() -> Any:
            mine = [t.index_select(2, held[p]) for t in (q, k, v)]
            out, lse = forwards[p]
            return ring_backward(rings[p], *mine, out, lse, dout.index_select(2, held[p]), chunks)

        return go

    backwards = _in_threads([backward(p) for p in range(ring_degree)])
    whole_out, whole_lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float64)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for p in range(ring_degree):
        whole_out[:, :, held[p]] = forwards[p][0]
        whole_lse[:, :, held[p]] = forwards[p][1].double()
        for whole, piece in zip(grads, backwards[p], strict=True):
            whole[:, :, held[p]] = piece
    return rings, held, (whole_out, whole_lse), tuple(grads)


def _reference(
    document_ids: torch.Tensor | None, rows: list[list[int]] = ROWS
) -> tuple[torch.Tensor, ...]:
    seq = len(packed_positions(rows)[0])
    q, k, v, dout = _tensors(seq, len(rows))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v, True, return_lse=True, document_ids=document_ids)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad  # type: ignore[return-value]


@pytest.mark.parametrize(("ring_degree", "balanced"), [(2, True), (4, True), (4, False)], ids=str)
def test_ring_with_documents_equals_masked_attention_over_whole_rows(
    ring_degree: int, balanced: bool
) -> None:
    # float64 in, blocks merged in float32 (as on an accelerator): agreement to ~1e-7.
    documents = Documents.from_positions(packed_positions(ROWS))
    _, _, (out, lse), grads = _run_ring(ring_degree, documents, balanced)
    want_out, want_lse, *want_grads = _reference(documents.document_ids)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_without_documents_the_ring_attends_across_them() -> None:
    """The negative control: plain causal ring attention differs on packed rows."""
    documents = Documents.from_positions(packed_positions(ROWS))
    _, _, (out, _), _ = _run_ring(2, None)
    want_out = _reference(documents.document_ids)[0]
    assert (out - want_out).abs().max() > 1e-2
    torch.testing.assert_close(out, _reference(None)[0], atol=1e-6, rtol=1e-5)


def test_blocks_sharing_no_document_are_skipped_and_work_counts_unmasked_entries() -> None:
    documents = Documents.from_positions(packed_positions(ROWS))
    for balanced in (True, False):
        rings, _, _, _ = _run_ring(4, documents, balanced)
        # Work summed over the ring: every (query, key) pair of a document once, per head.
        total = sum(ring.work.flops for ring in rings)
        assert total == 4 * HEADS * HEAD_DIM * documents.attention_pairs()
    # Row 1 spans the whole row, so no pair of chunks is skippable in this batch; a batch of
    # short documents only skips blocks.
    assert sum(ring.work.skipped for ring in rings) == 0
    short_rows = [[4] * 8, [2] * 16]
    short = Documents.from_positions(packed_positions(short_rows))
    rings, _, (out, _), grads = _run_ring(4, short, rows=short_rows)
    # No document crosses a chunk edge: each position computes its two diagonal blocks only.
    assert all(ring.work.skipped > 0 and ring.work.blocks == 2 for ring in rings)
    want_out, _, *want_grads = _reference(short.document_ids, short_rows)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[1], want_grads[1], atol=1e-6, rtol=1e-5)
    chunks = RingDocuments.of(short.document_ids, 8)
    assert block_pairs((0, 7), (1, 6), chunks) == []
    assert block_pairs((0, 7), (0, 7), chunks) == [(0, 0, True), (1, 1, True)]
    assert not chunks.shared[7][6] and chunks.shared[7][7]


def test_shared_documents_come_from_each_chunks_first_and_last_ids() -> None:
    # Row 0: one document over chunks 0-1, then one per chunk; row 1: one over chunks 1-2.
    positions = packed_positions([[8, 4, 4], [4, 8, 4]])  # 4 chunks of 4
    chunks = RingDocuments.of(Documents.from_positions(positions).document_ids, 4)
    assert [list(row) for row in chunks.shared] == [
        [True, True, False, False],
        [True, True, True, False],
        [False, True, True, False],
        [False, False, False, True],
    ]
    assert chunks.ids((0, 3)).shape == (2, 8)


def test_merge_treats_an_lse_of_minus_infinity_as_weight_zero() -> None:
    seen = torch.tensor([[[[1.0, 2.0]]]])
    blind = torch.zeros_like(seen)
    lse, no_key = torch.tensor([[[0.5]]]), torch.tensor([[[NEG_INF]]])
    # Both sides blind: output 0, lse −inf, no NaN.
    out, merged = merge(blind, no_key, blind, no_key)
    assert torch.equal(out, blind) and merged.item() == NEG_INF
    # One side blind: the other side exactly.
    for pair in ((blind, no_key, seen, lse), (seen, lse, blind, no_key)):
        out, merged = merge(*pair)
        assert torch.equal(out, seen) and merged.item() == 0.5
    # Then a block that sees keys takes over a blind running result.
    out, merged = merge(*merge(blind, no_key, blind, no_key), seen, lse)
    assert torch.equal(out, seen) and merged.item() == 0.5


def test_ulysses_attends_with_the_ids_of_its_ring_positions_portion() -> None:
    """Without a ring (Ulysses alone), the gathered portion is the whole row; with a layout of
    several ring positions, it is this position's two chunks."""
    positions = packed_positions(ROWS)
    documents = Documents.from_positions(positions)
    seq = positions.shape[1]
    q, k, v, _ = _tensors(seq)
    alone = ContextParallelAttention(kernels=_kernels(), layout=_layout(1, 0))
    want = attention(q, k, v, True, document_ids=documents.document_ids)
    torch.testing.assert_close(alone(q, k, v, documents=documents), want)
    layout = ContextParallelism(
        degree=4, rank=3, strategy="hybrid", ring_degree=2, ulysses_degree=2
    )
    hybrid = ContextParallelAttention(kernels=_kernels(), layout=layout)
    chunks = hybrid._ring_documents(documents, q.device)
    portion = layout.ring_positions(1, seq)
    assert torch.equal(hybrid._portion_ids(chunks), documents.ids_at(portion))
    # The ring view is computed once per micro-batch's documents.
    assert hybrid._ring_documents(documents, q.device) is chunks

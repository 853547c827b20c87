"""Triton causal attention in the FlashAttention-2 style, with grouped-query attention and
document masking (packed rows, varlen).

Forward: one program per (query block, batch·head) walks the key/value blocks up to the causal
diagonal with an online softmax, keeping the output accumulator, the running max and the
running sum in registers; only the output and the per-row logsumexp (base 2) are written.
Keys may be fewer or more than queries (a ring's block): the causal mask is bottom-right
aligned, as FlashAttention's. The walk is split as FlashAttention's and Triton's fused-attention
kernels split it: the key blocks every query of the block sees whole (left of the diagonal,
inside the keys) run with no mask built or applied and, when the head size is a power of two,
unmasked loads; only the blocks on the diagonal, at the end of the keys or at a document edge
take the masked path: causal at T = 2048 in 64-wide blocks, each query block's diagonal block
only, one block in 16 of those walked. dQ walks the same way; dK/dV keeps one masked
walk (split, its three walks inlined into the loop over a group's heads spilled registers on
Hopper: 208 bytes of stack became 744 on the default tile, compiled for sm_90).

Documents: with `document_ids` (and `key_document_ids` for another block's keys) a query sees
only keys of its own document. Ids never decrease along a row, so the keys of a query block's
documents are one contiguous range: a binary search per block (`document_ranges`, on the
device, before the launch) gives each program where to start and stop its walk, as
FlashAttention's varlen kernels walk only a document's own keys, and the element mask is
applied only inside those tiles. The backward walks the same ranges (dK/dV the range of
queries of each key block). A query that sees no key gets output 0 and lse -inf, exactly.

With `return_lse=True` the logsumexp is returned too (natural log, float32) and is
differentiable: d lse / d score = softmax probability, so its gradient only shifts delta
(`delta − dlse`) in the backward below. Context parallelism merges blocks with it.

Backward (recomputation, no stored probabilities): a pre-pass computes delta = rowsum(dO · O);
one kernel gives dQ per query block by walking key blocks; another gives dK and dV per key
block by walking query blocks *and the query heads of its group*, so grouped-query attention
sums its heads in registers — no atomics, deterministic, and no per-query-head dK/dV copy.

Each of the three main kernels takes its tile (query and key block sizes, warps, stages) from
its own `TileTuner`: timed per GPU model and problem on first use (`tuning.py`), unless the
caller fixes `block_m` / `block_n`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch
import triton
import triton.language as tl

from plait.plugins.kernels_triton.launch import dot_precision
from plait.plugins.kernels_triton.tuning import Tile, TileTuner, power_of_two_class, tile
from plait.plugins.kernels_triton.varlen_attention import (
    BlockRanges,
    DocumentIds,
    document_ids_of,
    ids_from_cu_seqlens,
)

LOG2_E = 1.4426950408889634
DEFAULT_BLOCK = 64


@triton.jit
def _attn_fwd_key_blocks(
    acc, running_max, running_sum, visits, q, q_docs, k_base, v_base, k_doc_base,
    stride_ks, stride_vs, rows, dims, dim_ok, start, end, hi, diagonal, qk_scale,
    CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The forward's walk over key blocks [start, end). MASKED: blocks that cross the causal
    diagonal, the end of the keys or a document edge; otherwise every query of the block sees
    every key, and no mask is built or applied."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + cols[None, :] * stride_ks + dims[:, None]
        v_ptrs = v_base + cols[:, None] * stride_vs + dims[None, :]
        if MASKED:
            col_ok = cols < hi
            k_t = tl.load(k_ptrs, mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
        elif EVEN_D:
            k_t = tl.load(k_ptrs)
        else:
            k_t = tl.load(k_ptrs, mask=dim_ok[:, None], other=0.0)
        scores = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (rows[:, None] + diagonal >= cols[None, :])
            if DOCUMENTS:
                k_docs = tl.load(k_doc_base + cols, mask=col_ok, other=-2)
                valid = valid & (q_docs[:, None] == k_docs[None, :])
            scores = tl.where(valid, scores, -float("inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # A row that has seen no key yet (its document starts later in the walk, or it has
            # none) keeps a max of -inf: subtracting 0 instead keeps its exp2 terms 0, not NaN.
            safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        else:
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            safe_max = new_max
        rescale = tl.exp2(running_max - safe_max)
        p = tl.exp2(scores - safe_max[:, None])
        running_sum = running_sum * rescale + tl.sum(p, axis=1)
        if MASKED:
            v = tl.load(v_ptrs, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
        visits += 1
    return acc, running_max, running_sum, visits


@triton.jit
def _attn_fwd(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, q_doc_ptr, k_doc_ptr, key_lo_ptr, key_hi_ptr, visits_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    n_heads, group_size, seq_q, seq_k, head_dim, qk_scale,
    CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr, COUNT_VISITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # Under torch.compile a scale derived from a symbolic head size arrives as float64, which
    # would turn every score and the loop-carried running max into float64.
    qk_scale = tl.cast(qk_scale, tl.float32)
    start_m = tl.program_id(0)
    n_blocks = tl.num_programs(0)
    batch_head = tl.program_id(1).to(tl.int64)
    batch = batch_head // n_heads
    head = batch_head % n_heads
    kv_head = head // group_size
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    dim_ok = dims < head_dim
    # Bottom-right aligned causal mask: key j is visible to query i when j <= i + diagonal.
    diagonal = seq_k - seq_q
    q_base = q_ptr + batch * stride_qb + head * stride_qh
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    q = tl.load(
        q_base + rows[:, None] * stride_qs + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )  # fmt: skip
    running_max = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo = 0
    hi = tl.minimum((start_m + 1) * BLOCK_M + diagonal, seq_k) if CAUSAL else seq_k
    if DOCUMENTS:
        # The keys of this block's documents, searched before the launch (`document_ranges`):
        # tiles outside [lo, hi) hold no key any of these queries may see, and are never loaded.
        lo = tl.load(key_lo_ptr + batch * n_blocks + start_m)
        hi = tl.minimum(hi, tl.load(key_hi_ptr + batch * n_blocks + start_m))
        q_docs = tl.load(q_doc_ptr + batch * seq_q + rows, mask=row_ok, other=-1)
        k_doc_base = k_doc_ptr + batch * seq_k
        full_hi = lo  # every tile may cross a document edge
    else:
        q_docs, k_doc_base = rows, k_base  # not read: no documents were given
        # Keys up to the first query's diagonal are seen by every query of the block.
        seen_by_all = tl.minimum(start_m * BLOCK_M + diagonal + 1, seq_k) if CAUSAL else seq_k
        full_hi = lo + tl.maximum(seen_by_all - lo, 0) // BLOCK_N * BLOCK_N
    # A counter from the start (a literal 0 would reach the walk as a compile-time constant,
    # which its loop cannot then carry).
    visits = tl.full([], 0, tl.int32)
    acc, running_max, running_sum, visits = _attn_fwd_key_blocks(
        acc, running_max, running_sum, visits, q, q_docs, k_base, v_base, k_doc_base,
        stride_ks, stride_vs, rows, dims, dim_ok, lo, full_hi, hi, diagonal, qk_scale,
        CAUSAL, DOCUMENTS, False, EVEN_D, BLOCK_N, PRECISION,
    )  # fmt: skip
    acc, running_max, running_sum, visits = _attn_fwd_key_blocks(
        acc, running_max, running_sum, visits, q, q_docs, k_base, v_base, k_doc_base,
        stride_ks, stride_vs, rows, dims, dim_ok, full_hi, hi, hi, diagonal, qk_scale,
        CAUSAL, DOCUMENTS, True, EVEN_D, BLOCK_N, PRECISION,
    )  # fmt: skip
    # A row that saw no key at all (another block's documents only, or above the diagonal of a
    # shorter key block) has a sum of 0: its output is exactly 0 and its logsumexp -inf.
    seen = running_sum > 0.0
    safe_sum = tl.where(seen, running_sum, 1.0)
    out = acc / safe_sum[:, None]
    o_base = o_ptr + batch * stride_ob + head * stride_oh
    tl.store(
        o_base + rows[:, None] * stride_os + dims[None, :],
        out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )  # fmt: skip
    lse = tl.where(seen, running_max + tl.log2(safe_sum), -float("inf"))
    tl.store(lse_ptr + batch_head * seq_q + rows, lse, mask=row_ok)
    if COUNT_VISITS:
        tl.store(visits_ptr + batch_head * n_blocks + start_m, visits)


@triton.jit
def _attn_bwd_delta(
    o_ptr, do_ptr, delta_ptr, stride_ob, stride_oh, stride_os, stride_db, stride_dh, stride_ds,
    n_heads, seq_len, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    batch_head = tl.program_id(1).to(tl.int64)
    batch = batch_head // n_heads
    head = batch_head % n_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < seq_len)[:, None] & (dims < head_dim)[None, :]
    o = tl.load(
        o_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + dims[None, :],
        mask=mask, other=0.0,
    ).to(tl.float32)  # fmt: skip
    do = tl.load(
        do_ptr + batch * stride_db + head * stride_dh + rows[:, None] * stride_ds + dims[None, :],
        mask=mask, other=0.0,
    ).to(tl.float32)  # fmt: skip
    tl.store(delta_ptr + batch_head * seq_len + rows, tl.sum(o * do, axis=1), mask=rows < seq_len)


@triton.jit
def _attn_dq_key_blocks(
    dq, visits, q, do, lse, delta, q_docs, k_base, v_base, k_doc_base, stride_ks, stride_vs,
    rows, row_ok, dims, dim_ok, start, end, hi, diagonal, qk_scale,
    CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ's walk over key blocks [start, end); MASKED as in `_attn_fwd_key_blocks`."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + cols[:, None] * stride_ks + dims[None, :]
        v_ptrs = v_base + cols[None, :] * stride_vs + dims[:, None]
        if MASKED:
            col_ok = cols < hi
            k = tl.load(k_ptrs, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
            v_t = tl.load(v_ptrs, mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v_t = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=dim_ok[None, :], other=0.0)
            v_t = tl.load(v_ptrs, mask=dim_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            valid = row_ok[:, None] & col_ok[None, :]
            if CAUSAL:
                valid = valid & (rows[:, None] + diagonal >= cols[None, :])
            if DOCUMENTS:
                k_docs = tl.load(k_doc_base + cols, mask=col_ok, other=-2)
                valid = valid & (q_docs[:, None] == k_docs[None, :])
            # Masked before exp2: a row that saw no key has lse -inf, and exp2(+inf) is no zero.
            p = tl.exp2(tl.where(valid, scores - lse[:, None], -float("inf")))
        else:
            p = tl.exp2(scores - lse[:, None])
        dp = tl.dot(do, v_t, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        visits += 1
    return dq, visits


@triton.jit
def _attn_bwd_dq(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    q_doc_ptr, k_doc_ptr, key_lo_ptr, key_hi_ptr, visits_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_db, stride_dh, stride_ds,
    n_heads, group_size, seq_q, seq_k, head_dim, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr, COUNT_VISITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)  # as fwd
    start_m = tl.program_id(0)
    n_blocks = tl.num_programs(0)
    batch_head = tl.program_id(1).to(tl.int64)
    batch = batch_head // n_heads
    head = batch_head % n_heads
    kv_head = head // group_size
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    dim_ok = dims < head_dim
    diagonal = seq_k - seq_q
    tile_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + batch * stride_qb + head * stride_qh + rows[:, None] * stride_qs + dims[None, :],
        mask=tile_mask, other=0.0,
    )  # fmt: skip
    do = tl.load(
        do_ptr + batch * stride_db + head * stride_dh + rows[:, None] * stride_ds + dims[None, :],
        mask=tile_mask, other=0.0,
    )  # fmt: skip
    lse = tl.load(lse_ptr + batch_head * seq_q + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + batch_head * seq_q + rows, mask=row_ok, other=0.0)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo = 0
    hi = tl.minimum((start_m + 1) * BLOCK_M + diagonal, seq_k) if CAUSAL else seq_k
    if DOCUMENTS:  # as in the forward
        lo = tl.load(key_lo_ptr + batch * n_blocks + start_m)
        hi = tl.minimum(hi, tl.load(key_hi_ptr + batch * n_blocks + start_m))
        q_docs = tl.load(q_doc_ptr + batch * seq_q + rows, mask=row_ok, other=-1)
        k_doc_base = k_doc_ptr + batch * seq_k
        full_hi = lo
    else:  # the forward's split: the tiles every query of the block sees whole, unmasked
        q_docs, k_doc_base = rows, k_base  # not read: no documents were given
        seen_by_all = tl.minimum(start_m * BLOCK_M + diagonal + 1, seq_k) if CAUSAL else seq_k
        full_hi = lo + tl.maximum(seen_by_all - lo, 0) // BLOCK_N * BLOCK_N
    visits = tl.full([], 0, tl.int32)  # as the forward's
    dq, visits = _attn_dq_key_blocks(
        dq, visits, q, do, lse, delta, q_docs, k_base, v_base, k_doc_base, stride_ks, stride_vs,
        rows, row_ok, dims, dim_ok, lo, full_hi, hi, diagonal, qk_scale,
        CAUSAL, DOCUMENTS, False, EVEN_D, BLOCK_N, PRECISION,
    )  # fmt: skip
    dq, visits = _attn_dq_key_blocks(
        dq, visits, q, do, lse, delta, q_docs, k_base, v_base, k_doc_base, stride_ks, stride_vs,
        rows, row_ok, dims, dim_ok, full_hi, hi, hi, diagonal, qk_scale,
        CAUSAL, DOCUMENTS, True, EVEN_D, BLOCK_N, PRECISION,
    )  # fmt: skip
    tl.store(
        dq_ptr + batch_head * seq_q * head_dim + rows[:, None] * head_dim + dims[None, :],
        (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=tile_mask,
    )  # fmt: skip
    if COUNT_VISITS:
        tl.store(visits_ptr + batch_head * n_blocks + start_m, visits)


@triton.jit
def _attn_bwd_dkdv(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    q_doc_ptr, k_doc_ptr, query_lo_ptr, query_hi_ptr, visits_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_db, stride_dh, stride_ds,
    n_heads, n_kv_heads, group_size, seq_q, seq_k, head_dim, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr, COUNT_VISITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)  # as fwd
    start_n = tl.program_id(0)
    n_blocks = tl.num_programs(0)
    batch_kv_head = tl.program_id(1).to(tl.int64)
    batch = batch_kv_head // n_kv_heads
    kv_head = batch_kv_head % n_kv_heads
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < seq_k
    dim_ok = dims < head_dim
    diagonal = seq_k - seq_q
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(
        k_ptr + batch * stride_kb + kv_head * stride_kh + cols[:, None] * stride_ks
        + dims[None, :], mask=kv_mask, other=0.0,
    )  # fmt: skip
    v = tl.load(
        v_ptr + batch * stride_vb + kv_head * stride_vh + cols[:, None] * stride_vs
        + dims[None, :], mask=kv_mask, other=0.0,
    )  # fmt: skip
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # Queries above the diagonal see none of these keys.
    lo = tl.maximum(start_n * BLOCK_N - diagonal, 0) if CAUSAL else 0
    hi = seq_q
    if DOCUMENTS:
        # The queries of this key block's documents (`document_ranges`, roles swapped).
        lo = tl.maximum(lo, tl.load(query_lo_ptr + batch * n_blocks + start_n))
        hi = tl.load(query_hi_ptr + batch * n_blocks + start_n)
        k_docs = tl.load(k_doc_ptr + batch * seq_k + cols, mask=col_ok, other=-2)
    visits = 0
    for member in range(0, group_size):
        head = kv_head * group_size + member
        batch_head = batch * n_heads + head
        q_base = q_ptr + batch * stride_qb + head * stride_qh
        do_base = do_ptr + batch * stride_db + head * stride_dh
        for block_m in range(lo, hi, BLOCK_M):
            rows = block_m + tl.arange(0, BLOCK_M)
            row_ok = rows < hi
            tile_mask = row_ok[:, None] & dim_ok[None, :]
            q = tl.load(q_base + rows[:, None] * stride_qs + dims[None, :], mask=tile_mask,
                        other=0.0)  # fmt: skip
            do = tl.load(do_base + rows[:, None] * stride_ds + dims[None, :], mask=tile_mask,
                         other=0.0)  # fmt: skip
            lse = tl.load(lse_ptr + batch_head * seq_q + rows, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + batch_head * seq_q + rows, mask=row_ok, other=0.0)
            # Transposed scores (keys × queries), so dK and dV come out without transposes.
            scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
            valid = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                valid = valid & (rows[None, :] + diagonal >= cols[:, None])
            if DOCUMENTS:
                q_docs = tl.load(q_doc_ptr + batch * seq_q + rows, mask=row_ok, other=-1)
                valid = valid & (k_docs[:, None] == q_docs[None, :])
            p_t = tl.exp2(tl.where(valid, scores_t - lse[None, :], -float("inf")))  # as dQ
            dv = dv + tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = dk + tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
            visits += 1
    out_offsets = batch_kv_head * seq_k * head_dim + cols[:, None] * head_dim + dims[None, :]
    tl.store(dk_ptr + out_offsets, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out_offsets, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)
    if COUNT_VISITS:
        tl.store(visits_ptr + batch_kv_head * n_blocks + start_n, visits)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _head_block(head_dim: int) -> int:
    # tl.dot needs every tile dimension to be at least 16.
    return max(16, triton.next_power_of_2(head_dim))


# The default is the FlashAttention-2 64×64 tile. The candidates follow each kernel's loop: the
# forward and dQ hold a query block (BLOCK_M) and walk key blocks, so they try tall query
# blocks; dK/dV holds a key block (BLOCK_N) and walks query blocks, so it tries tall key
# blocks (the shapes Triton's fused-attention tutorial uses on Hopper and Ampere).
DEFAULT_TILE = tile(4, 2, BLOCK_M=DEFAULT_BLOCK, BLOCK_N=DEFAULT_BLOCK)
FORWARD_TILES = TileTuner(
    "attention.forward",
    (
        DEFAULT_TILE,
        tile(4, 3, BLOCK_M=128, BLOCK_N=64),
        tile(8, 3, BLOCK_M=128, BLOCK_N=64),
        tile(8, 3, BLOCK_M=128, BLOCK_N=128),
        tile(4, 4, BLOCK_M=128, BLOCK_N=32),
        tile(4, 3, BLOCK_M=64, BLOCK_N=32),
    ),
    default=DEFAULT_TILE,
)
DQ_TILES = TileTuner(
    "attention.backward_dq",
    (
        DEFAULT_TILE,
        tile(4, 3, BLOCK_M=128, BLOCK_N=32),
        tile(8, 2, BLOCK_M=128, BLOCK_N=64),
        tile(4, 5, BLOCK_M=128, BLOCK_N=32),
        tile(4, 3, BLOCK_M=64, BLOCK_N=32),
    ),
    default=DEFAULT_TILE,
)
DKDV_TILES = TileTuner(
    "attention.backward_dkdv",
    (
        DEFAULT_TILE,
        tile(4, 3, BLOCK_M=32, BLOCK_N=128),
        tile(8, 2, BLOCK_M=64, BLOCK_N=128),
        tile(4, 5, BLOCK_M=32, BLOCK_N=128),
        tile(4, 3, BLOCK_M=32, BLOCK_N=64),
    ),
    default=DEFAULT_TILE,
)


def given_tile(block_m: int | None, block_n: int | None) -> Tile | None:
    """The tile the caller fixed with `block_m` / `block_n`, used by every kernel; None: tune."""
    if block_m is None and block_n is None:
        return None
    return tile(DEFAULT_TILE.num_warps, DEFAULT_TILE.num_stages,
                BLOCK_M=block_m or DEFAULT_BLOCK, BLOCK_N=block_n or DEFAULT_BLOCK)  # fmt: skip


def _problem(
    q: torch.Tensor, n_kv_heads: int, causal: bool, documents: bool
) -> tuple[Hashable, ...]:
    """What decides the best tile: dtype, head size, masking, the sequence length's class,
    whether query heads share key/value heads (dK/dV then walk several heads' queries) and
    whether documents cut the walks short (short walks favour other tiles than full ones)."""
    _, n_heads, seq_len, head_dim = q.shape
    return (str(q.dtype).removeprefix("torch."), _head_block(head_dim), causal,
            power_of_two_class(seq_len), n_heads // n_kv_heads, documents)  # fmt: skip


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    given: Tile | None,
    ranges: BlockRanges,
    visits: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) with lse the base-2 log-sum-exp of log2(e)-scaled scores (B, H, Sq), fp32:
    what `attention_backward` reads. `given` fixes the tile (else tuned); `ranges` holds the
    document ids, if any."""
    batch, n_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_k = k.shape[1], k.shape[2]
    if k.shape != (batch, n_kv_heads, seq_k, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"attention: q {tuple(q.shape)} needs k and v of shape (batch, kv_heads, "
            f"seq_k, {head_dim}); got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if n_heads % n_kv_heads:
        raise ValueError(f"attention: {n_heads} heads are not a multiple of {n_kv_heads}")
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    block_d = _head_block(head_dim)
    sm_scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, n_heads, seq_q, dtype=torch.float32, device=q.device)
    documents = ranges.documents is not None

    def launch(chosen: Tile) -> None:
        n_blocks = triton.cdiv(seq_q, chosen["BLOCK_M"])
        counts = _visit_counts(visits, "forward", batch * n_heads, n_blocks, q.device)
        _attn_fwd[(n_blocks, batch * n_heads)](
            q, k, v, out, lse, *ranges.pointers("keys", chosen["BLOCK_M"]), counts,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            n_heads, n_heads // n_kv_heads, seq_q, seq_k, head_dim, sm_scale * LOG2_E,
            CAUSAL=causal, DOCUMENTS=documents, COUNT_VISITS=counts is not None,
            BLOCK_D=block_d, EVEN_D=head_dim == block_d, PRECISION=dot_precision(q.dtype),
            **chosen.launch_options(),
        )  # fmt: skip

    problem = _problem(q, n_kv_heads, causal, documents)
    launch(given or FORWARD_TILES.choose(problem, launch, q.device))
    return out, lse


def attention_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    given: Tile | None,
    ranges: BlockRanges,
    visits: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `attention_forward`; `dlse` is the gradient of the natural-log lse."""
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    documents = ranges.documents is not None
    batch, n_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_k = k.shape[1], k.shape[2]
    group_size = n_heads // n_kv_heads
    block_d = _head_block(head_dim)
    dout = _unit_last_stride(dout)
    sm_scale = 1.0 / math.sqrt(head_dim)
    delta = torch.empty_like(lse)
    delta_rows = (given or DEFAULT_TILE)["BLOCK_M"]
    _attn_bwd_delta[(triton.cdiv(seq_q, delta_rows), batch * n_heads)](
        out, dout, delta, *_strides(out), *_strides(dout), n_heads, seq_q, head_dim,
        BLOCK_M=delta_rows, BLOCK_D=block_d,
    )  # fmt: skip
    if dlse is not None:
        # dS += P · dlse, i.e. delta − dlse in dS = P · (dP − delta).
        delta = delta - dlse.float()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    common = dict(
        CAUSAL=causal, DOCUMENTS=documents, BLOCK_D=block_d, PRECISION=dot_precision(q.dtype),
    )  # fmt: skip

    def launch_dq(chosen: Tile) -> None:
        n_blocks = triton.cdiv(seq_q, chosen["BLOCK_M"])
        counts = _visit_counts(visits, "backward_dq", batch * n_heads, n_blocks, q.device)
        _attn_bwd_dq[(n_blocks, batch * n_heads)](
            q, k, v, dout, lse, delta, dq, *ranges.pointers("keys", chosen["BLOCK_M"]),
            counts, *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
            n_heads, group_size, seq_q, seq_k, head_dim, sm_scale * LOG2_E, sm_scale,
            COUNT_VISITS=counts is not None, EVEN_D=head_dim == block_d, **common,
            **chosen.launch_options(),
        )  # fmt: skip

    def launch_dkdv(chosen: Tile) -> None:
        n_blocks = triton.cdiv(seq_k, chosen["BLOCK_N"])
        counts = _visit_counts(visits, "backward_dkdv", batch * n_kv_heads, n_blocks, q.device)
        _attn_bwd_dkdv[(n_blocks, batch * n_kv_heads)](
            q, k, v, dout, lse, delta, dk, dv, *ranges.pointers("queries", chosen["BLOCK_N"]),
            counts, *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
            n_heads, n_kv_heads, group_size, seq_q, seq_k, head_dim, sm_scale * LOG2_E,
            sm_scale, COUNT_VISITS=counts is not None, **common, **chosen.launch_options(),
        )  # fmt: skip

    problem = _problem(q, n_kv_heads, causal, documents)
    launch_dq(given or DQ_TILES.choose(problem, launch_dq, q.device))
    launch_dkdv(given or DKDV_TILES.choose(problem, launch_dkdv, q.device))
    return dq, dk, dv


class AttentionFunction(torch.autograd.Function):
    """softmax(Q·Kᵀ/√d [+ causal mask] [+ document mask]) · V with K/V heads shared by groups
    of query heads."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        block_m: int | None,
        block_n: int | None,
        return_lse: bool = False,
        documents: DocumentIds | None = None,
        visits: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        given = given_tile(block_m, block_n)
        ranges = BlockRanges(documents)
        q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
        out, lse = attention_forward(q, k, v, causal, given, ranges, visits)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        ctx.given_tile = given
        ctx.ranges = ranges
        ctx.visits = visits
        if return_lse:
            # The kernel keeps log2 of the sum over exp2 of log2(e)-scaled scores.
            return out, lse / LOG2_E
        return out

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, ...]:
        grads = attention_backward(
            dout, dlse, *ctx.saved_tensors, ctx.causal, ctx.given_tile, ctx.ranges, ctx.visits
        )
        return *grads, None, None, None, None, None, None


def _visit_counts(
    visits: dict[str, torch.Tensor] | None, kernel: str, programs: int, blocks: int,
    device: torch.device,
) -> torch.Tensor | None:  # fmt: skip
    """Where `kernel` writes how many tiles each of its programs walked, when asked to."""
    if visits is None:
        return None
    visits[kernel] = torch.zeros(programs, blocks, dtype=torch.int32, device=device)
    return visits[kernel]


def check_blocks(block_m: int | None, block_n: int | None) -> None:
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block is not None and (block < 16 or block & (block - 1)):
            raise ValueError(f"{name} must be a power of two of at least 16, got {block}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    return_lse: bool = False,
    document_ids: torch.Tensor | None = None,
    key_document_ids: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, q (B, H, Sq, D), k/v (B, KV_H, Sk, D), H % KV_H == 0.

    `block_m`/`block_n` (powers of two, at least 16) set the query/key tile sizes.
    `return_lse=True` returns `(out, lse)`, lse (B, H, Sq) the natural logsumexp of each query
    row's scaled scores, in float32, differentiable.

    `document_ids` (B, Sq) int32 names each query's document and `key_document_ids` (B, Sk)
    each key's (default: `document_ids`); a query sees only keys of its own document (and,
    with `causal`, not after it, bottom-right aligned). Ids never decrease along a row
    (`plait.core.documents`), which lets every program walk only the tiles of its documents.
    A query that sees no key has output 0 and lse -inf, and passes no gradient.
    """
    check_blocks(block_m, block_n)
    documents = document_ids_of(q, k, document_ids, key_document_ids)
    return AttentionFunction.apply(q, k, v, causal, block_m, block_n, return_lse, documents)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention` over packed rows given by varlen offsets rather than ids: `cu_seqlens` holds
    each document's start in the flattened batch·seq tokens and then their total, as
    FlashAttention's varlen functions and `plait.core.documents.Documents` keep them. Keys are
    the queries' own rows (self-attention)."""
    ids = ids_from_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2])
    return attention(
        q, k, v, causal, block_m=block_m, block_n=block_n, return_lse=return_lse,
        document_ids=ids,
    )  # fmt: skip


def tiles_visited(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    document_ids: torch.Tensor | None = None,
    key_document_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Runs attention forward and backward and returns, per kernel ("forward", "backward_dq",
    "backward_dkdv"), how many key (or query) tiles each program walked: (programs, blocks)
    int32. For tests and benchmarks of the tile skipping; the kernels count only when asked."""
    check_blocks(block_m, block_n)
    documents = document_ids_of(q, k, document_ids, key_document_ids)
    visits: dict[str, torch.Tensor] = {}
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = AttentionFunction.apply(q, k, v, causal, block_m, block_n, False, documents, visits)
    out.backward(torch.ones_like(out))
    return visits

"""Document-masked Triton attention compiled for the GPU (the unit tier runs it interpreted):
forward, lse and q/k/v gradients in fp32, fp16 and bf16 against a float32 masked softmax, on
odd lengths with the default 64-wide tiles; another block's keys with blind queries; and the
compiled kernels' tile walks against the full causal walk."""

from __future__ import annotations

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# As tests/gpu/test_triton_compiled.py: fp32 dots are IEEE (TF32 off), half types round tiles.
TOLERANCES = {
    torch.float32: (1e-4, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (4e-2, 4e-2),
}


def _random_documents(batch: int, seq: int, seed: int, longest: int) -> torch.Tensor:
    """(batch, seq) int32 ids of random-length documents laid end to end, unique per batch."""
    generator = torch.Generator().manual_seed(seed)
    rows, next_id = [], 0
    for _ in range(batch):
        ids: list[int] = []
        while len(ids) < seq:
            length = int(torch.randint(1, longest + 1, (1,), generator=generator))
            ids += [next_id] * min(length, seq - len(ids))
            next_id += 1
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def _reference(q, k, v, causal, query_ids, key_ids):
    """The masked softmax in float32; a query that sees no key: output 0, lse -inf."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    seq_q, seq_k = scores.shape[-2:]
    allowed = query_ids[:, None, :, None] == key_ids[:, None, None, :]
    if causal:
        later = torch.ones(seq_q, seq_k, dtype=torch.bool, device="cuda").triu(1 + seq_k - seq_q)
        allowed = allowed & ~later
    blind = ~allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(blind, 0.0)
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - lse[..., None]).masked_fill(blind, 0.0) @ v
    return out, lse.masked_fill(blind.squeeze(-1), float("-inf"))


def _compare(dtype, shapes, causal, query_ids, key_ids=None, seed=0):
    from plait.plugins.kernels_triton.attention import attention

    generator = torch.Generator(device="cuda").manual_seed(seed)
    inputs = [torch.randn(s, device="cuda", generator=generator) for s in shapes]
    ours = [t.to(dtype).requires_grad_() for t in inputs]
    theirs = [t.to(dtype).float().requires_grad_() for t in inputs]
    out, lse = attention(
        *ours, causal, return_lse=True, document_ids=query_ids, key_document_ids=key_ids
    )
    keys = query_ids if key_ids is None else key_ids
    expected, expected_lse = _reference(*theirs, causal, query_ids, keys)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, expected_lse, atol=atol, rtol=rtol)
    upstream = torch.randn(out.shape, device="cuda", generator=generator)
    w_lse = torch.randn(lse.shape, device="cuda", generator=generator)

    def loss(out, lse):
        return (out.float() * upstream).sum() + (
            torch.where(lse.isfinite(), lse, 0.0) * w_lse
        ).sum()

    grads = torch.autograd.grad(loss(out, lse), ours)
    expected_grads = torch.autograd.grad(loss(expected, expected_lse), theirs)
    for name, mine, ref in zip("qkv", grads, expected_grads, strict=True):
        assert mine.dtype == dtype and torch.isfinite(mine).all(), f"gradient of {name}"
        torch.testing.assert_close(
            mine.float(), ref, atol=atol * 4, rtol=rtol * 4, msg=f"gradient of {name}"
        )
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "head_dim", "causal", "longest"),
    [(8, 2, 1037, 64, True, 300), (4, 4, 333, 128, False, 40), (6, 1, 77, 40, True, 5)],
)
def test_document_attention(dtype, heads, kv_heads, seq, head_dim, causal, longest) -> None:
    ids = _random_documents(2, seq, seed=seq, longest=longest)
    shapes = [(2, heads, seq, head_dim), *[(2, kv_heads, seq, head_dim)] * 2]
    _compare(dtype, shapes, causal, ids, seed=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_another_blocks_keys_with_blind_queries(dtype) -> None:
    """A ring's off-diagonal block: queries of one stretch, keys of the one before it."""
    ids = _random_documents(2, 512, seed=3, longest=120)
    query_ids, key_ids = ids[:, 256:].contiguous(), ids[:, :256].contiguous()
    shapes = [(2, 4, 256, 64), (2, 2, 256, 64), (2, 2, 256, 64)]
    out, lse = _compare(dtype, shapes, False, query_ids, key_ids, seed=2)
    blind = ~torch.isin(query_ids, key_ids)[:, None, :].expand_as(lse)
    assert blind.any() and (~blind).any()
    assert torch.isneginf(lse[blind]).all() and (out[blind] == 0).all()


def test_compiled_walks_skip_other_documents_tiles() -> None:
    from plait.plugins.kernels_triton.attention import tiles_visited

    seq = 2048
    ids = torch.arange(seq, device="cuda", dtype=torch.int32)[None] // 64  # documents of 64
    q, k, v = (torch.randn(1, 2, seq, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sparse = tiles_visited(q, k, v, True, block_m=64, block_n=64, document_ids=ids)
    dense = tiles_visited(q, k, v, True, block_m=64, block_n=64)
    blocks = seq // 64
    for kernel in ("forward", "backward_dq", "backward_dkdv"):
        assert int(sparse[kernel].sum()) == 2 * blocks, kernel  # one tile per program
        assert int(dense[kernel].sum()) == 2 * blocks * (blocks + 1) // 2, kernel

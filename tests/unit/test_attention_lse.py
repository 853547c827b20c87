"""The attention op's `return_lse=True` contract: the torch reference against a naive softmax in
float64 (values and gradients through both outputs), the Triton kernel against the reference
under the interpreter, and the merge rule context parallelism builds on it."""

from __future__ import annotations

import pytest
import torch

from plait.plugins.kernels_torch import ops as reference
from tests.unit.triton_interpreter import interpreted_only


def _inputs(dtype: torch.dtype, *, heads: int = 4, kv_heads: int = 2, seq: int = 19):
    generator = torch.Generator().manual_seed(3)
    shapes = ((2, heads, seq, 8), (2, kv_heads, seq, 8), (2, kv_heads, seq, 8))
    return [torch.randn(s, generator=generator, dtype=dtype).requires_grad_() for s in shapes]


def _naive(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ v, lse


def _loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # Weights make every element of both outputs matter to the gradient.
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    w_lse = torch.linspace(1, -2, lse.numel(), dtype=lse.dtype).view_as(lse)
    return (out * w_out).sum() + (lse.to(out.dtype) * w_lse).sum()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_reference_lse_values_and_gradients(causal: bool, kv_heads: int) -> None:
    q, k, v = _inputs(torch.float64, kv_heads=kv_heads)
    out, lse = reference.attention(q, k, v, causal, return_lse=True)
    grads = torch.autograd.grad(_loss(out, lse), (q, k, v))
    expected_out, expected_lse = _naive(q, k, v, causal)
    expected_grads = torch.autograd.grad(_loss(expected_out, expected_lse), (q, k, v))
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    # The plain path (SDPA) gives the same output, and so does the fused path without autograd.
    torch.testing.assert_close(reference.attention(q, k, v, causal), out)
    with torch.no_grad():
        fused_out, fused_lse = reference.attention(q, k, v, causal, return_lse=True)
    torch.testing.assert_close(fused_out, expected_out)
    torch.testing.assert_close(fused_lse, expected_lse)


def test_blocks_merged_by_lse_equal_attention_over_the_whole() -> None:
    """Attention over keys [A; B] is the lse-weighted mix of attention over A and over B."""
    q, k, v = _inputs(torch.float64, seq=16)
    whole, whole_lse = reference.attention(q, k, v, False, return_lse=True)
    out_a, lse_a = reference.attention(q, k[:, :, :8], v[:, :, :8], False, return_lse=True)
    out_b, lse_b = reference.attention(q, k[:, :, 8:], v[:, :, 8:], False, return_lse=True)
    merged_lse = torch.logaddexp(lse_a, lse_b)
    merged = (lse_a - merged_lse).exp()[..., None] * out_a
    merged = merged + (lse_b - merged_lse).exp()[..., None] * out_b
    torch.testing.assert_close(merged, whole)
    torch.testing.assert_close(merged_lse, whole_lse)
    # Without the correction (plain sum of the block outputs) the result is wrong.
    assert not torch.allclose(out_a + out_b, whole)


@pytest.mark.triton
@interpreted_only
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("causal", [True, False])
def test_triton_lse_matches_reference(causal: bool) -> None:
    from plait.plugins.kernels_triton.attention import attention

    q, k, v = _inputs(torch.float32)
    out, lse = attention(q, k, v, causal, block_m=16, block_n=16, return_lse=True)
    grads = torch.autograd.grad(_loss(out, lse), (q, k, v))
    expected_out, expected_lse = reference.attention(q, k, v, causal, return_lse=True)
    expected_grads = torch.autograd.grad(_loss(expected_out, expected_lse), (q, k, v))
    tolerance = {"atol": 5e-5, "rtol": 2e-4}
    torch.testing.assert_close(out, expected_out, **tolerance)
    torch.testing.assert_close(lse, expected_lse, **tolerance)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, **tolerance)

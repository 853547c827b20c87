"""Triton point-wise ops: SwiGLU, bias + GELU (tanh approximation), rotary embeddings.

Each forward reads its inputs once and writes one output; each backward recomputes the cheap
activation instead of saving it, so the autograd graph holds only the inputs (the trade the
fused Megatron and Liger kernels make).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

POINTWISE_BLOCK = 1024


@triton.jit
def _swiglu_fwd(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(gate_ptr, up_ptr, dout_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(dgate_ptr + offs, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (dout * silu).to(dup_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_fwd(x_ptr, bias_ptr, out_ptr, n, n_cols, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = z + tl.load(bias_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    # 0.5·z·(1 + tanh(u)) = z·sigmoid(2u): no 1 + tanh cancellation in the negative tail.
    out = z * tl.sigmoid(2.0 * 0.7978845608028654 * (z + 0.044715 * z * z * z))
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd(x_ptr, bias_ptr, dout_ptr, dx_ptr, n, n_cols, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = z + tl.load(bias_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
    du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
    # With 1 + tanh(u) = 2·sigmoid(2u) and 1 - tanh(u) = 2·sigmoid(-2u), both factors of the
    # derivative stay accurate in the tails where tanh(u) rounds to ±1.
    sig_pos = tl.sigmoid(2.0 * u)
    sig_neg = tl.sigmoid(-2.0 * u)
    dgelu = sig_pos + 2.0 * z * sig_pos * sig_neg * du
    tl.store(dx_ptr + offs, (dout * dgelu).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xb, stride_xs, stride_xh, stride_ob, stride_os, stride_oh, stride_cs,
    seq_len, n_heads, half,
    INVERSE: tl.constexpr, ROW_TABLES: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    # One program per (batch, position): every head shares that position's cos/sin row.
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid % seq_len
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (cols < half)
    # Packed rows have positions of their own: one cos/sin row per (batch, position).
    table_row = pid if ROW_TABLES else s
    cos = tl.load(cos_ptr + table_row * stride_cs + cols, mask=cols < half, other=0.0)
    sin = tl.load(sin_ptr + table_row * stride_cs + cols, mask=cols < half, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    if INVERSE:
        # The backward of a rotation is the rotation by the opposite angle.
        sin = -sin
    x_row = x_ptr + b * stride_xb + s * stride_xs + heads * stride_xh
    x1 = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + cols, mask=mask, other=0.0).to(tl.float32)
    out_row = out_ptr + b * stride_ob + s * stride_os + heads * stride_oh
    tl.store(out_row + cols, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + half + cols, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _pointwise_grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, POINTWISE_BLOCK),)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    gate, up = _flat(gate), _flat(up)
    out = torch.empty_like(gate)
    _swiglu_fwd[_pointwise_grid(gate.numel())](gate, up, out, gate.numel(), BLOCK=POINTWISE_BLOCK)
    return out


def swiglu_backward(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up, dout = _flat(gate), _flat(up), _flat(dout)
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    _swiglu_bwd[_pointwise_grid(gate.numel())](
        gate, up, dout, dgate, dup, gate.numel(), BLOCK=POINTWISE_BLOCK
    )
    return dgate, dup


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(
            f"bias_gelu: bias {tuple(bias.shape)} must be ({x.shape[-1]},) for x {tuple(x.shape)}"
        )
    x, bias = _flat(x), _flat(bias)
    out = torch.empty_like(x)
    _bias_gelu_fwd[_pointwise_grid(x.numel())](
        x, bias, out, x.numel(), x.shape[-1], BLOCK=POINTWISE_BLOCK
    )
    return out


def bias_gelu_backward(
    dout: torch.Tensor, x: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x, bias, dout = _flat(x), _flat(bias), _flat(dout)
    dx = torch.empty_like(x)
    _bias_gelu_bwd[_pointwise_grid(x.numel())](
        x, bias, dout, dx, x.numel(), x.shape[-1], BLOCK=POINTWISE_BLOCK
    )
    # The bias gradient is the input gradient summed over every leading dimension.
    dbias = dx.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)
    return dx, dbias


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) · up, element-wise."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return swiglu_backward(dout, *ctx.saved_tensors)


class BiasGeluFunction(torch.autograd.Function):
    """gelu_tanh(x + bias), the bias broadcast over the last dimension of x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = bias_gelu_forward(x, bias)
        ctx.save_for_backward(x, bias)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return bias_gelu_backward(dout, *ctx.saved_tensors)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    batch, seq_len, n_heads, head_dim = x.shape
    half = head_dim // 2
    row_tables = cos.ndim == 3
    allowed = (batch, seq_len, half) if row_tables else (seq_len, half)
    if head_dim % 2 or cos.shape != allowed or sin.shape != cos.shape:
        raise ValueError(
            f"rope: x {tuple(x.shape)} needs an even head_dim and cos/sin of shape "
            f"({seq_len}, {half}) or ({batch}, {seq_len}, {half}); got cos {tuple(cos.shape)}, "
            f"sin {tuple(sin.shape)}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = _flat(cos).reshape(-1, half), _flat(sin).reshape(-1, half)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rope_kernel[(batch * seq_len,)](
        x, cos, sin, out,
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        cos.stride(0), seq_len, n_heads, half,
        INVERSE=inverse, ROW_TABLES=row_tables, BLOCK_H=triton.next_power_of_2(n_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )  # fmt: skip
    return out


class RopeFunction(torch.autograd.Function):
    """Rotary position embedding, rotating the two halves of head_dim ("rotate_half")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return rotate(dout, cos, sin, inverse=True), None, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for tensors of one shape."""
    return SwiGLUFunction.apply(gate, up)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias) with `bias` of shape (x.shape[-1],).

    gelu_tanh(z) = 0.5·z·(1 + tanh(√(2/π)·(z + 0.044715·z³))), GPT-2's activation.
    """
    return BiasGeluFunction.apply(x, bias)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, seq, heads, head_dim) by cos/sin of shape (seq, head_dim // 2), or
    (batch, seq, head_dim // 2) for rows with positions of their own."""
    return RopeFunction.apply(x, cos, sin)

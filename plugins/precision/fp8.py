"""fp8 linear layers: the three GEMMs of `nn.Linear` through `torch._scaled_mm` with dynamic
per-tensor scaling (the recipe of Micikevicius et al., "FP8 Formats for Deep Learning", 2022,
and of torchao's `Float8Linear` with tensorwise scaling).

Forward: the input and the weight are cast to e4m3 with a scale each, `amax / 448`, computed
from the tensor at hand (no history, so nothing to warm up or checkpoint); the product comes back
in the compute dtype. Backward: the output gradient is cast to e5m2 (more range, less precision:
gradients span more orders of magnitude) and multiplies the saved fp8 weight (input gradient)
and the saved fp8 input (weight gradient). The bias stays in the compute dtype.

fp8 tensor cores exist from compute capability 8.9 (Ada, Hopper); `check_fp8_device` refuses
anything else before a layer is swapped. `torch._scaled_mm` wants its second operand
column-major, hence the transposes below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plait.core.errors import ConfigError

FORWARD_DTYPE = torch.float8_e4m3fn
BACKWARD_DTYPE = torch.float8_e5m2
# Minimum compute capability with fp8 tensor cores: Ada (8.9) and Hopper (9.0).
FP8_CAPABILITY = (8, 9)
# `torch._scaled_mm` needs both GEMM dims of its operands divisible by 16.
ALIGNMENT = 16


def check_fp8_device(device: torch.device) -> None:
    """Refuse, naming the device, where fp8 matmuls cannot run."""
    if device.type != "cuda":
        raise ConfigError(
            f"amp.fp8 needs a GPU with fp8 tensor cores (compute capability >= 8.9: Ada, "
            f"Hopper); this run is on {device.type}; set amp.fp8 = false"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ConfigError(
            f"amp.fp8 needs compute capability >= 8.9 (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}; "
            "set amp.fp8 = false"
        )


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in `dtype` with the per-tensor scale that maps its largest magnitude to the format's
    largest value; returns (fp8 tensor, dequantisation scale) with `x ≈ fp8 · scale`."""
    largest = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = amax / largest
    return (x.float() / scale).clamp(-largest, largest).to(dtype), scale


def _column_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def _scaled_mm(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return torch._scaled_mm(
        a.contiguous(), _column_major(b), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype
    )


class _Float8Matmul(torch.autograd.Function):
    """`x Wᵀ` with all three GEMMs in fp8 (x: (N, in), W: (out, in))."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x8, x_scale = to_fp8(x, FORWARD_DTYPE)
        w8, w_scale = to_fp8(weight, FORWARD_DTYPE)
        ctx.save_for_backward(x8, x_scale, w8, w_scale)
        ctx.dtypes = (x.dtype, weight.dtype)
        return _scaled_mm(x8, x_scale, w8.t(), w_scale, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x8, x_scale, w8, w_scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, g_scale = to_fp8(grad, BACKWARD_DTYPE)
        grad_x = _scaled_mm(g8, g_scale, w8, w_scale, x_dtype)
        grad_w = _scaled_mm(g8.t(), g_scale, x8, x_scale, w_dtype)
        return grad_x, grad_w


class Float8Linear(nn.Linear):
    """An `nn.Linear` whose matmuls run in fp8; parameters, their gradients and the bias stay in
    the module's dtype (the optimizer and data parallelism never see fp8)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = _Float8Matmul.apply(flat, self.weight).reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out


def convert_to_float8(model: nn.Module, *, skip: Sequence[str] = ()) -> list[str]:
    """Swap, in place, every `nn.Linear` whose dims fit `_scaled_mm` and whose name is not in
    `skip` (the output head, by default: its logits feed a softmax over the whole vocabulary)
    for a `Float8Linear`; returns the names swapped."""
    swapped = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name in skip or name.rpartition(".")[2] in skip:
            continue
        if module.in_features % ALIGNMENT or module.out_features % ALIGNMENT:
            continue
        module.__class__ = Float8Linear
        swapped.append(name)
    return swapped

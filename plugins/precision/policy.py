"""The mixed-precision policy: which dtype parameters live in, compute runs in, gradients reduce in.

Two layouts, chosen by `param_dtype`:

- **low-precision parameters** (`param_dtype` = the compute dtype, the default; Megatron's and
  DeepSpeed's bf16/fp16 mode): the module's parameters and gradients are bf16/fp16, the optimizer
  steps fp32 master copies and the updated masters are cast back after every step. Half the
  parameter and gradient memory and half the gradient-reduction bytes of fp32.
- **fp32 parameters under autocast** (`param_dtype = "fp32"`, torch AMP's layout): parameters,
  gradients and optimizer stay fp32 and the forward runs under `torch.autocast`, which casts
  matmul inputs to the compute dtype. No master copies are needed.

Numerically sensitive ops keep fp32 whatever the policy: the reference kernels compute RMSNorm /
RoPE statistics and the cross-entropy in fp32, and the scaled loss is always fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_map

from plait.core.transforms import PrecisionPolicy

DtypeName = Literal["bf16", "fp16", "fp32"]

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def make_policy(
    dtype: DtypeName, param_dtype: DtypeName | None, reduce_dtype: DtypeName | None
) -> PrecisionPolicy:
    """Resolve the config's names; unset `param_dtype` follows `dtype`, unset `reduce_dtype`
    follows the gradients' dtype (= `param_dtype`)."""
    compute = DTYPES[dtype]
    params = DTYPES[param_dtype] if param_dtype is not None else compute
    if params not in (compute, torch.float32):
        raise ValueError(
            f"amp.param_dtype must be the compute dtype ({dtype}) or fp32, got {param_dtype}"
        )
    reduce = DTYPES[reduce_dtype] if reduce_dtype is not None else params
    return PrecisionPolicy(compute_dtype=compute, param_dtype=params, reduce_dtype=reduce)


@torch.no_grad()
def cast_parameters_(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point parameters in place (their `nn.Parameter` objects and attributes, such
    as sharding marks, survive). Buffers keep their dtype: the RoPE tables stay fp32."""
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def cast_floating_inputs_hook(dtype: torch.dtype) -> Callable[..., Any]:
    """A forward pre-hook casting floating-point inputs (hidden states arriving at a pipeline
    stage, a user's float features) to the parameters' dtype; integer token ids pass through."""

    def cast(tensor: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            return tensor.to(dtype)
        return tensor

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        del module
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


class AutocastHooks:
    """Enter `torch.autocast` in a forward pre-hook and leave it in a forward hook (called even
    when the forward raises), so the module keeps its type and parameter names."""

    def __init__(self, module: nn.Module, *, device_type: str, dtype: torch.dtype) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._active: list[torch.autocast] = []
        self.handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        del module, args
        context = torch.autocast(device_type=self.device_type, dtype=self.dtype)
        context.__enter__()
        self._active.append(context)

    def _exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        del module, args, output
        if self._active:
            self._active.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

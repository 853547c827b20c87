"""Triton RMSNorm and LayerNorm: one program per row forward, persistent programs backward.

The forward saves per-row statistics (`rstd`, and `mean` for LayerNorm) in fp32 so the backward
never recomputes a reduction over the row. The backward runs a fixed number of programs, each
walking a strided set of rows and accumulating its partial weight/bias gradients in registers;
the partials (`programs × hidden`) are summed afterwards in fp32. This is the layout of Apex's
and Liger's fused norms: it avoids atomics, so gradients are deterministic.

How each launch is shaped is tuned per GPU model (`tuning.py`): the warps that share a row (the
Apex/Liger thresholds and their neighbours) and, backward, the programs per SM. Liger launches
one program per SM, which leaves most of an SM's warp slots empty while each program waits on
its row's loads; more programs keep more bytes in flight at the cost of more partial rows to
sum, and which wins depends on the chip and the shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch
import triton
import triton.language as tl

from plait.plugins.kernels_triton.launch import (
    backward_programs,
    default_row_warps,
    row_block_size,
)
from plait.plugins.kernels_triton.tuning import Tile, TileTuner, power_of_two_class, tile


@triton.jit
def _rms_norm_fwd(
    x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * stride_y + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
    stride_dy, stride_x, stride_dx, n_rows, n_cols, BLOCK: tl.constexpr,
):  # fmt: skip
    # int64 row indices: rows × stride can pass 2**31 elements for long sequences.
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        wdy = w * dy
        # d/dx of x·rstd·w: the rstd term contributes -x_hat·mean(wdy·x_hat).
        dx = rstd * (wdy - x_hat * (tl.sum(wdy * x_hat, axis=0) / n_cols))
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw = dw + dy * x_hat
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)


@triton.jit
def _layer_norm_fwd(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, stride_x, stride_y, n_cols, eps,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    y = centered * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, db_partial_ptr,
    stride_dy, stride_x, stride_dx, n_rows, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # int64 row indices: rows × stride can pass 2**31 elements for long sequences.
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        wdy = w * dy
        mean_wdy_xhat = tl.sum(wdy * x_hat, axis=0) / n_cols
        mean_wdy = tl.sum(wdy, axis=0) / n_cols
        dx = (wdy - (x_hat * mean_wdy_xhat + mean_wdy)) * rstd
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw = dw + dy * x_hat
        db = db + dy
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(db_partial_ptr + pid * n_cols + cols, db, mask=mask)


WARPS = (4, 8, 16, 32)
PROGRAMS_PER_SM = (1, 2, 4, 8)
# Triton's own default pipelining depth on NVIDIA GPUs, which these kernels were written for.
STAGES = 3


def _forward_tuner(kernel: str) -> TileTuner:
    return TileTuner(kernel, [tile(w, STAGES) for w in WARPS], default=tile(4, STAGES))


def _backward_tuner(kernel: str) -> TileTuner:
    candidates = [
        tile(w, STAGES, host={"programs_per_sm": p}) for w in WARPS for p in PROGRAMS_PER_SM
    ]
    return TileTuner(kernel, candidates, default=candidates[0])


RMS_NORM_FORWARD_TILES = _forward_tuner("rms_norm.forward")
RMS_NORM_BACKWARD_TILES = _backward_tuner("rms_norm.backward")
LAYER_NORM_FORWARD_TILES = _forward_tuner("layer_norm.forward")
LAYER_NORM_BACKWARD_TILES = _backward_tuner("layer_norm.backward")


@functools.cache
def _row_candidates(block: int, backward: bool) -> tuple[tuple[Tile, ...], Tile]:
    """(the tiles tried, the default) for rows of `block` elements: the Apex/Liger warps and
    their neighbours, each thread holding at least one element of the row; backward, each with
    every count of programs per SM."""
    default_warps = default_row_warps(block)
    tried = (default_warps // 2, default_warps, default_warps * 2)
    warps = [w for w in WARPS if w in tried and (w == default_warps or w * 32 <= block)]
    if not backward:
        return tuple(tile(w, STAGES) for w in warps), tile(default_warps, STAGES)
    among = tuple(
        tile(w, STAGES, host={"programs_per_sm": p}) for w in warps for p in PROGRAMS_PER_SM
    )
    return among, tile(default_warps, STAGES, host={"programs_per_sm": 1})


def _row_tile(
    tuner: TileTuner,
    rows: torch.Tensor,
    block: int,
    launch: Callable[[Tile], object],
    *,
    backward: bool,
    variant: Hashable = None,
) -> Tile:
    """The tile for a row kernel over `rows` (hidden padded to `block`): the problem is the
    dtype, the row width, the row count's class and the kernel's `variant` (LayerNorm's bias)."""
    among, default = _row_candidates(block, backward)
    dtype = str(rows.dtype).removeprefix("torch.")
    key = (dtype, block, power_of_two_class(rows.shape[0]), variant)
    return tuner.choose(key, launch, rows.device, among=among, default=default)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """View `x` as (rows, hidden) with a unit stride along hidden, copying only if needed."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y of `x`'s shape, rstd (rows,) in fp32 for the backward."""
    rows = _as_rows(x)
    n_rows, n_cols = rows.shape
    y = torch.empty_like(rows, memory_format=torch.contiguous_format)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = row_block_size(n_cols, x.element_size())

    def launch(chosen: Tile) -> None:
        _rms_norm_fwd[(n_rows,)](
            rows, weight, y, rstd, rows.stride(0), y.stride(0), n_cols, eps, BLOCK=block,
            **chosen.launch_options(),
        )  # fmt: skip

    if n_rows:
        launch(_row_tile(RMS_NORM_FORWARD_TILES, rows, block, launch, backward=False))
    return y.view(x.shape), rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of `rms_norm_forward`."""
    rows = _as_rows(x)
    n_rows, n_cols = rows.shape
    dy_rows = _as_rows(dy)
    dx = torch.empty_like(rows, memory_format=torch.contiguous_format)
    block = row_block_size(n_cols, rows.element_size())

    def launch(chosen: Tile) -> torch.Tensor:
        per_sm = chosen.host_setting("programs_per_sm", 1)
        programs = backward_programs(n_rows, rows.device, per_sm)
        dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=rows.device)
        _rms_norm_bwd[(programs,)](
            dy_rows, rows, weight, rstd, dx, dw_partial,
            dy_rows.stride(0), rows.stride(0), dx.stride(0), n_rows, n_cols,
            BLOCK=block, **chosen.launch_options(),
        )  # fmt: skip
        return dw_partial

    if not n_rows:
        return dx.view(x.shape), torch.zeros_like(weight)
    dw_partial = launch(_row_tile(RMS_NORM_BACKWARD_TILES, rows, block, launch, backward=True))
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)


def layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): y of `x`'s shape, the row statistics (rows,) in fp32."""
    rows = _as_rows(x)
    n_rows, n_cols = rows.shape
    y = torch.empty_like(rows, memory_format=torch.contiguous_format)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = row_block_size(n_cols, x.element_size())

    def launch(chosen: Tile) -> None:
        _layer_norm_fwd[(n_rows,)](
            rows, weight, bias if bias is not None else weight, y, mean, rstd,
            rows.stride(0), y.stride(0), n_cols, eps,
            HAS_BIAS=bias is not None, BLOCK=block, **chosen.launch_options(),
        )  # fmt: skip

    if n_rows:
        tuner = LAYER_NORM_FORWARD_TILES
        launch(_row_tile(tuner, rows, block, launch, backward=False, variant=bias is not None))
    return y.view(x.shape), mean, rstd


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx, dweight, dbias) of `layer_norm_forward`; dbias None without a bias."""
    rows = _as_rows(x)
    n_rows, n_cols = rows.shape
    dy_rows = _as_rows(dy)
    dx = torch.empty_like(rows, memory_format=torch.contiguous_format)
    block = row_block_size(n_cols, rows.element_size())

    def launch(chosen: Tile) -> tuple[torch.Tensor, torch.Tensor]:
        per_sm = chosen.host_setting("programs_per_sm", 1)
        programs = backward_programs(n_rows, rows.device, per_sm)
        dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=rows.device)
        db_partial = torch.empty_like(dw_partial) if bias is not None else dw_partial
        _layer_norm_bwd[(programs,)](
            dy_rows, rows, weight, mean, rstd, dx, dw_partial, db_partial,
            dy_rows.stride(0), rows.stride(0), dx.stride(0), n_rows, n_cols,
            HAS_BIAS=bias is not None, BLOCK=block, **chosen.launch_options(),
        )  # fmt: skip
        return dw_partial, db_partial

    if not n_rows:
        db = torch.zeros_like(bias) if bias is not None else None
        return dx.view(x.shape), torch.zeros_like(weight), db
    tuner = LAYER_NORM_BACKWARD_TILES
    chosen = _row_tile(tuner, rows, block, launch, backward=True, variant=bias is not None)
    dw_partial, db_partial = launch(chosen)
    dw = dw_partial.sum(0).to(weight.dtype)
    db = db_partial.sum(0).to(bias.dtype) if bias is not None else None
    return dx.view(x.shape), dw, db


class RMSNormFunction(torch.autograd.Function):
    """y = x / sqrt(mean(x²) + eps) · weight, over the last dimension."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*rms_norm_backward(dy, *ctx.saved_tensors), None)


class LayerNormFunction(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) · weight + bias, over the last dimension."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        y, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*layer_norm_backward(dy, *ctx.saved_tensors), None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape)."""
    return RMSNormFunction.apply(x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension of `x`; `bias` may be `None`."""
    return LayerNormFunction.apply(x, weight, bias, eps)

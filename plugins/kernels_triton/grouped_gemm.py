"""Triton grouped GEMM over variable-sized row groups (`grouped_mm`, the experts of a MoE layer).

`grouped_mm(x, weight, counts)`: `x` (N, K) is row groups of sizes `counts` (G,); `weight`
(G, M, K); group g's rows of the output (N, M) are `x_g @ weight[g].T`. Same contract as the
torch reference (`plait.plugins.kernels_torch.grouped_gemm`).

Two kernels, one launch each:

- `_rows_kernel` computes `out_g = a_g @ b_g` for every group: the host cuts each group's rows
  into tiles of `BLOCK_ROWS` and hands the kernel a (tile → group, first row) table, so a program
  never straddles two groups and no program is spent on an empty one. The forward
  (`b_g = weight[g].T`) and the input gradient (`b_g = weight[g]`, reducing over M) are the same
  kernel with `b`'s strides swapped.
- `_weight_grad_kernel` computes `dweight[g] = dy_g.T @ x_g`: one program per (group, M tile,
  K tile) looping over the group's rows, a reduction whose length varies by group; empty
  groups store zeros.

Accumulation is fp32; the output takes the input's dtype. Each kernel's tile (rows, columns and
reduction block, warps, stages) comes from its `TileTuner`, timed per GPU model (`tuning.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from plait.plugins.kernels_triton.launch import dot_precision
from plait.plugins.kernels_triton.tuning import Tile, TileTuner, power_of_two_class, tile


@triton.jit
def _rows_kernel(
    a_ptr, b_ptr, out_ptr, tile_group_ptr, tile_start_ptr, group_end_ptr,
    n_cols, n_reduce,
    stride_a_row, stride_a_red,
    stride_b_group, stride_b_red, stride_b_col,
    stride_out_row, stride_out_col,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_REDUCE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    group = tl.load(tile_group_ptr + tile)
    row_start = tl.load(tile_start_ptr + tile)
    row_end = tl.load(group_end_ptr + group)
    rows = row_start + tl.arange(0, BLOCK_ROWS)
    cols = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_ok = rows < row_end
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    b_group = b_ptr + group.to(tl.int64) * stride_b_group
    for red_start in range(0, n_reduce, BLOCK_REDUCE):
        red = red_start + tl.arange(0, BLOCK_REDUCE)
        red_ok = red < n_reduce
        a = tl.load(
            a_ptr + rows[:, None] * stride_a_row + red[None, :] * stride_a_red,
            mask=row_ok[:, None] & red_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_group + red[:, None] * stride_b_red + cols[None, :] * stride_b_col,
            mask=red_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision=PRECISION)
    tl.store(
        out_ptr + rows[:, None] * stride_out_row + cols[None, :] * stride_out_col,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _weight_grad_kernel(
    dy_ptr, x_ptr, dw_ptr, group_start_ptr,
    n_out, n_in,
    stride_dy_row, stride_dy_col, stride_x_row, stride_x_col,
    stride_dw_group, stride_dw_out, stride_dw_in,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_REDUCE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0)
    out_block = tl.program_id(1)
    in_block = tl.program_id(2)
    start = tl.load(group_start_ptr + group)
    end = tl.load(group_start_ptr + group + 1)
    outs = out_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    ins = in_block * BLOCK_REDUCE + tl.arange(0, BLOCK_REDUCE)
    out_ok = outs < n_out
    in_ok = ins < n_in
    acc = tl.zeros((BLOCK_COLS, BLOCK_REDUCE), dtype=tl.float32)
    for row_start in range(start, end, BLOCK_ROWS):
        rows = row_start + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < end
        dy_t = tl.load(
            dy_ptr + rows[None, :] * stride_dy_row + outs[:, None] * stride_dy_col,
            mask=out_ok[:, None] & row_ok[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + rows[:, None] * stride_x_row + ins[None, :] * stride_x_col,
            mask=row_ok[:, None] & in_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(dy_t, x, input_precision=PRECISION)
    dw = dw_ptr + group.to(tl.int64) * stride_dw_group
    tl.store(
        dw + outs[:, None] * stride_dw_out + ins[None, :] * stride_dw_in,
        acc.to(dw_ptr.dtype.element_ty),
        mask=out_ok[:, None] & in_ok[None, :],
    )


# The default is the 32×32×32 tile; the candidates grow each dimension towards what a GPU's
# matrix units want (dot tiles of 64-128) where the groups hold enough rows to fill them.
DEFAULT_TILE = tile(4, 3, BLOCK_ROWS=32, BLOCK_COLS=32, BLOCK_REDUCE=32)
ROWS_TILES = TileTuner(
    "grouped_mm.rows",
    (
        DEFAULT_TILE,
        tile(4, 3, BLOCK_ROWS=64, BLOCK_COLS=64, BLOCK_REDUCE=32),
        tile(4, 3, BLOCK_ROWS=64, BLOCK_COLS=128, BLOCK_REDUCE=32),
        tile(8, 3, BLOCK_ROWS=128, BLOCK_COLS=128, BLOCK_REDUCE=32),
        tile(4, 4, BLOCK_ROWS=128, BLOCK_COLS=64, BLOCK_REDUCE=64),
        tile(8, 4, BLOCK_ROWS=64, BLOCK_COLS=128, BLOCK_REDUCE=64),
    ),
    default=DEFAULT_TILE,
)
WEIGHT_GRAD_TILES = TileTuner(
    "grouped_mm.weight_grad",
    (
        DEFAULT_TILE,
        tile(4, 3, BLOCK_ROWS=32, BLOCK_COLS=64, BLOCK_REDUCE=64),
        tile(8, 3, BLOCK_ROWS=32, BLOCK_COLS=128, BLOCK_REDUCE=64),
        tile(8, 3, BLOCK_ROWS=64, BLOCK_COLS=128, BLOCK_REDUCE=128),
        tile(4, 4, BLOCK_ROWS=64, BLOCK_COLS=64, BLOCK_REDUCE=128),
    ),
    default=DEFAULT_TILE,
)


def _row_tiles(sizes: list[int], block_rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(tile → group, tile → first row, group → end row) for tiles of `block_rows` rows."""
    ends, groups, starts, offset = [], [], [], 0
    for group, size in enumerate(sizes):
        for start in range(offset, offset + size, block_rows):
            groups.append(group)
            starts.append(start)
        offset += size
        ends.append(offset)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return as_tensor(groups), as_tensor(starts), as_tensor(ends)


def _rows_per_group(sizes: list[int]) -> int:
    return power_of_two_class(sum(sizes) // max(len(sizes), 1))


def _grouped_rows(
    a: torch.Tensor, b: torch.Tensor, sizes: list[int], *, transpose_b: bool
) -> torch.Tensor:
    """`a_g @ b[g].T` (`transpose_b`) or `a_g @ b[g]` per row group."""
    n_cols = b.shape[1] if transpose_b else b.shape[2]
    n_reduce = a.shape[1]
    out = torch.empty(a.shape[0], n_cols, dtype=a.dtype, device=a.device)
    if sum(sizes) == 0 or n_cols == 0:
        return out.zero_()
    stride_red, stride_col = (b.stride(2), b.stride(1)) if transpose_b else b.stride()[1:]
    tables: dict[int, tuple[torch.Tensor, ...]] = {}  # rows per tile -> its tile table

    def launch(chosen: Tile) -> None:
        rows = chosen["BLOCK_ROWS"]
        if rows not in tables:
            tables[rows] = _row_tiles(sizes, rows, a.device)
        tile_group, tile_start, group_end = tables[rows]
        grid = (tile_group.numel(), triton.cdiv(n_cols, chosen["BLOCK_COLS"]))
        _rows_kernel[grid](
            a, b, out, tile_group, tile_start, group_end,
            n_cols, n_reduce,
            a.stride(0), a.stride(1),
            b.stride(0), stride_red, stride_col,
            out.stride(0), out.stride(1),
            PRECISION=dot_precision(a.dtype), **chosen.launch_options(),
        )  # fmt: skip

    problem = (str(a.dtype).removeprefix("torch."), n_cols, n_reduce, transpose_b,
               _rows_per_group(sizes))  # fmt: skip
    launch(ROWS_TILES.choose(problem, launch, a.device))
    return out


def _weight_grad(dy: torch.Tensor, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    groups = len(sizes)
    n_out, n_in = dy.shape[1], x.shape[1]
    dw = torch.empty(groups, n_out, n_in, dtype=x.dtype, device=x.device)
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    group_start = torch.tensor(starts, dtype=torch.int32, device=x.device)

    def launch(chosen: Tile) -> None:
        grid = (
            groups,
            triton.cdiv(n_out, chosen["BLOCK_COLS"]),
            triton.cdiv(n_in, chosen["BLOCK_REDUCE"]),
        )
        _weight_grad_kernel[grid](
            dy, x, dw, group_start,
            n_out, n_in,
            dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
            dw.stride(0), dw.stride(1), dw.stride(2),
            PRECISION=dot_precision(x.dtype), **chosen.launch_options(),
        )  # fmt: skip

    problem = (str(x.dtype).removeprefix("torch."), n_out, n_in, _rows_per_group(sizes))
    launch(WEIGHT_GRAD_TILES.choose(problem, launch, x.device))
    return dw


class GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        sizes = [int(size) for size in counts.tolist()]  # the one host sync: tiles per group
        ctx.save_for_backward(x, weight)
        ctx.sizes = sizes
        return _grouped_rows(x, weight, sizes, transpose_b=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        dx = _grouped_rows(grad, weight, ctx.sizes, transpose_b=False)
        dw = _weight_grad(grad, x, ctx.sizes)
        return dx, dw, None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-group `x_g @ weight[g].T` over consecutive row groups of sizes `counts`."""
    if counts.numel() != weight.shape[0]:
        raise ValueError(f"{counts.numel()} group sizes for {weight.shape[0]} weight matrices")
    if x.shape[1] != weight.shape[2]:
        raise ValueError(f"x has {x.shape[1]} columns, the weights take {weight.shape[2]}")
    return GroupedMatmul.apply(x, weight, counts)

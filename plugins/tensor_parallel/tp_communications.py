"""Autograd-aware collectives of tensor and sequence parallelism (Megatron-LM's f and g operators).

Each operator is a `torch.autograd.Function` whose forward and backward are the two halves of a
conjugate pair of collectives over the tensor-parallel group, issued through `plait.core.comm`
(so algorithm plugins and telemetry see them like any other op):

| operator                            | forward          | backward         |
|-------------------------------------|------------------|------------------|
| `copy_to_tensor_region` (f)         | identity         | all-reduce       |
| `reduce_from_tensor_region` (g)     | all-reduce       | identity         |
| `gather_from_sequence_region`       | all-gather (seq) | reduce-scatter   |
| `reduce_scatter_to_sequence_region` | reduce-scatter   | all-gather (seq) |
| `scatter_to_sequence_region`        | split (seq)      | all-gather (seq) |
| `gather_from_tensor_region`         | all-gather (dim) | split (dim)      |

References: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" (2019), section 3 and figure 3 (the f/g operators); Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022), section 4.2.2 and
figure 5 (sequence parallelism: g becomes reduce-scatter, f becomes all-gather, and their
conjugates swap in backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from plait.core.comm import Comm, Group

PURPOSE = "tp_activation"
# The operators run eagerly under `torch.compile`: a compiled block breaks its graph at each of
# them (Dynamo counts the breaks) instead of tracing the communicator, whose per-group sequence
# numbers would be guarded on and recompile the block at every step.
eager_under_compile = torch.compiler.disable


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """The tensor-parallel group, this rank's index in it, and the facade that reaches it."""

    comm: Comm
    group: Group
    rank: int

    @property
    def size(self) -> int:
        return self.group.size

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce a fresh contiguous copy of `tensor` (autograd may hold the original)."""
        out = tensor.contiguous().clone()
        if self.size > 1:
            self.comm.all_reduce(out, group=self.group, op=op, purpose=PURPOSE)
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in group order."""
        if self.size == 1:
            return tensor
        front = tensor.movedim(dim, 0).contiguous()
        out = front.new_empty((front.shape[0] * self.size, *front.shape[1:]))
        self.comm.all_gather(out, front, group=self.group, purpose=PURPOSE)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over ranks, keep this rank's 1/size chunk along `dim`."""
        if self.size == 1:
            return tensor
        length = tensor.shape[dim]
        if length % self.size:
            raise ValueError(
                f"cannot reduce-scatter dim {dim} of length {length} over {self.size} "
                "tensor-parallel ranks: the length must be a multiple of the TP degree"
            )
        front = tensor.movedim(dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // self.size, *front.shape[1:]))
        self.comm.reduce_scatter(out, front, group=self.group, purpose=PURPOSE)
        return out.movedim(0, dim).contiguous()

    def split(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunk of `tensor` along `dim` (no communication)."""
        if self.size == 1:
            return tensor
        length = tensor.shape[dim]
        if length % self.size:
            raise ValueError(
                f"cannot split dim {dim} of length {length} over {self.size} tensor-parallel "
                "ranks: the length must be a multiple of the TP degree"
            )
        return tensor.chunk(self.size, dim=dim)[self.rank].contiguous()


class _CopyToTensorRegion(torch.autograd.Function):
    """Megatron's f: the input of a column-parallel layer is used whole on every rank, so its
    gradient is the sum of every rank's partial gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.all_reduce(grad), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """Megatron's g: the partial outputs of a row-parallel layer are summed; the gradient of a
    sum reaches every summand unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Sequence parallelism's f: sequence shards are all-gathered before a column-parallel layer;
    backward reduce-scatters (sums the ranks' partial gradients, keeps this rank's shard)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return tp.all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.reduce_scatter(grad, ctx.dim), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Sequence parallelism's g: a row-parallel layer's partial outputs are reduce-scattered into
    sequence shards; backward all-gathers the shards' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return tp.reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.all_gather(grad, ctx.dim), None, None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Enter the sequence-parallel region from a replicated tensor: keep this rank's shard;
    backward all-gathers (each rank's gradient covers only its own shard)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return tp.split(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.all_gather(grad, ctx.dim), None, None


class _GatherFromTensorRegion(torch.autograd.Function):
    """Megatron's `gather_output`: concatenate column-parallel outputs along their sharded dim;
    backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return tp.all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.split(grad, ctx.dim), None, None


@eager_under_compile
def copy_to_tensor_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """f (Megatron-LM, Shoeybi et al. 2019): identity forward, all-reduce backward."""
    return _CopyToTensorRegion.apply(x, tp) if tp.size > 1 else x


@eager_under_compile
def reduce_from_tensor_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """g (Megatron-LM, Shoeybi et al. 2019): all-reduce forward, identity backward."""
    return _ReduceFromTensorRegion.apply(x, tp) if tp.size > 1 else x


@eager_under_compile
def gather_from_sequence_region(
    x: torch.Tensor, tp: TensorParallelGroup, dim: int = 1
) -> torch.Tensor:
    """Sequence-parallel f (Korthikanti et al. 2022): all-gather along the sequence `dim`
    forward, reduce-scatter backward."""
    return _GatherFromSequenceRegion.apply(x, tp, dim) if tp.size > 1 else x


@eager_under_compile
def reduce_scatter_to_sequence_region(
    x: torch.Tensor, tp: TensorParallelGroup, dim: int = 1
) -> torch.Tensor:
    """Sequence-parallel g (Korthikanti et al. 2022): reduce-scatter along the sequence `dim`
    forward, all-gather backward."""
    return _ReduceScatterToSequenceRegion.apply(x, tp, dim) if tp.size > 1 else x


@eager_under_compile
def scatter_to_sequence_region(
    x: torch.Tensor, tp: TensorParallelGroup, dim: int = 1
) -> torch.Tensor:
    """Split a replicated tensor into sequence shards (Korthikanti et al. 2022): keep this
    rank's chunk forward, all-gather backward."""
    return _ScatterToSequenceRegion.apply(x, tp, dim) if tp.size > 1 else x


@eager_under_compile
def gather_from_tensor_region(
    x: torch.Tensor, tp: TensorParallelGroup, dim: int = -1
) -> torch.Tensor:
    """Megatron-LM's column-parallel `gather_output` (Shoeybi et al. 2019): all-gather along
    the sharded `dim` forward, keep this rank's slice backward."""
    return _GatherFromTensorRegion.apply(x, tp, dim) if tp.size > 1 else x

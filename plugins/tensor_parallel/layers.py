"""Megatron-style parallel layers: column- and row-parallel linears, vocab-parallel embedding.

Each layer is built from the full, materialised module (`from_linear` / `from_embedding`) by
slicing this tensor-parallel rank's rows or columns, so its values equal the single-process
model's. Sharded parameters are marked for the global gradient norm (`mark_sharded(p, ("tp",))`)
and carry `TP_DIM_ATTR`, the tensor dim they are split along (checkpoint tools and tests use it
to reassemble full tensors).

Activations: the input of a column-parallel layer is replicated (or, under sequence parallelism,
sequence-sharded and all-gathered first); its output is split along the features. A row-parallel
layer takes feature-split input and produces partial sums, all-reduced (or reduce-scattered into
sequence shards). See `tp_communications` for the operators and the papers they come from.
"""

from __future__ import annotations

import weakref
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from plait.core.grad_norm import mark_sharded
from plait.core.transforms import TP_DIM_ATTR, TP_PARTS_ATTR
from plait.plugins.tensor_parallel.tp_communications import (
    TensorParallelGroup,
    copy_to_tensor_region,
    eager_under_compile,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
)

# Activations are (batch, seq, features): the sequence dim sequence parallelism splits.
SEQUENCE_DIM = 1

InputMode = Literal["copy", "gather_sequence", "region"]
OutputMode = Literal["all_reduce", "reduce_scatter_sequence"]


def shard_parameter(
    tensor: torch.Tensor, dim: int, index: slice, *, parts: int = 1
) -> nn.Parameter:
    """A new parameter holding `tensor[index]` along `dim`, marked as a tp shard.

    With `parts > 1` the tensor is `parts` equal pieces along `dim` (a fused projection) and
    `index` is this rank's slice of one piece: the shard concatenates that slice of each piece.
    """
    source = tensor.detach()
    part_length = source.shape[dim] // parts
    pieces = [
        source.narrow(dim, part * part_length + index.start, index.stop - index.start)
        for part in range(parts)
    ]
    piece = torch.cat(pieces, dim) if parts > 1 else pieces[0].clone()
    param = nn.Parameter(piece, requires_grad=tensor.requires_grad)
    mark_sharded(param, ("tp",))
    setattr(param, TP_DIM_ATTR, dim)
    if parts > 1:
        setattr(param, TP_PARTS_ATTR, parts)
    return param


def even_slice(length: int, tp: TensorParallelGroup) -> slice:
    """This rank's contiguous 1/size of `length` (callers check divisibility first)."""
    per_rank = length // tp.size
    return slice(tp.rank * per_rank, (tp.rank + 1) * per_rank)


def output_dim(module: nn.Module) -> int | None:
    """The weight dim holding the output features of a linear map, or `None` if `module` is not
    one: 0 for `nn.Linear` (`y = x Wᵀ + b`), 1 for `transformers`' `Conv1D` (GPT-2's layers,
    `y = x W + b` with `W` stored in × out). Shards keep the source layout, so a checkpoint
    of a tensor-parallel run holds the tensors a `transformers` model loads."""
    if isinstance(module, nn.Linear):
        return 0
    weight = getattr(module, "weight", None)
    if (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and getattr(module, "nf", None) == weight.shape[1]
    ):
        return 1
    return None


def features(module: nn.Module) -> tuple[int, int]:
    """(input, output) features of a linear map `output_dim` recognises."""
    weight = module.weight
    out_dim = output_dim(module)
    assert out_dim is not None and isinstance(weight, torch.Tensor)
    return weight.shape[1 - out_dim], weight.shape[out_dim]


def _as_linear_weight(weight: torch.Tensor, out_dim: int) -> torch.Tensor:
    """The weight as `F.linear` takes it (out × in): a transpose view for a `Conv1D` layout."""
    return weight if out_dim == 0 else weight.t()


class SequenceShard:
    """A sequence shard all-gathered for column-parallel layers, saved as the shard only.

    Sequence parallelism's activation saving (Korthikanti et al. 2022, section 4.2.2): a
    column-parallel layer keeps this rank's sequence shard for backward, not the gathered input,
    and all-gathers it again when the weight gradient needs it — once for all the layers that
    shared the input (q, k and v), freed after the last of them.
    """

    def __init__(self, tp: TensorParallelGroup, shard: torch.Tensor, gathered: torch.Tensor):
        self.tp = tp
        self.shard: torch.Tensor | None = shard  # held during forward only
        self._gathered = weakref.ref(gathered)
        self._regathered: torch.Tensor | None = None
        self._pending_backward = 0

    def holds(self, x: torch.Tensor) -> bool:
        return self.shard is not None and self._gathered() is x

    def use(self) -> torch.Tensor:
        assert self.shard is not None
        self._pending_backward += 1
        return self.shard

    def regather(self, shard: torch.Tensor) -> torch.Tensor:
        if self._regathered is None:
            self._regathered = self.tp.all_gather(shard, SEQUENCE_DIM)
        gathered = self._regathered
        self._pending_backward -= 1
        if self._pending_backward == 0:
            self._regathered = None
        return gathered


class _LinearSavingSequenceShard(torch.autograd.Function):
    """`F.linear` on a gathered input that saves the sequence shard instead of the input."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        shard: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        source: SequenceShard,
    ) -> torch.Tensor:
        ctx.save_for_backward(shard, weight)
        ctx.source, ctx.has_bias = source, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        shard, weight = ctx.saved_tensors
        x = ctx.source.regather(shard)
        grad_x = grad @ weight
        grad_weight = grad.flatten(0, -2).t() @ x.flatten(0, -2)
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, None, grad_weight, grad_bias, None


@eager_under_compile  # counts the layers that will regather the shard: state Dynamo cannot keep
def _linear_saving_sequence_shard(
    x: torch.Tensor, source: SequenceShard, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _LinearSavingSequenceShard.apply(x, source.use(), weight, bias, source)


def gather_sequence_shard(x: torch.Tensor, tp: TensorParallelGroup) -> tuple[torch.Tensor, Any]:
    """All-gather sequence shards (autograd-aware) and the `SequenceShard` that remembers them."""
    gathered = gather_from_sequence_region(x, tp, SEQUENCE_DIM)
    return gathered, SequenceShard(tp, x, gathered) if tp.size > 1 else None


class ColumnParallelLinear(nn.Module):
    """`y = x Aᵀ + b` with `A`'s output rows (and `b`) split across tp ranks.

    `input_mode`: "copy" applies f (identity / all-reduce of the input gradient); under sequence
    parallelism "gather_sequence" all-gathers the sequence shards first; "region" means an
    enclosing module already did either for all its column-parallel children (one collective
    for q, k and v instead of three). `gather_output` concatenates the ranks' outputs (Megatron's
    option for a head whose loss needs full logits); otherwise the output stays split.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        *,
        tp: TensorParallelGroup,
        input_mode: InputMode = "copy",
        gather_output: bool = False,
        out_dim: int = 0,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = weight
        self.bias = bias
        self.input_mode: InputMode = input_mode
        self.gather_output = gather_output
        self.out_dim = out_dim
        self.in_features = weight.shape[1 - out_dim]
        self.out_features = weight.shape[out_dim]
        # Set by the enclosing region while it runs under sequence parallelism.
        self.sequence_source: SequenceShard | None = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        *,
        tp: TensorParallelGroup,
        rows: slice | None = None,
        parts: int = 1,
    ) -> ColumnParallelLinear:
        """This rank's output rows of an `nn.Linear` or `Conv1D`; `parts > 1` for a fused
        projection whose output features are `parts` equal blocks, each split across ranks."""
        out_dim = output_dim(linear)
        assert out_dim is not None
        _, out_features = features(linear)
        rows = rows or even_slice(out_features // parts, tp)
        weight = shard_parameter(linear.weight, out_dim, rows, parts=parts)
        bias = linear.bias
        bias = shard_parameter(bias, 0, rows, parts=parts) if bias is not None else None
        return cls(weight, bias, tp=tp, out_dim=out_dim)

    def layer_input(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as the local product takes it, after the input mode's collective: the input of a
        computation beside this layer's (a LoRA adapter's) whose input gradient must be summed
        over the ranks as the layer's is. Outside a region the collective runs a second time."""
        if self.input_mode == "copy":
            return copy_to_tensor_region(x, self.tp)
        if self.input_mode == "gather_sequence":
            return gather_sequence_shard(x, self.tp)[0]
        return x

    def local_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`F.linear` after the input mode's collective; under sequence parallelism the saved
        activation is the sequence shard (see `SequenceShard`)."""
        source = self.sequence_source
        if self.input_mode == "copy":
            x = copy_to_tensor_region(x, self.tp)
        elif self.input_mode == "gather_sequence":
            x, source = gather_sequence_shard(x, self.tp)
        if source is not None and source.holds(x) and torch.is_grad_enabled():
            return _linear_saving_sequence_shard(x, source, weight, bias)
        return F.linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.local_linear(x, _as_linear_weight(self.weight, self.out_dim), self.bias)
        return gather_from_tensor_region(out, self.tp, -1) if self.gather_output else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local), "
            f"tp={self.tp.size}, input_mode={self.input_mode}, gather_output={self.gather_output}"
        )


class ReplicatedHeadsLinear(ColumnParallelLinear):
    """A key/value projection when the TP degree exceeds the KV head count (grouped-query
    attention): every rank keeps the full weight and uses only the rows of the KV heads its
    query heads map to. The weight is replicated, so its partial gradients (each rank back-props
    only its own heads) are summed over tp by the runtime, not marked as a shard."""

    def __init__(
        self, linear: nn.Linear, *, tp: TensorParallelGroup, rows: slice, input_mode: InputMode
    ) -> None:
        super().__init__(linear.weight, linear.bias, tp=tp, input_mode=input_mode)
        self.rows = rows
        self.out_features = rows.stop - rows.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias[self.rows] if self.bias is not None else None
        return self.local_linear(x, self.weight[self.rows], bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, replicated rows={self.rows.start}:{self.rows.stop}"


class RowParallelLinear(nn.Module):
    """`y = x Aᵀ + b` with `A`'s input columns split across tp ranks; `x` arrives split along its
    features (the output of a column-parallel layer). The partial products are summed with g
    (all-reduce) or, under sequence parallelism, reduce-scattered into sequence shards; the
    replicated bias is added once, after the reduction."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        *,
        tp: TensorParallelGroup,
        output_mode: OutputMode = "all_reduce",
        out_dim: int = 0,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = weight
        self.bias = bias
        self.output_mode: OutputMode = output_mode
        self.out_dim = out_dim
        self.in_features = weight.shape[1 - out_dim]
        self.out_features = weight.shape[out_dim]

    @classmethod
    def from_linear(cls, linear: nn.Module, *, tp: TensorParallelGroup) -> RowParallelLinear:
        """This rank's input columns of an `nn.Linear` or `Conv1D`."""
        out_dim = output_dim(linear)
        assert out_dim is not None
        in_features, _ = features(linear)
        weight = shard_parameter(linear.weight, 1 - out_dim, even_slice(in_features, tp))
        bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        return cls(weight, bias, tp=tp, out_dim=out_dim)

    def forward(self, x: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
        """`addend`: this rank's partial output of a computation beside the layer (a LoRA
        adapter's `B·A_i·x_i`), summed over the ranks by the same reduction."""
        partial = F.linear(x, _as_linear_weight(self.weight, self.out_dim))
        if addend is not None:
            partial = partial + addend
        if self.output_mode == "reduce_scatter_sequence":
            out = reduce_scatter_to_sequence_region(partial, self.tp, SEQUENCE_DIM)
        else:
            out = reduce_from_tensor_region(partial, self.tp)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local), out_features={self.out_features}, "
            f"tp={self.tp.size}, output_mode={self.output_mode}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: each rank looks up the tokens in its range,
    writes zeros for the others, and the ranks' partial embeddings are summed (all-reduce, or a
    reduce-scatter into sequence shards under sequence parallelism)."""

    def __init__(
        self,
        weight: nn.Parameter,
        *,
        vocab_start: int,
        tp: TensorParallelGroup,
        output_mode: OutputMode = "all_reduce",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = weight
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.output_mode: OutputMode = output_mode

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, *, tp: TensorParallelGroup
    ) -> VocabParallelEmbedding:
        rows = even_slice(embedding.num_embeddings, tp)
        weight = shard_parameter(embedding.weight, 0, rows)
        return cls(weight, vocab_start=rows.start, tp=tp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.output_mode == "reduce_scatter_sequence":
            return reduce_scatter_to_sequence_region(partial, self.tp, SEQUENCE_DIM)
        return reduce_from_tensor_region(partial, self.tp)

    def extra_repr(self) -> str:
        return (
            f"vocab {self.vocab_start}:{self.vocab_end} of {self.weight.shape[0] * self.tp.size}, "
            f"dim={self.weight.shape[1]}, tp={self.tp.size}, output_mode={self.output_mode}"
        )

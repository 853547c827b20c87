"""What one shard transform establishes for the transforms and runtimes after it.

Each transform that others depend on writes one typed object on the `ShardContext` (the
pipeline split on `context.pipeline`, tensor/sequence parallelism on `context.tensor_parallel`,
the precision policy on `context.precision`, activation checkpointing on
`context.activation_checkpointing`, the context-parallel sequence layout on
`context.context_parallel`, the expert layout on `context.expert_parallel`). Later transforms
read the field; none of them imports the plugin that wrote it, and a third-party plugin can
provide the same fact the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from plait.core.comm import Group

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineStages:
    """The pipeline split: stage count, model chunks per rank, and a readable summary."""

    num_stages: int
    virtual_stages: int = 1
    summary: str = ""  # one line per chunk, for the banner of `plait train`
    # The whole model the stages were cut from, when they are stage modules around its own
    # modules rather than a copy of it (a user's or a `transformers` model): later transforms
    # reach its config and its attention implementation through it.
    source_model: Any = None


# Set by tensor parallelism on each parameter it holds a slice of: the dim the slice is cut
# along (this rank's contiguous 1/tp of it); and on a slice of a fused projection (GPT-2's
# `c_attn`: q | k | v along the output features) the number of equal parts, each cut across
# the ranks, that the slice concatenates. How a later transform finds a tensor's whole shape.
TP_DIM_ATTR = "_plait_tp_dim"
TP_PARTS_ATTR = "_plait_tp_parts"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelism:
    """Tensor (and sequence) parallelism as applied to the model."""

    degree: int
    # The residual stream between blocks holds this rank's 1/degree of every sequence, so a
    # tensor crossing a block boundary (a pipeline activation) has seq_len / degree positions.
    sequence_parallel: bool = False
    # The model's output is the vocabulary shard of the logits; the loss is vocab-parallel.
    vocab_parallel_output: bool = False
    # Every tensor-parallel linear by module name, and how it is split, for a later transform
    # that computes beside it (LoRA adapters): "column" (output features split; the layer's
    # `layer_input(x)` is its input after the entry collective), "row" (input features split;
    # `layer(x, addend=partial)` adds a partial output before the reduction), or a description
    # of a split no such transform takes (a fused q | k | v, gathered output, replicated KV heads,
    # a `Conv1D`). Both kinds carry their group as `layer.tp` (`rank`, `size`).
    linear_splits: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionPolicy:
    """The three dtypes of a mixed-precision run (cf. FSDP's `MixedPrecision`)."""

    compute_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @property
    def master_weights(self) -> bool:
        """True when the optimizer must step fp32 copies of low-precision parameters."""
        return self.param_dtype != torch.float32

    @property
    def autocast(self) -> bool:
        """True when parameters stay fp32 and the forward runs under `torch.autocast`."""
        return self.param_dtype == torch.float32 and self.compute_dtype != torch.float32

    @property
    def loss_scaling(self) -> bool:
        """fp16's 5-bit exponent underflows small gradients; bf16 has fp32's range."""
        return self.compute_dtype == torch.float16

    def describe(self) -> dict[str, str]:
        return {
            "compute_dtype": DTYPE_NAMES[self.compute_dtype],
            "param_dtype": DTYPE_NAMES[self.param_dtype],
            "reduce_dtype": DTYPE_NAMES[self.reduce_dtype],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationCheckpointing:
    """Which modules recompute their activations in backward, and how."""

    mode: str  # "full", "selective", …
    wrapped: tuple[str, ...] = ()  # qualified names of the checkpointed modules


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextParallelism:
    """Context parallelism as applied: which positions of every sequence this rank holds.

    The cp group is `ring_degree × ulysses_degree` ranks, Ulysses inside (consecutive cp
    coordinates), ring across. With a load-balanced layout the sequence is cut into
    `2 · ring_degree` chunks and ring position `j` holds chunks `j` and `2·ring_degree − 1 − j`
    (so causal attention costs every ring position the same); without it, chunk `j` of
    `ring_degree`. The Ulysses ranks of one ring position then split that portion into
    `ulysses_degree` contiguous pieces, so an all-to-all over them gives each the portion whole.
    The engine cuts every micro-batch with `shard_microbatch` (every tensor along the sequence
    dim, after `prepare` saw it whole); models take the global positions of their tokens from
    `positions`.
    """

    degree: int
    rank: int  # this rank's coordinate on the cp axis
    strategy: str
    ring_degree: int
    ulysses_degree: int = 1
    load_balanced: bool = True
    # What the model needs of a micro-batch that only the whole sequence shows, added before it
    # is cut: `prepare(inputs, targets, seq_len) -> (inputs, targets)`. A `transformers` causal
    # LM takes its labels shifted over the whole sequence (the label at a piece's last position
    # is the first token of the next piece), its position ids and its packed rows' documents.
    prepare: Callable[[Any, Any, int], tuple[Any, Any]] | None = None

    @property
    def ring_rank(self) -> int:
        return self.rank // self.ulysses_degree

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_degree

    @property
    def num_chunks(self) -> int:
        """Chunks the whole sequence is cut into for the ring."""
        return 2 * self.ring_degree if self.load_balanced else self.ring_degree

    def ring_chunks(self, ring_rank: int) -> tuple[int, ...]:
        """The global chunk ids ring position `ring_rank` holds, in sequence order."""
        if not self.load_balanced:
            return (ring_rank,)
        return (ring_rank, self.num_chunks - 1 - ring_rank)

    def check_length(self, seq_len: int) -> None:
        pieces = self.num_chunks * self.ulysses_degree
        if seq_len % pieces:
            raise ValueError(
                f"context parallelism ({self.strategy}, cp={self.degree}) cuts each sequence "
                f"into {pieces} equal pieces; a sequence of {seq_len} tokens does not divide: "
                f"use a data.seq_len that is a multiple of {pieces}"
            )

    def ring_positions(
        self, ring_rank: int, seq_len: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The global positions (ascending) ring position `ring_rank` holds of a `seq_len`-token
        sequence, its Ulysses ranks together: what each of them holds after the all-to-all."""
        self.check_length(seq_len)
        chunk = seq_len // self.num_chunks
        return torch.cat(
            [
                torch.arange(c * chunk, (c + 1) * chunk, device=device)
                for c in self.ring_chunks(ring_rank)
            ]
        )

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions (ascending) this rank holds of a `seq_len`-token sequence."""
        portion = self.ring_positions(self.ring_rank, seq_len, device)
        piece = portion.numel() // self.ulysses_degree
        return portion[self.ulysses_rank * piece : (self.ulysses_rank + 1) * piece]

    def local_positions(
        self, local_len: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """`positions` for a rank that holds `local_len` tokens of each sequence."""
        return self.positions(local_len * self.degree, device)

    def shard_microbatch(self, inputs: Any, targets: Any, seq_len: int) -> tuple[Any, Any]:
        """This rank's positions of a micro-batch's inputs and targets (`prepare` first)."""
        if self.prepare is not None:
            inputs, targets = self.prepare(inputs, targets, seq_len)
        return self.shard_batch(inputs, seq_len), self.shard_batch(targets, seq_len)

    def shard_batch(self, batch: Any, seq_len: int) -> Any:
        """`batch` with every tensor whose dim 1 has `seq_len` positions cut to this rank's."""
        index: dict[torch.device, torch.Tensor] = {}

        def take(tensor: Any) -> Any:
            if not isinstance(tensor, torch.Tensor) or tensor.ndim < 2:
                return tensor
            if tensor.shape[1] != seq_len:
                return tensor
            if tensor.device not in index:
                index[tensor.device] = self.positions(seq_len, tensor.device)
            return tensor.index_select(1, index[tensor.device])

        return tree_map(take, batch)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertParallelism:
    """Expert parallelism as applied: which experts this rank holds, and gradient groups.

    The ep group is carved out of dp (Megatron-Core's layout): `degree` consecutive dp
    coordinates hold disjoint slices of every MoE layer's experts and exchange tokens with
    all-to-all; the ranks that hold the *same* slice (dp / degree of them, strided) are the
    expert-data-parallel group. Expert parameters (named in `expert_parameters`, normalised
    names) have their gradients reduced over `expert_data_group`; every other parameter over the
    usual dp group. Data parallelism asks `gradient_group(name, default)` per parameter.
    """

    degree: int
    rank: int  # this rank's coordinate in the ep group
    num_experts: int  # per MoE layer, over all ep ranks
    group: Group
    expert_data_group: Group
    expert_parameters: frozenset[str]

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.degree

    @property
    def first_expert(self) -> int:
        """Global index of this rank's first expert."""
        return self.rank * self.local_experts

    def is_expert(self, name: str) -> bool:
        return name in self.expert_parameters

    def gradient_group(self, name: str, default: Group) -> Group:
        """The group parameter `name`'s gradient is averaged over (and ZeRO would shard)."""
        return self.expert_data_group if name in self.expert_parameters else default

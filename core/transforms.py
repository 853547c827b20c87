"""What one shard transform establishes for the transforms and runtimes after it.

Each transform that others depend on writes one typed object on the `ShardContext` (the
pipeline split on `context.pipeline`, tensor/sequence parallelism on `context.tensor_parallel`,
the precision policy on `context.precision`, activation checkpointing on
`context.activation_checkpointing`). Later transforms read the field; none of them imports
the plugin that wrote it, and a third-party plugin can provide the same fact the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelism:
    """Tensor (and sequence) parallelism as applied to the model."""

    degree: int
    # The residual stream between blocks holds this rank's 1/degree of every sequence, so a
    # tensor crossing a block boundary (a pipeline activation) has seq_len / degree positions.
    sequence_parallel: bool = False
    # The model's output is the vocabulary shard of the logits; the loss is vocab-parallel.
    vocab_parallel_output: bool = False


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

"""What `plait_shard` receives and returns, and the step callbacks a strategy leaves behind.

A strategy turns a module into its parallel form and returns `Sharded(module, runtime)`. The
`ParallelRuntime` is how the executor talks to the strategy during a step, without knowing which
strategy it is: before each backward, to sync gradients, to build the optimizer, to clip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from plait.core.comm import Comm
    from plait.core.config import PlaitConfig
    from plait.core.kernels import Kernels
    from plait.core.mesh import Mesh
    from plait.core.microbatch import MicrobatchRunner
    from plait.core.plugins import Plugins
    from plait.core.records import ModelRecord
    from plait.core.schedule import MicrobatchPosition
    from plait.core.state_layout import StateLayout
    from plait.core.step import PhaseSpan
    from plait.core.transforms import (
        ActivationCheckpointing,
        ContextParallelism,
        ExpertParallelism,
        PipelineStages,
        PrecisionPolicy,
        TensorParallelism,
    )

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
# How a transform that holds part of every sequence (context parallelism) cuts a micro-batch
# the engine split: (inputs, targets, sequence length) -> this rank's (inputs, targets).
MicrobatchCut = Callable[[Any, Any, int], tuple[Any, Any]]


@dataclass(kw_only=True)
class ShardContext:
    """Everything a strategy may need; built once per engine."""

    mesh: Mesh
    config: PlaitConfig
    comm: Comm
    kernels: Kernels
    plugins: Plugins
    device: torch.device
    model_record: ModelRecord | None = None
    model_config: Any = None
    # What earlier transforms established for later ones (`plait.core.transforms`); each is
    # written by the transform that owns it and `None` when that transform is not applied.
    pipeline: PipelineStages | None = None
    tensor_parallel: TensorParallelism | None = None
    precision: PrecisionPolicy | None = None
    activation_checkpointing: ActivationCheckpointing | None = None
    context_parallel: ContextParallelism | None = None
    expert_parallel: ExpertParallelism | None = None
    # What the engine applies to every micro-batch after splitting the batch, in order.
    microbatch_cuts: list[MicrobatchCut] = field(default_factory=list)


class ParallelRuntime:
    """Step callbacks of one applied strategy. Every method has a do-nothing default."""

    name: str = "runtime"
    # True when the runtime moves `.grad` out (and clears it) after every micro-batch's backward
    # instead of letting gradients accumulate in `.grad` (ZeRO-2/3): a hook that acts on the
    # accumulated gradient must then act on every micro-batch.
    gradients_consumed_each_microbatch: bool = False

    def action_handlers(self, step: StepState) -> dict[type, Callable[[Any], None]]:
        """Handlers to add or replace in the executor (e.g. pipeline send/recv), per step."""
        del step
        return {}

    def loss_fn(self) -> Callable[..., torch.Tensor] | None:
        """A replacement loss (e.g. vocab-parallel cross-entropy), or `None` for the default."""
        return None

    def before_forward(self, position: MicrobatchPosition) -> None:
        """Called before each micro-batch's forward (`position.first`: the chunk's first)."""

    def before_backward(self, position: MicrobatchPosition) -> None:
        """Called before each backward that produces weight gradients. `position.last` is the
        chunk's last one in the step (data parallelism reduces then), `position.first` its
        first (sharded accumulation starts then), whatever order the schedule runs them in."""

    def sync_gradients(self) -> None:
        """Make gradients final: wait for (or start) reductions."""

    def build_optimizer(
        self, module: nn.Module, factory: OptimizerFactory
    ) -> torch.optim.Optimizer | None:
        """Return a (sharded) optimizer, or `None` to let the next runtime or the core build it."""
        return None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Transform the loss before backward (fp16 loss scaling)."""
        return loss

    def skip_step(self) -> bool:
        """Called after gradient sync, before clipping; True skips this optimizer step on every
        rank (the runtime must decide identically on all ranks, e.g. an inf found anywhere)."""
        return False

    def clip_gradients(self, max_norm: float) -> torch.Tensor | None:
        """Compute the global gradient norm and clip, if this runtime owns the gradients (e.g.
        sharded ones); return the norm, or `None` to let the core do it over `module.parameters()`.
        `max_norm <= 0` means: report the norm, do not clip."""
        del max_norm
        return None

    def zero_grad(self) -> bool:
        """Zero gradients this runtime owns; return True if it handled all of them."""
        return False

    def after_optimizer_step(self) -> None:
        """Called after the optimizer stepped (e.g. to all-gather updated shards)."""

    def memory_report(self) -> dict[str, int] | None:
        """Bytes held in parameters / gradients / optimizer state on this rank, if known."""
        return None

    def state_layout(self, previous: StateLayout) -> StateLayout:
        """Declare how this runtime holds parameters and optimizer state (`core.state_layout`).

        `previous` is what the transforms applied before this one declared (the first runtime
        gets the module as it stands: every parameter whole under its original name, replicated
        over every mesh axis, optimizer state from `optimizer.state[param]`). Return it refined:
        rename to original names, place a slice in its global tensor, replace whole tensors by
        the shards this rank keeps, add what must run after a load. Checkpoints, resharding and
        weight export read only this description. The default changes nothing: right for a
        runtime that keeps the module's parameters, replicated, and the optimizer's state as is.
        """
        return previous

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


@dataclass(kw_only=True)
class StepState:
    """The data of one optimizer step, shared by the executor's handlers.

    A runtime that runs the compute itself (a pipeline stage) does it through `runner`, which
    calls every runtime's per-micro-batch callbacks and computes the loss exactly as the
    engine's own handlers do; spans it times inside its actions go to `extra_spans`.
    """

    inputs: list[Any]  # per micro-batch
    targets: list[Any]
    losses: list[torch.Tensor | None]
    num_microbatches: int
    runner: MicrobatchRunner
    extra_spans: list[PhaseSpan] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Sharded:
    """The result of `plait_shard`: the transformed module and its step callbacks."""

    module: nn.Module
    runtime: ParallelRuntime | None = None

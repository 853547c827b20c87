"""Frozen records that plugins return from registration hooks, and the requests hooks receive.

Registration hooks say *what* a plugin provides (a model family, a strategy for a mesh axis, a
schedule, a kernel); the decision hooks (`plait_shard`, `plait_schedule`, `plait_kernel`) are
then called with the configured name. Keeping the records plain data lets `plait plugins` list
everything and lets config errors name the alternatives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel
    from torch import nn

    from plait.core.kernels import Kernels

# The order in which the core applies shard transforms. A strategy registers for one of these.
SHARD_ORDER: tuple[str, ...] = (
    "pp",  # pipeline split into stages
    "tp",  # tensor / sequence parallel
    "cp",  # context parallel
    "ep",  # expert parallel
    "adapter",  # parameter-efficient fine-tuning: adapters added, the base frozen (LoRA)
    "precision",  # mixed-precision policy
    "ac",  # activation checkpointing
    "compile",  # torch.compile
    "dp",  # data parallel (DDP, ZeRO, FSDP)
)
ShardAxis = Literal["pp", "tp", "cp", "ep", "adapter", "precision", "ac", "compile", "dp"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRecord:
    """A model family: `build(config, kernels)` returns an `nn.Module` (built on the meta device
    by the engine, which then materialises it with `init_weights`).

    `flops_per_token(config, seq_len)` returns training FLOPs per token (forward + backward).
    """

    name: str
    config_cls: type[BaseModel]
    build: Callable[[Any, Kernels], nn.Module]
    flops_per_token: Callable[[Any, int], float]
    presets: Sequence[str] = ()
    # make_config(size, overrides) -> a validated config_cls instance (preset + overrides);
    # None means `config_cls(**overrides)`.
    make_config: Callable[[str, Mapping[str, Any]], Any] | None = None
    description: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategyRecord:
    """A parallelism strategy or model transform for one shard axis, selected by `name`."""

    name: str
    axis: ShardAxis
    config_cls: type[BaseModel] | None = None
    config_section: str = ""  # the config table for config_cls; "" means `name`
    description: str = ""
    # dp strategies: the collectives that carry gradients (purpose GRAD_BUCKET), so a
    # `comm.algorithm` that cannot take one of them over is refused instead of ignored.
    gradient_collectives: tuple[str, ...] = ("all_reduce",)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleRecord:
    """A step program: how micro-batches flow through forward, backward and the optimizer."""

    name: str
    pipelined: bool = False
    supports_virtual_stages: bool = False
    description: str = ""
    config_cls: type[BaseModel] | None = None  # validates the `[<config_section>]` table
    config_section: str = ""  # "" means `name`


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelRecord:
    """One op a kernel provider can answer, for the listed device types (e.g. "cpu", "cuda")."""

    op: str
    provider: str
    device_types: tuple[str, ...]
    description: str = ""
    config_cls: type[BaseModel] | None = None  # the provider's options, `[<config_section>]`
    config_section: str = ""  # "" means `provider`
    # How the op sits in a `torch.compile`d block: "custom op" (one opaque node the compiler
    # fuses around), "traced" (its torch code inlined and fused), "graph break"; "" unsaid.
    compiled_form: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigSectionRecord:
    """A config table a feature owns (not a strategy's, schedule's or kernel provider's, which
    their own records declare): `[<name>]`, validated by `config_cls`, whose defaults
    `plait config show` prints beside the core's sections."""

    name: str
    config_cls: type[BaseModel]
    description: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommAlgorithmRecord:
    """A communication algorithm (compression, ring/tree collective, parameter server)."""

    name: str
    ops: tuple[str, ...]
    config_cls: type[BaseModel] | None = None
    description: str = ""


CommOp = Literal[
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "broadcast",
    "send",
    "recv",
    "barrier",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CommRequest:
    """One collective or point-to-point operation, as seen by `plait_communicate`.

    `tensors` are the operands (for `all_gather` and `reduce_scatter`: `output`, `input`).
    `purpose` tags what the op is for (`"grad_bucket"`, `"param_gather"`, `"activation"`, …) so
    an algorithm plugin can take over only the traffic it was configured for.
    """

    op: CommOp
    tensors: tuple[torch.Tensor, ...]
    group: Any  # torch.distributed.ProcessGroup
    group_name: str
    group_ranks: tuple[int, ...]
    seq: int
    reduce_op: Literal["sum", "avg", "max", "min"] = "sum"
    peer: int | None = None  # global rank for send/recv, source for broadcast
    async_op: bool = False
    purpose: str = "generic"
    attributes: dict[str, Any] = field(default_factory=dict)
    # The `plait.core.comm.Comm` that issued the request: an algorithm plugin issues its own
    # point-to-point sub-ops through it (with a purpose of its own, so it does not recurse).
    issuer: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes this rank contributes (the input operand for gather/scatter ops)."""
        if self.op in ("all_gather", "reduce_scatter"):
            operand = self.tensors[1]
            return operand.numel() * operand.element_size()
        return sum(t.numel() * t.element_size() for t in self.tensors)

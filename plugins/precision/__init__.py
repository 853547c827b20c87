"""The `amp` precision strategy: bf16/fp16 compute, fp32 master weights, fp16 dynamic loss scaling.

Selected with `parallel.transforms = { precision = "amp" }` and configured in `[amp]`:

    [amp]
    dtype = "bf16"          # compute dtype: "bf16" or "fp16"
    param_dtype = "bf16"    # parameters (and gradients): the compute dtype, or "fp32" for autocast
    reduce_dtype = "fp32"   # dtype of data-parallel gradient reductions (default: param_dtype)
    fp8 = false             # linear layers in fp8 through torch._scaled_mm (Ada / Hopper GPUs)

The transform runs after pipeline / tensor / context / expert parallelism and before activation
checkpointing, compile and data parallel (`records.SHARD_ORDER`), so data parallel builds its
gradient buckets from the low-precision parameters. See `runtime.py` for how a step flows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from torch import nn

from plait.core.comm import world_group
from plait.core.config import Section
from plait.core.errors import ConfigError
from plait.core.sharding import ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.plugins.precision.fp8 import check_fp8_device, convert_to_float8
from plait.plugins.precision.policy import (
    AutocastHooks,
    PrecisionPolicy,
    cast_floating_inputs_hook,
    cast_parameters_,
    make_policy,
)
from plait.plugins.precision.reduce import ReduceDtypeCast
from plait.plugins.precision.runtime import MixedPrecisionRuntime
from plait.plugins.precision.scaler import DynamicLossScaler

NAME = "amp"

__all__ = [
    "NAME",
    "AmpConfig",
    "DynamicLossScaler",
    "MixedPrecisionRuntime",
    "PrecisionPolicy",
    "apply_mixed_precision",
]


class AmpConfig(Section):
    """`[amp]` section."""

    dtype: Literal["bf16", "fp16"] = Field("bf16", description="compute dtype")
    param_dtype: Literal["bf16", "fp16", "fp32"] | None = Field(
        None,
        description="dtype of the module's parameters and gradients: the compute dtype (fp32 "
        "master weights in the optimizer) or fp32 (autocast); default: the compute dtype",
    )
    reduce_dtype: Literal["bf16", "fp16", "fp32"] | None = Field(
        None, description="dtype of data-parallel gradient reductions; default: param_dtype"
    )
    initial_scale: float = Field(2.0**16, gt=0, description="fp16: initial loss scale")
    growth_interval: int = Field(
        2000, ge=1, description="fp16: clean steps in a row before the scale grows"
    )
    backoff_factor: float = Field(
        0.5, gt=0, lt=1, description="fp16: scale multiplier after an overflow"
    )
    growth_factor: float = Field(
        2.0, gt=1, description="fp16: scale multiplier after growth_interval clean steps"
    )
    min_scale: float = Field(1.0, gt=0, description="fp16: the scale never backs off below this")
    fp8: bool = Field(
        False,
        description="linear layers compute in fp8 (e4m3 forward, e5m2 gradients, dynamic "
        "per-tensor scales) through torch._scaled_mm; bf16 only, GPUs of compute capability "
        ">= 8.9 (Ada, Hopper)",
    )
    fp8_skip: list[str] = Field(
        default_factory=lambda: ["output", "lm_head"],
        description="fp8: linear layers (full or last name component) kept in the compute dtype",
    )

    @model_validator(mode="after")
    def _fp8_over_bf16(self) -> AmpConfig:
        if self.fp8 and self.dtype != "bf16":
            raise ValueError(f"fp8 runs over bf16 compute: set dtype = 'bf16' (got {self.dtype!r})")
        return self

    @model_validator(mode="after")
    def _param_dtype_fits(self) -> AmpConfig:
        if self.param_dtype not in (None, self.dtype, "fp32"):
            raise ValueError(
                f"param_dtype must be the compute dtype ({self.dtype!r}) or 'fp32', "
                f"got {self.param_dtype!r}"
            )
        return self


strategies = Strategies()


@strategies.provide(
    name=NAME,
    axis="precision",
    config_cls=AmpConfig,
    description="bf16/fp16 mixed precision with fp32 master weights and fp16 loss scaling",
)
def apply_amp(model: nn.Module, *, context: ShardContext, config: AmpConfig) -> Sharded:
    runtime = apply_mixed_precision(model, config=config, context=context)
    return Sharded(module=model, runtime=runtime)


def apply_mixed_precision(
    model: nn.Module, *, config: AmpConfig, context: ShardContext
) -> MixedPrecisionRuntime:
    """Cast `model` in place to the configured policy and return the runtime that owns the
    master weights and the loss scale."""
    try:
        policy = make_policy(config.dtype, config.param_dtype, config.reduce_dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config.fp8:
        check_fp8_device(context.device)
        if not convert_to_float8(model, skip=config.fp8_skip):
            raise ConfigError(
                "amp.fp8: no nn.Linear of the model has both dims divisible by 16 outside "
                f"amp.fp8_skip = {config.fp8_skip}; nothing would run in fp8"
            )
    if policy.master_weights:
        cast_parameters_(model, policy.param_dtype)
        model.register_forward_pre_hook(
            cast_floating_inputs_hook(policy.param_dtype), with_kwargs=True
        )
    if policy.autocast:
        AutocastHooks(model, device_type=context.device.type, dtype=policy.compute_dtype)
    if policy.reduce_dtype != policy.param_dtype:
        _register_reduce_cast(context, policy)
    # Later transforms (ZeRO keeping fp32 master shards, say) and the engine's MFU read it.
    context.precision = policy
    scaler = (
        DynamicLossScaler(
            initial_scale=config.initial_scale,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            growth_interval=config.growth_interval,
            min_scale=config.min_scale,
        )
        if policy.loss_scaling
        else None
    )
    world = world_group() if context.mesh.world_size > 1 else None
    return MixedPrecisionRuntime(
        model,
        policy=policy,
        scaler=scaler,
        comm=context.comm,
        mesh=context.mesh,
        overflow_group=world,
    )


def _register_reduce_cast(context: ShardContext, policy: PrecisionPolicy) -> None:
    manager = context.plugins.manager
    name = "amp.reduce_dtype"
    existing = manager.get_plugin(name)
    if existing is not None:
        manager.unregister(existing)
    cast = ReduceDtypeCast(context.comm, policy.reduce_dtype)
    context.plugins.register(cast, name)


plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard

"""The `lora` transform: LoRA adapters (Hu et al. 2021) added with peft, the base frozen.

Selected with `parallel.transforms = { adapter = "lora" }` and configured in `[peft]`
(`plait.plugins.lora.config`). It runs on the `adapter` axis, after tensor, context and expert
parallelism and before precision, recomputation, compile and data parallelism
(`records.SHARD_ORDER`): those see the adapted model, so the data-parallel runtime finds the
base weights frozen and gives them no gradient bucket, no reduction and no optimizer state
(ZeRO-3 still shards them, and gathers them for forward and backward).

The model comes back wrapped as peft wraps it (`PeftModelForCausalLM` for a transformers causal
LM, `PeftModel` for any other module), so parameter names are peft's (`base_model.model.…`).
A `PeftModel` the user built and passes to `plait.initialize` needs no transform at all: its
frozen weights are treated the same way.

Checkpoints of a job with the transform hold the adapters and their optimizer state; the base
is named and hashed in them and checked at resume (`state.py`); `plait ckpt export --format
peft` writes them as a folder peft loads (`export.py`), `--merged` the whole model with them
merged into the base the user names (`merge.py`).

Pipeline and tensor parallelism are refused with it: they cut or shard the linear layers the
adapters wrap, and adapters on their pieces are not tested yet.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from plait.core.config import PlaitConfig
from plait.core.errors import ConfigError
from plait.core.hookspecs import hookimpl
from plait.core.records import ConfigSectionRecord
from plait.core.sharding import ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.plugins.lora.apply import apply_lora
from plait.plugins.lora.config import SECTION, PeftSection, lora_config, peft_section
from plait.plugins.lora.export import ADAPTER
from plait.plugins.lora.state import AdapterState, base_name

__all__ = ["NAME", "AdapterState", "PeftSection", "apply_lora", "lora_config", "peft_section"]

NAME = "lora"
AXIS = "adapter"
# Degrees whose transforms run before the adapter and cut or shard the layers it wraps.
REFUSED_DEGREES = ("pp", "tp")

strategies = Strategies()


@strategies.provide(
    name=NAME,
    axis=AXIS,
    config_cls=PeftSection,
    config_section=SECTION,
    description="LoRA adapters with peft; the base weights frozen",
)
def shard_lora(model: nn.Module, *, context: ShardContext, config: PeftSection) -> Sharded:
    name = base_name(model)
    adapted = apply_lora(model, config, seed=context.config.train.seed)
    task_type = adapted.peft_config[ADAPTER].task_type
    state = AdapterState(
        adapted, config, name=name, task_type=None if task_type is None else str(task_type)
    )
    # Its engine's plugin, for the checkpoint-state hooks (named per engine: a process may
    # hold several).
    context.plugins.register(state, name=f"lora-adapter-{id(state):x}")
    return Sharded(module=adapted, runtime=state)


@hookimpl
def plait_register_config_sections() -> Sequence[ConfigSectionRecord]:
    return [
        ConfigSectionRecord(
            name=SECTION,
            config_cls=PeftSection,
            description="LoRA adapter: rank, alpha, dropout, target modules",
        )
    ]


@hookimpl
def plait_configure(config: PlaitConfig) -> None:
    """A `[peft]` section without the transform would train the full model silently; the
    transform with pipeline or tensor parallelism would adapt pieces of layers."""
    selected = config.parallel.transforms.get(AXIS) == NAME
    if SECTION in config.extensions and not selected:
        raise ConfigError(
            "[peft] is set but no adapter is applied: add "
            f'parallel.transforms = {{ {AXIS} = "{NAME}" }} or remove [peft]'
        )
    if not selected:
        return
    for axis in REFUSED_DEGREES:
        degree = getattr(config.parallel, axis)
        if degree > 1:
            raise ConfigError(
                f"parallel.transforms.{AXIS} = {NAME!r} with parallel.{axis} = {degree} is not "
                f"supported yet (adapters on {axis}-cut layers are untested); set "
                f"parallel.{axis} = 1"
            )


plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard

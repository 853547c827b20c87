"""The `lora` transform: LoRA adapters (Hu et al. 2021) added with peft, the base frozen.

Selected with `parallel.transforms = { adapter = "lora" }` and configured in `[peft]`
(`plait.plugins.lora.config`). It runs on the `adapter` axis, after the pipeline split and tensor,
context and expert parallelism and before precision, recomputation, compile and data parallelism
(`records.SHARD_ORDER`): those see the adapted model, so the data-parallel runtime finds the
base weights frozen and gives them no gradient bucket, no reduction and no optimizer state
(ZeRO-3 still shards them, and gathers them for forward and backward).

The model comes back wrapped as peft wraps it (`PeftModelForCausalLM` for a transformers causal
LM, `PeftModel` for any other module), so parameter names are peft's (`base_model.model.…`).
A `PeftModel` the user built and passes to `plait.initialize` needs no transform at all: its
frozen weights are treated the same way.

Checkpoints of a job with the transform hold the adapters and their optimizer state; the base
is named and hashed in them and checked at resume (`state.py`), and stays in the state layout as
left out of them, so that `checkpoint_io.init_from` loads a built-in model's pretrained base
(hashed again once loaded) and a resume loads it before the adapters; `plait ckpt export --format
peft` writes them as a folder peft loads (`export.py`), `--merged` the whole model with them
merged into the base the user names (`merge.py`). A module to save (`modules_to_save`) trains as
peft's copy of it, checkpointed and exported with the adapters, its frozen original left out
with the base (not yet under pipeline or tensor parallelism).

With pipeline parallelism (`parallel.pp`) each stage adapts the linear layers it holds
(`stages.py`): the stages draw the adapters one process draws, the base is hashed over all of
them, and the adapters keep their one-process names in checkpoints; one chunk per pipeline rank
(virtual stages are refused, untested). With tensor parallelism (`parallel.tp`) each adapter is
cut as its layer is (`tensor_parallel.py`): on a column-parallel linear `A` whole and `B` cut on
its output rows, on a row-parallel one `A` cut on its input columns and `B` whole, its partial
output joining the layer's before the reduction; the whole factor's gradient is summed over the
tp ranks. With both, each stage's adapters are cut as its tensor-parallel layers are, drawn
where the stage before it stopped, and the base is hashed over every stage's whole tensors
(each stage's slices gathered over its tp ranks, one tensor at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from torch import nn

from plait.core.config import PlaitConfig
from plait.core.errors import ConfigError
from plait.core.hookspecs import hookimpl
from plait.core.records import ConfigSectionRecord
from plait.core.sharding import ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.plugins.lora.apply import add_adapters, apply_lora, task_type_of
from plait.plugins.lora.config import SECTION, PeftSection, lora_config, peft_section
from plait.plugins.lora.stages import adapt_stage, stage_base
from plait.plugins.lora.state import ADAPTER, AdapterState, base_name
from plait.plugins.lora.tensor_parallel import (
    TensorParallelFactors,
    check_targets,
    gathered,
    parallel_layers,
    whole_base,
)

__all__ = ["NAME", "AdapterState", "PeftSection", "apply_lora", "lora_config", "peft_section"]

NAME = "lora"
AXIS = "adapter"

strategies = Strategies()


@strategies.provide(
    name=NAME,
    axis=AXIS,
    config_cls=PeftSection,
    config_section=SECTION,
    description="LoRA adapters with peft; the base weights frozen",
)
def shard_lora(model: nn.Module, *, context: ShardContext, config: PeftSection) -> Sharded:
    pipeline, tensor_parallel = context.pipeline, context.tensor_parallel
    source = pipeline.source_model if pipeline is not None else None
    name = base_name(model if source is None else source)
    over_stages = layers = None
    if tensor_parallel is not None and tensor_parallel.degree > 1:
        check_targets(config, context=context)
        layers = parallel_layers(model, context=context)
    if pipeline is not None:
        adapted = adapt_stage(model, config, context=context, custom_layers=layers)
        over_stages = partial(stage_base, context=context)
        frozen = ((n, p) for n, p in adapted.named_parameters() if not p.requires_grad)
        if layers is not None:
            # Hashed whole: the tensor-parallel slices gathered, one tensor at a time.
            frozen = ((n, gathered(p, context=context)) for n, p in frozen)
        base = over_stages(frozen, name=name)
    elif layers is not None:
        seed = context.config.train.seed
        adapted = add_adapters(model, config, seed=seed, custom_layers=layers)[0]
        base = whole_base(adapted, name=name, context=context)
    else:
        adapted = apply_lora(model, config, seed=context.config.train.seed)
        base = None
    factors = None if layers is None else TensorParallelFactors(adapted, context=context)
    # A stage is no causal LM: peft wraps it untyped, but the adapters are the whole model's.
    task_type = adapted.peft_config[ADAPTER].task_type if source is None else task_type_of(source)
    state = AdapterState(
        adapted,
        config,
        name=name,
        task_type=None if task_type is None else str(task_type),
        base=base,
        stage_names=pipeline is not None,
        tensor_parallel=factors,
        over_stages=over_stages,
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
    transform with virtual pipeline stages, and modules to save under pipeline or tensor
    parallelism, are untested."""
    selected = config.parallel.transforms.get(AXIS) == NAME
    if SECTION in config.extensions and not selected:
        raise ConfigError(
            "[peft] is set but no adapter is applied: add "
            f'parallel.transforms = {{ {AXIS} = "{NAME}" }} or remove [peft]'
        )
    if not selected:
        return
    if config.parallel.pp > 1 and config.schedule.virtual_stages > 1:
        raise ConfigError(
            f"parallel.transforms.{AXIS} = {NAME!r} with schedule.virtual_stages = "
            f"{config.schedule.virtual_stages} is not supported yet (adapters on several chunks "
            "per pipeline rank are untested): use one chunk per rank (1f1b, gpipe, zb_h1)"
        )
    saved = peft_section(config).modules_to_save
    split = {f"parallel.{axis}": getattr(config.parallel, axis) for axis in ("pp", "tp")}
    split = {key: degree for key, degree in split.items() if degree > 1}
    if saved and split:
        degrees = ", ".join(f"{key} = {degree}" for key, degree in split.items())
        raise ConfigError(
            f"[peft] modules_to_save = {saved} with {degrees} is not supported yet (a module "
            "trained in full beside the adapters is untested on pipeline stages and "
            "tensor-parallel ranks): train it with data or context parallelism only"
        )


plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard

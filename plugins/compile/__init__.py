"""The `compile` transform: `torch.compile` of every transformer block, torchtitan's way.

Selected with `parallel.transforms = { compile = "compile" }` and configured in `[compile]`:

    [compile]
    backend = "inductor"   # any registered torch.compile backend
    fullgraph = false      # true: a graph break is an error instead of a fallback to eager
    # dynamic = true       # symbolic shapes from the start (unset: torch's default)
    blocks = ""            # where the blocks are; "" = found automatically

Each block's `forward` compiles in place, so parameter names, state dicts and checkpoints stay
those of the eager model, and every hook around a block runs eagerly, outside the compiled code:
the module's own `__call__` (which runs forward pre- and post-hooks) is left as it is. That is
what lets ZeRO-3 compile: its all-gather before a block and the reduce-scatter hooked on the
block's outputs are plait communication calls, which Dynamo would otherwise trace (a graph break
at every collective, and a recompile whenever the communicator's counters change). The gradient
hooks data parallelism puts on parameters run in autograd, outside the compiled code too.
Blocks, not the whole model: the blocks share one forward, so one compiled graph serves every layer
(compile time is one block's), and the embedding, the head and the loss stay where the kernel facade
and the pipeline split put them. It runs after activation checkpointing (a checkpointed block
recomputes compiled code) and before data parallelism.

Tested with one process, DDP, ZeRO-1/2/3 and HSDP (`parallel.dp_shard`), pipeline stages (also
under ZeRO-3), AMP, activation checkpointing, tensor parallelism with and without sequence
parallelism, context parallelism (ring and Ulysses, plait's Llama and a `transformers` Llama)
and expert parallelism (plait's MoE and a `transformers` Mixtral). Their collectives run inside
a block's forward, so what holds them runs eagerly between the compiled pieces
(`torch.compiler.disable`, a graph break at each, counted in the summary below) instead of the
compiler tracing plait's communicator and recompiling as its counters move: the tensor-parallel
operators
(`plait.plugins.tensor_parallel.tp_communications`), the whole context-parallel attention call
(`plait.plugins.context_parallel.attention`: measured on the tiny Llama, the call costs 2
breaks and 4 graphs for ring and Ulysses alike, their exchange 3 breaks (the ring's, whose
send/receive sit inside one autograd function) or a fifth graph (Ulysses' all-to-alls), and the
bare send/receive or all-to-all more of both and recompiles), and the experts' token exchange
with the local experts (`plait.plugins.expert_parallel.dispatch`: traced, the step's token
counts are guarded on and the block recompiles every step). Hence those layouts are refused
with `fullgraph = true` (every break would be an error). With activation checkpointing they
compile the block inside its checkpoint wrapper instead of the wrapper: Dynamo traces a
checkpoint as one higher-order op, which cannot break, so a break inside it would leave the
whole block eager; compiled inside, the checkpoint runs eagerly around the compiled pieces and
recomputes them in backward. Layouts without a break keep the wrapper compiled (the compiler
then sees what the checkpoint recomputes, as torchtitan compiles it).

After the first step that compiled, rank 0 logs the graphs, graph breaks (with Dynamo's
reasons) and compile time once, and any recompilation after step 2 with its cause
(`plait.plugins.compile.watch`).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from plait.core.blocks import find_block_container
from plait.core.config import PlaitConfig, Section
from plait.core.errors import ConfigError, PluginError
from plait.core.kernels import KERNEL_OPS
from plait.core.sharding import ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.plugins.compile.watch import CompileWatch, recording

NAME = "compile"
# Where torch's `CheckpointWrapper` (activation checkpointing's) holds the block it wraps.
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
COMPILED_DP_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
# Axes whose collectives run eagerly between a block's compiled pieces (`torch.compiler.
# disable`d, a graph break at each), and what runs there.
EAGER_BETWEEN_PIECES = {
    "tp": "the tensor-parallel collectives",
    "cp": "the context-parallel attention calls (the ring's send/receive or Ulysses' "
    "all-to-all inside)",
    "ep": "the experts' token exchanges (their all-to-alls and the local experts between them)",
}

__all__ = ["NAME", "CompileConfig", "CompileWatch", "compile_blocks"]


class CompileConfig(Section):
    """`[compile]` section."""

    backend: str = Field(
        "inductor",
        description="torch.compile backend: inductor (generated kernels), aot_eager (traced "
        "but not code-generated: for finding graph breaks), or any registered backend",
    )
    fullgraph: bool = Field(
        False, description="a graph break inside a block is an error instead of eager fallback"
    )
    dynamic: bool | None = Field(
        None,
        description="unset: torch's default (static shapes, symbolic once a shape changes); "
        "true: symbolic shapes from the start; false: recompile for every new shape",
    )
    blocks: str = Field(
        "",
        description="attribute path of the module holding the transformer blocks; '' = found "
        "automatically (`_no_split_modules`, else the longest list of one block class)",
    )


def compile_blocks(
    model: nn.Module,
    *,
    backend: str = "inductor",
    fullgraph: bool = False,
    dynamic: bool | None = None,
    blocks: str = "",
    inside_checkpoints: bool = False,
) -> list[str]:
    """Compile each of the model's blocks in place; return their keys (in container order).
    `inside_checkpoints`: compile what an activation-checkpoint wrapper holds, not the wrapper."""
    _, container = find_block_container(model, blocks, field="compile.blocks")
    # `backend` itself, counting the plait custom ops each graph keeps (the watch's summary).
    compiling = recording(backend)
    keys = (
        list(container.keys())
        if isinstance(container, nn.ModuleDict)
        else [str(i) for i in range(len(container))]
    )
    for block in container.values() if isinstance(container, nn.ModuleDict) else container:
        # NOTE: `forward`, not the module (`nn.Module.compile` compiles `_call_impl`, hooks
        # included): the hooks strategies put around a block (ZeRO-3's gather and reshard) stay
        # eager. Every block's bound `forward` shares one code object, hence one graph cache.
        if inside_checkpoints:
            block = getattr(block, CHECKPOINT_WRAPPED, block)
        block.forward = torch.compile(
            block.forward, backend=compiling, fullgraph=fullgraph, dynamic=dynamic
        )
    return keys


def breaks_between_pieces(config: PlaitConfig) -> bool:
    """Whether the layout runs something eagerly inside every block (a graph break at each)."""
    return any(getattr(config.parallel, axis) > 1 for axis in EAGER_BETWEEN_PIECES)


def _refuse_untested_layouts(config: PlaitConfig) -> None:
    parallel = config.parallel
    spread = []
    if parallel.dp_strategy not in COMPILED_DP_STRATEGIES:
        spread.append(f"parallel.dp_strategy = {parallel.dp_strategy!r}")
    fullgraph = config.section(NAME, CompileConfig).fullgraph
    for axis, eager in EAGER_BETWEEN_PIECES.items():
        degree = getattr(parallel, axis)
        if degree > 1 and fullgraph:
            spread.append(
                f"parallel.{axis} = {degree} with compile.fullgraph = true ({eager} run "
                "eagerly between a block's compiled pieces, a graph break at each, which "
                "fullgraph makes an error)"
            )
    if spread:
        raise ConfigError(
            f"parallel.transforms.compile: {', '.join(spread)} is not supported compiled; the "
            f"compile transform runs with dp_strategy one of {list(COMPILED_DP_STRATEGIES)}, "
            "and with tp, cp or ep only without compile.fullgraph (drop transforms.compile "
            "for this layout)"
        )


def resolve_kernels_ahead(context: ShardContext) -> int:
    """Resolve every kernel op for the dtypes the blocks will compute in; returns how many.

    NOTE: the kernel facade resolves an op on its first call through pluggy, which the compiler
    cannot trace: a first call inside a compiled block is a graph break, and inside a
    checkpointed block (a higher-order op that cannot break) the block is not compiled at all.
    Resolved here, the blocks' calls are dictionary hits the compiler folds into the graph."""
    dtypes = {torch.float32}
    if context.precision is not None:
        dtypes |= {context.precision.compute_dtype, context.precision.param_dtype}
    resolved = 0
    for op in KERNEL_OPS:
        for dtype in dtypes:
            try:
                context.kernels.get(op, context.device, dtype)
            except PluginError:  # no provider for this dtype: the model will not ask either
                continue
            resolved += 1
    return resolved


def _check_backend(backend: str) -> None:
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(f"compile.backend = {backend!r} is not a torch.compile backend; known: "
                          f"{sorted(known)}")  # fmt: skip


strategies = Strategies()


@strategies.provide(
    name=NAME,
    axis="compile",
    config_cls=CompileConfig,
    description="torch.compile of each transformer block, in place (names unchanged)",
)
def compile_model(model: nn.Module, *, context: ShardContext, config: CompileConfig) -> Sharded:
    _refuse_untested_layouts(context.config)
    _check_backend(config.backend)
    resolve_kernels_ahead(context)
    keys = compile_blocks(
        model,
        backend=config.backend,
        fullgraph=config.fullgraph,
        dynamic=config.dynamic,
        blocks=config.blocks,
        inside_checkpoints=breaks_between_pieces(context.config),
    )
    context.plugins.register(
        CompileWatch(blocks=len(keys), rank=context.mesh.rank), f"{NAME}.watch"
    )
    return Sharded(module=model)


plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard

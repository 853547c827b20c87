"""`plait train --dry-run`: the mesh and each rank's memory, estimated without starting a rank.

The model is built on the meta device (no memory, no initialisation), so its parameters, and
each pipeline stage's share of them, are counted exactly by name. The bytes come from the
planner's memory model (`plait.planner.memory_model`, the one `plait plan` and `--auto` use):
model state by ZeRO stage and precision, activations by tp / sp / cp / schedule / recomputation
(Korthikanti et al. 2022), the loss's logits and communication buffers, for the rank with the
most (the first or the last pipeline stage). Memory does not depend on the device, so none is
detected: the dry run starts nothing and measures nothing.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from plait.core.mesh import MESH_AXES
from plait.core.parallel_dims import resolve_degrees

if TYPE_CHECKING:
    from rich.console import Console

    from plait.core.config import PlaitConfig
    from plait.core.plugins import Plugins
    from plait.planner.memory_model import MemoryEstimate

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_FIRST_STAGE = re.compile(r"embed|wte|wpe|tok_")


@dataclass(frozen=True, slots=True)
class RankEstimate:
    """The rank with the most memory: its pipeline stage, its parameters counted on the meta
    device, and the planner's bytes for it."""

    stage: int
    num_parameters: int
    memory: MemoryEstimate


def mesh_groups(degrees: dict[str, int]) -> dict[str, list[list[int]]]:
    """The ranks of every group along each axis of degree > 1 (the mesh is pp × dp × cp × tp,
    tp innermost, as `plait.core.mesh.Mesh` lays it out)."""
    sizes = [degrees[a] for a in MESH_AXES]
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    groups: dict[str, list[list[int]]] = {}
    for index, axis in enumerate(MESH_AXES):
        if sizes[index] == 1:
            continue
        others = [range(n) if i != index else range(1) for i, n in enumerate(sizes)]
        groups[axis] = [
            [
                sum(c * s for c, s in zip(coords, strides, strict=True)) + k * strides[index]
                for k in range(sizes[index])
            ]
            for coords in itertools.product(*others)
        ]
    return groups


def build_meta_model(config: PlaitConfig, plugins: Plugins) -> tuple[Any, Any]:
    """The configured built-in model on the meta device, and its config."""
    import torch

    from plait.core.kernels import Kernels

    record = plugins.model(config.model.name)
    if record.make_config is not None:
        model_config = record.make_config(config.model.size, config.model.overrides)
    else:
        model_config = record.config_cls.model_validate(config.model.overrides)
    kernels = Kernels(plugins, prefer=config.kernels.prefer, overrides=config.kernels.overrides)
    with torch.device("meta"):
        return record.build(model_config, kernels), model_config


def stage_parameter_counts(model: Any, n_layers: int, pp: int) -> list[int]:
    """Parameters of each pipeline stage: blocks split evenly in order, the embedding on the
    first stage, everything else outside the blocks (final norm, output head) on the last."""
    counts = [0] * pp
    for name, param in model.named_parameters():
        match = _LAYER.search(name)
        if match and n_layers:
            stage = min(int(match.group(1)) * pp // n_layers, pp - 1)
        else:
            stage = 0 if _FIRST_STAGE.search(name) else pp - 1
        counts[stage] += param.numel()
    return counts


def estimate(config: PlaitConfig, *, world_size: int, per_node: int, model: Any) -> RankEstimate:
    """The planner's estimate for the rank with the most memory under `config`'s layout."""
    from plait.planner.auto import job_for_config, layout_from_config
    from plait.planner.devices import DEVICES
    from plait.planner.memory_model import estimate_memory

    data = config.model_dump(mode="json")
    # The job's device prices time only; memory is the same on any, so a nominal one is given.
    # Except that a CPU is its own host, which ZeRO's offload then leaves where it is.
    device = next(iter(DEVICES.values()))
    if _trains_on_cpu(config):
        device = replace(device, host_memory_bytes=None)
    job = job_for_config(data, world=world_size, per_node=per_node, device=device)
    layout = layout_from_config(data, world=world_size)
    memory = estimate_memory(job, layout)
    counts = stage_parameter_counts(model, job.model.n_layers, layout.pp)
    return RankEstimate(
        stage=memory.stage, num_parameters=counts[memory.stage] // layout.tp, memory=memory
    )


def micro_batch_size(config: PlaitConfig, plugins: Plugins, degrees: dict[str, int]) -> int:
    """Rows per micro-batch on each rank, decided as a rank decides it: `train.micro_batch_size`,
    or with it unset the count chosen for the schedule, which is asked for its program as a rank
    asks (`plait.core.microbatch_count`). A batch that cannot be split is refused here, before
    anything is launched."""
    from plait.core.microbatch_count import default_microbatch_count
    from plait.core.schedule import ScheduleRequest

    if config.train.micro_batch_size is not None:
        return config.train.micro_batch_size
    rows = config.train.global_batch_size // degrees["dp"]
    schedule = config.schedule

    def program(count: int) -> object:
        request = ScheduleRequest(
            name=schedule.name,
            num_microbatches=count,
            num_stages=degrees["pp"],
            virtual_stages=schedule.virtual_stages,
        )
        return plugins.schedule(request)

    count = default_microbatch_count(
        rows, num_stages=degrees["pp"], schedule=schedule.name, program=program
    )
    return rows // count


def compiled_blocks_line(config: PlaitConfig, model: Any) -> str | None:
    """What the compile transform will compile, or `None` when it is not selected."""
    name = config.parallel.transforms.get("compile")
    if name is None:
        return None
    from plait.core.blocks import find_block_container
    from plait.plugins.compile import EAGER_BETWEEN_PIECES, CompileConfig

    settings = config.section(name, CompileConfig)
    path, container = find_block_container(model, settings.blocks, field="compile.blocks")
    line = (
        f"compiled blocks: forward of each of the {len(container)} blocks in {path} "
        f"(torch.compile backend {settings.backend}{', fullgraph' if settings.fullgraph else ''}"
        "); hooks around them (ZeRO-3's gathers) run eagerly"
    )
    inside = [
        f"{what} (parallel.{axis} = {getattr(config.parallel, axis)})"
        for axis, what in EAGER_BETWEEN_PIECES.items()
        if getattr(config.parallel, axis) > 1
    ]
    if inside:
        line += (
            f"; inside each block, {' and '.join(inside)} run eagerly between its compiled "
            "pieces, a graph break at each"
        )
    return line


def _offload_path(config: PlaitConfig) -> str:
    from plait.plugins.zero.config import ZeroConfig

    return str(config.section("zero", ZeroConfig).offload.path)


def _trains_on_cpu(config: PlaitConfig) -> bool:
    import torch

    device = config.train.device
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def offload_line(memory: MemoryEstimate, *, path: str) -> str | None:
    """What `[zero.offload]` keeps off the device and where (its files under `path`), or
    `None` without it."""
    device = memory.offload
    if device == "none":
        return None
    files = f"in files under {path or '(zero.offload.path unset)'} between steps"
    if not memory.host_total:  # a CPU run: the state is in host memory already
        line = f"offload (zero.offload.device = {device}): training on the CPU, the optimizer "
        if device == "nvme":
            state = memory.disk_optimizer_state / 2**20
            return line + f"state ({state:,.1f} MiB per rank) is {files}; the step reads it back"
        return line + "state is in host memory already: nothing moves"
    parts = {
        "parameter shards": memory.host_parameters,
        "master weights": memory.host_master_weights,
        "gradient copies": memory.host_gradients,
        "optimizer state": memory.host_optimizer_state,
    }
    shown = ", ".join(f"{name} {v / 2**20:,.1f}" for name, v in parts.items() if v)
    line = (
        f"offload (zero.offload.device = {device}): host memory per rank "
        f"{memory.host_total / 2**20:,.1f} MiB at the optimizer step ({shown}); the table's "
        "device bytes hold none of it"
    )
    if memory.disk_optimizer_state:
        line += f"; {memory.disk_optimizer_state / 2**20:,.1f} MiB per rank {files}"
    return line


def print_dry_run(
    config: PlaitConfig, plugins: Plugins, *, world_size: int, per_node: int, console: Console
) -> None:
    """Print the mesh, its groups and the estimate for the rank with the most memory.

    Names in these lines come from the config and plugins (model, strategy, schedule and
    algorithm names), so the lines are printed without markup: a bracket in one shows as is."""
    from rich.table import Table

    from plait.core.comm_algorithms import chosen_algorithm
    from plait.core.host_map import HostMap
    from plait.training.banner import microbatch_line

    par = config.parallel
    degrees = resolve_degrees(world_size, dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp)
    model, _ = build_meta_model(config, plugins)
    total = sum(p.numel() for p in model.parameters())
    transforms = " ".join(f"{a}={n}" for a, n in sorted(par.transform_strategies().items()))
    console.print(
        f"dry run: {config.model.name}/{config.model.size} · {total:,} parameters · "
        f"{world_size} rank{'s' if world_size > 1 else ''} "
        f"({' '.join(f'{a}={degrees[a]}' for a in MESH_AXES)}) · dp strategy {par.dp_strategy}"
        + (f" · transforms {transforms}" if transforms else ""),
        highlight=False,
        soft_wrap=True,
        markup=False,
    )
    nodes = HostMap.assumed(max(1, world_size // per_node), per_node)
    console.print(
        f"nodes: {nodes.describe()} · comm {chosen_algorithm(config, nodes).name}", markup=False
    )
    for axis, groups in mesh_groups(degrees).items():
        shown = " ".join(str(g) for g in groups[:8]) + (" …" if len(groups) > 8 else "")
        console.print(f"{axis} groups: {shown}", highlight=False, soft_wrap=True, markup=False)
    train = config.train
    size = micro_batch_size(config, plugins, degrees)
    line = microbatch_line(
        rows=train.global_batch_size // degrees["dp"],
        micro_batch_size=size,
        configured=train.micro_batch_size,
        schedule=config.schedule.name,
        pp=degrees["pp"],
    )
    console.print(line, highlight=False, soft_wrap=True, markup=False)
    compiled = compiled_blocks_line(config, model)
    if compiled:
        console.print(compiled, highlight=False, soft_wrap=True, markup=False)
    # The planner's activations are those of the micro-batch that runs.
    config = config.model_copy(
        update={"train": train.model_copy(update={"micro_batch_size": size})}
    )
    rank = estimate(config, world_size=world_size, per_node=per_node, model=model)
    m = rank.memory
    table = Table(
        title=f"estimated memory of the fullest rank (pipeline stage {rank.stage}), MiB",
        title_justify="left",
    )
    columns = {
        "parameters": f"{rank.num_parameters:,}",
        "param MiB": m.parameters,
        "grad MiB": m.gradients,
        "optimizer MiB": m.master_weights + m.optimizer_state,
        "activations MiB": m.activations,
        "logits MiB": m.logits,
        "buffers MiB": m.buffers,
    }
    if m.secondary_shards:  # hpZ: every unit's node share, kept from its forward to its backward
        columns["hpZ shards MiB"] = m.secondary_shards
    columns["total MiB"] = m.total
    for column in columns:
        table.add_column(column, justify="right")
    table.add_row(*(v if isinstance(v, str) else f"{v / 2**20:,.1f}" for v in columns.values()))
    console.print(table)
    offload = offload_line(m, path=_offload_path(config))
    if offload:
        console.print(offload, highlight=False, soft_wrap=True, markup=False)
    console.print(
        "estimates, not measurements: parameters are counted on the meta device, bytes by the "
        "planner's memory model (plait.planner.memory_model). Nothing was launched.",
        highlight=False,
        soft_wrap=True,
    )

"""`plait train --dry-run`: the mesh and each rank's memory, estimated without starting a rank.

The model is built on the meta device (no memory, no initialisation), so its parameters are
counted exactly by name; how a rank's share follows from the degrees is an estimate:

- pipeline stages split the transformer blocks evenly (the embedding on the first stage, the
  final norm and output head on the last); tensor parallelism divides a stage's parameters by tp;
- gradients take the parameters' size; AdamW keeps two fp32 moments per parameter; ZeRO shards
  optimizer state (zero1), also gradients (zero2) and also parameters (zero3) over dp;
- activations of one micro-batch per block follow Korthikanti et al. 2022 (`s·b·h·(34 +
  5·a·s/h)` bytes at 2 bytes per value, doubled for fp32), divided by tp with sequence
  parallelism (else only the 24 of 34 inside the tensor-parallel regions) and by cp; full
  activation checkpointing keeps each block's input (`2·s·b·h`) plus one block's activations;
  a pipeline schedule keeps up to pp micro-batches in flight on the first stage. The logits of
  one micro-batch (`b·s·V/tp` fp32, with their gradient) are added on the last stage.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.core.mesh import MESH_AXES, resolve_degrees

if TYPE_CHECKING:
    from rich.console import Console

    from plait.core.config import PlaitConfig
    from plait.core.plugins import Plugins

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_FIRST_STAGE = re.compile(r"embed|wte|wpe|tok_")


@dataclass(frozen=True, slots=True)
class RankEstimate:
    """One pipeline stage's rank: bytes of each kind of memory (every dp/tp/cp rank alike)."""

    stage: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    num_parameters: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


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


def strategy_options(config: PlaitConfig, plugins: Plugins, name: str | None) -> dict[str, Any]:
    """Strategy `name`'s config section with its defaults (empty when it has none)."""
    for (_, registered), (_, record) in plugins.strategies().items():
        if registered == name and record.config_cls is not None:
            section = record.config_section or name
            return config.section(section, record.config_cls).model_dump(mode="json")
    return {}


def estimate(
    config: PlaitConfig,
    plugins: Plugins,
    degrees: dict[str, int],
    model: Any,
    model_config: Any,
) -> list[RankEstimate]:
    """Per-stage estimates (see the module docstring for what each figure assumes)."""
    tp, pp, cp, dp = degrees["tp"], degrees["pp"], degrees["cp"], degrees["dp"]
    n_layers = int(getattr(model_config, "n_layers", 0) or 0)
    stage_params = [0] * pp
    for name, param in model.named_parameters():
        match = _LAYER.search(name)
        if match and n_layers:
            stage = min(int(match.group(1)) * pp // n_layers, pp - 1)
        else:
            stage = 0 if _FIRST_STAGE.search(name) else pp - 1
        stage_params[stage] += param.numel()

    precision = strategy_options(config, plugins, config.parallel.transforms.get("precision"))
    param_bytes = 2 if precision.get("param_dtype") in ("bf16", "fp16") else 4
    act_bytes = 2 if precision.get("dtype") in ("bf16", "fp16") else 4
    strategy = config.parallel.dp_strategy
    zero = int(strategy[-1]) if re.fullmatch(r"zero[123]", strategy) else 0

    batch = config.train.global_batch_size // dp
    micro = config.train.micro_batch_size or batch
    seq = config.data.seq_len // cp
    hidden = int(getattr(model_config, "dim", 0) or getattr(model_config, "hidden_size", 0) or 0)
    heads = int(getattr(model_config, "n_heads", 1) or 1)
    vocab = int(getattr(model_config, "vocab_size", 0) or 0)
    tp_options = strategy_options(config, plugins, config.parallel.tp_strategy) if tp > 1 else {}
    sequence_parallel = bool(tp_options.get("sequence_parallel", False))
    checkpointed = "ac" in config.parallel.transforms
    per_value = act_bytes / 2  # the formula counts 2-byte values
    inside_tp = 24 + 5 * heads * seq / max(hidden, 1)
    block = (
        seq * micro * hidden * ((inside_tp + 10) / tp if sequence_parallel else inside_tp / tp + 10)
    )
    block *= per_value
    blocks_per_stage = max(1, n_layers // pp) if n_layers else 0
    in_flight = pp if config.schedule.name != "accumulate" and pp > 1 else 1

    estimates = []
    for stage, count in enumerate(stage_params):
        num = count // tp
        if checkpointed:
            acts = blocks_per_stage * 2 * seq * micro * hidden * per_value + block
        else:
            acts = blocks_per_stage * block
        acts *= in_flight if stage == 0 else max(1, in_flight - stage)
        if stage == pp - 1 and vocab:
            acts += 2 * micro * seq * vocab * 4 / tp
        estimates.append(
            RankEstimate(
                stage=stage,
                num_parameters=num,
                parameters=int(num * param_bytes / (dp if zero >= 3 else 1)),
                gradients=int(num * param_bytes / (dp if zero >= 2 else 1)),
                optimizer=int(num * 8 / (dp if zero >= 1 else 1)),
                activations=int(acts),
            )
        )
    return estimates


def print_dry_run(
    config: PlaitConfig, plugins: Plugins, *, world_size: int, console: Console
) -> None:
    """Print the mesh, its groups and each stage's per-rank memory estimate."""
    from rich.table import Table

    par = config.parallel
    degrees = resolve_degrees(world_size, dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp)
    model, model_config = build_meta_model(config, plugins)
    total = sum(p.numel() for p in model.parameters())
    console.print(
        f"dry run: {config.model.name}/{config.model.size} · {total:,} parameters · "
        f"{world_size} rank{'s' if world_size > 1 else ''} "
        f"({' '.join(f'{a}={degrees[a]}' for a in MESH_AXES)}) · dp strategy {par.dp_strategy}"
        + (
            " · transforms " + " ".join(f"{a}={n}" for a, n in sorted(par.transforms.items()))
            if par.transforms
            else ""
        ),
        highlight=False,
        soft_wrap=True,
    )
    for axis, groups in mesh_groups(degrees).items():
        shown = " ".join(str(g) for g in groups[:8]) + (" …" if len(groups) > 8 else "")
        console.print(f"{axis} groups: {shown}", highlight=False, soft_wrap=True)
    table = Table(title="estimated memory per rank (MiB)", title_justify="left")
    for column in (
        "stage",
        "parameters",
        "param MiB",
        "grad MiB",
        "optimizer MiB",
        "activations MiB",
        "total MiB",
    ):
        table.add_column(column, justify="right")
    mib = 2**20
    for e in estimate(config, plugins, degrees, model, model_config):
        table.add_row(
            str(e.stage),
            f"{e.num_parameters:,}",
            *(
                f"{v / mib:,.1f}"
                for v in (e.parameters, e.gradients, e.optimizer, e.activations, e.total)
            ),
        )
    console.print(table)
    console.print(
        "estimates, not measurements: parameters are counted on the meta device; the rest "
        "follows from the degrees (see `plait.tools.dry_run`). Nothing was launched.",
        highlight=False,
        soft_wrap=True,
    )

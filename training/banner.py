"""What `plait train` prints before the first step: the model, the layout, every transform that
changes how a step runs, the communication algorithm and the data source."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.core.comm_algorithms import chosen_algorithm
from plait.daemon.peak_flops import PeakFlops

if TYPE_CHECKING:
    from plait.core.engine import Engine
    from plait.core.state_layout import StateLayout
    from plait.plugins.checkpoint.config import CheckpointIOConfig
    from plait.plugins.data import TokenBatches


def run_lines(engine: Engine, rank_peak: PeakFlops, batches: TokenBatches) -> list[str]:
    """The banner, one string per line."""
    from plait.training.run_records import resolved_config

    cfg = engine.config
    mesh = engine.mesh
    from plait.core.state_chunks import layout_for

    degrees = " ".join(f"{k}={v}" for k, v in mesh.degrees.items())
    lines = [
        f"plait {cfg.model.name}/{cfg.model.size} · "
        f"{parameters_text(layout_for(engine), pp=mesh.size('pp'))} · "
        f"{mesh.world_size} rank{'s' if mesh.world_size > 1 else ''} ({degrees}) on "
        f"{engine.device}",
        " · ".join(transform_names(engine, resolved_config(engine))),
        data_line(engine, batches),
        microbatch_line(
            rows=batches.local_batch_size,
            micro_batch_size=engine.micro_batch_size(batches.local_batch_size),
            configured=cfg.train.micro_batch_size,
            schedule=cfg.schedule.name,
            pp=mesh.size("pp"),
        ),
    ]
    if mesh.host_map is not None:
        lines.append(f"nodes: {mesh.host_map.describe()}")
    pipeline = engine.context.pipeline
    if pipeline is not None:
        lines.append(f"pipeline stages: {pipeline.summary}")
    world_size = mesh.world_size
    lines.append(
        f"model FLOPs/token {engine.flops_per_token:,.0f} · peak used for MFU: "
        f"{rank_peak.flops * world_size / 1e9:,.1f} GFLOP/s = {world_size} × "
        f"{rank_peak.flops / 1e9:,.1f} per rank ({rank_peak.source})"
    )
    if engine.device.type == "cpu":
        from plait.daemon.peak_flops import calibration_path

        lines.append(f"CPU peak cached in {calibration_path()}")
    from plait.plugins.checkpoint.config import checkpoint_io_config

    checkpoints = checkpoint_io_config(cfg)
    if checkpoints.dir:
        lines.append(checkpoint_line(checkpoints))
    return lines


def checkpoint_line(settings: CheckpointIOConfig) -> str:
    """Where checkpoints go, how often, and whether the step waits for their writes."""
    when = f"every {settings.every} steps" if settings.every else "at the end"
    how = (
        "asynchronous (the step waits for a host copy of the state; the write runs beside training)"
        if settings.async_save
        else "synchronous (the step waits for the write)"
    )
    keep = f"keep {settings.keep}" if settings.keep else "keep all"
    return f"checkpoints: {when} to {settings.dir} · {how} · {keep}"


def parameters_text(layout: StateLayout, *, pp: int = 1) -> str:
    """The model's parameter count and, where a strategy shards them, what this rank holds.

    Read from the state layout the strategies declare (the source checkpoints and memory
    reports use): under ZeRO-3 `module.parameters()` still has every global shape, so counting
    it would label the model's total as the rank's.
    """
    total = sum(entry.value.global_shape.numel() for entry in layout.parameters)
    held = sum(entry.value.numel() for entry in layout.parameters)
    # A pipeline rank's layout lists its own stage's parameters only.
    scope = " in this stage" if pp > 1 else ""
    if held == total:
        return f"{total:,} parameters{scope}, all on this rank"
    return f"{total:,} parameters{scope}, {held:,} on this rank"


def transform_names(engine: Engine, resolved: dict[str, Any]) -> list[str]:
    """Every strategy and transform the step runs through, with the option that names it."""
    cfg = engine.config
    par = cfg.parallel
    parts = [f"dp strategy {_with_options(par.dp_strategy, resolved)}"]
    for axis in ("tp", "cp", "pp"):
        if engine.mesh.size(axis) > 1:
            parts.append(f"{axis} {_with_options(getattr(par, f'{axis}_strategy'), resolved)}")
    for axis, name in sorted(par.transform_strategies().items()):
        label = {
            "ac": "activation checkpointing",
            "ep": f"expert parallel ep={par.ep}",
            "compile": "compiled blocks",
        }.get(axis, axis)
        parts.append(f"{label} {_with_options(name, resolved)}")
    parts.append(f"schedule {cfg.schedule.name}")
    if cfg.schedule.chosen_by_default and engine.mesh.size("pp") > 1:
        parts[-1] += " (the default with parallel.pp > 1)"
    if cfg.schedule.virtual_stages > 1:
        parts[-1] += f" ({cfg.schedule.virtual_stages} virtual stages)"
    comm = chosen_algorithm(cfg, engine.mesh.host_map)
    parts.append(
        f"comm {comm.name}" + (f" ({comm.reason})" if comm.reason.startswith("default for") else "")
    )
    if cfg.train.max_grad_norm:
        parts.append(f"grad-norm clip {cfg.train.max_grad_norm:g}")
    return parts


# Options worth naming in the banner: a precision's dtype, sequence parallelism, an offload.
_NAMED_OPTIONS = {
    "dtype": lambda v: str(v),
    "sequence_parallel": lambda v: "sequence parallel" if v else "",
    "mode": lambda v: f"{v}",
    "backend": lambda v: f"{v}",  # the compile transform's torch.compile backend
    "offload": lambda v: (
        f"offload to {v['device']}" if isinstance(v, dict) and v.get("device") != "none" else ""
    ),
    # ZeRO across nodes (docs/zero-plus-plus.md).
    "shard_optimizer_across_replicas": lambda v: "optimizer across replicas" if v else "",
    "secondary_shard": lambda v: f"hpZ per {v}" if v != "none" else "",
    "quantize_weights": lambda v: f"qwZ {v}" if v != "none" else "",
    "quantize_gradients": lambda v: f"qgZ {v}" if v != "none" else "",
}


def _with_options(name: str, resolved: dict[str, Any]) -> str:
    section = resolved.get(name)
    if not isinstance(section, dict):
        return name
    shown = [
        text
        for key, describe in _NAMED_OPTIONS.items()
        if key in section and (text := describe(section[key]))
    ]
    return f"{name} ({', '.join(shown)})" if shown else name


def data_line(engine: Engine, batches: TokenBatches) -> str:
    cfg = engine.config
    token_file = batches.token_file
    source = (
        "bundled corpus" if not cfg.data.path else f"{token_file.directory}"
    ) + f" ({token_file.count:,} tokens, {token_file.meta.tokenizer} tokenizer)"
    line = f"data {source} · seq_len {batches.seq_len} · "
    line += f"global batch {batches.global_batch_size} · "
    packing = getattr(batches, "packing", None)
    if packing is None:
        line += f"{batches.num_windows:,} training windows (one token stream, no documents)"
    else:
        masked = "documents masked" if batches.document_mask else "documents NOT masked"
        line += (
            f"{token_file.meta.documents:,} documents packed {packing} into "
            f"{batches.num_windows:,} rows ({batches.padding_fraction:.1%} padding, {masked})"
        )
    if cfg.train.eval_every:
        line += (
            f" · validation every {cfg.train.eval_every} steps on the last "
            f"{cfg.train.eval_fraction:.0%} held out"
        )
    return line


def microbatch_line(
    *, rows: int, micro_batch_size: int, configured: int | None, schedule: str, pp: int
) -> str:
    """How each rank's batch is split, and who decided: `train.micro_batch_size`, or with it
    unset the count chosen for the schedule (`plait.core.microbatch_count`). The dry run
    prints the same line."""
    count, each = max(1, rows // micro_batch_size), min(rows, micro_batch_size)
    line = f"micro-batches: {count} of {each} row{'s' if each != 1 else ''} per rank per step"
    if configured is not None:
        return f"{line} (train.micro_batch_size = {configured})"
    if pp <= 1:
        return f"{line} (train.micro_batch_size unset: the whole batch, no pipeline to fill)"
    return (
        f"{line} (train.micro_batch_size unset: chosen for schedule {schedule} with pp={pp}, "
        "at least 2 x pp when the rows allow)"
    )

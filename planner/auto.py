"""`plait train CONFIG --auto`: the planner's choice written into a config.

`layout_config(layout)` is the config sections that select a layout (degrees, dp strategy and
the dp ranks it shards over, the collectives' algorithm, ZeRO++'s hpZ and codecs, micro-batch,
schedule, recomputation, sequence parallelism); `auto_config(config, world, …)`
plans for the config's model, sequence length and global batch on `world` ranks and returns the
config with the best layout merged in, plus the plan it came from. The codecs (qwZ, qgZ) change
what is computed, so they are planned only when the user allows quantized communication
(`--allow-quantized-comm`, or a config that already names a codec). ZeRO's offload
(`zero.offload.device`) is planned only when no layout fits without it; "nvme" only when the
config names it with a directory (`offload_devices`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from plait.core.errors import ConfigError
from plait.planner.checkpoint_model import checkpoint_plan
from plait.planner.devices import DeviceSpec
from plait.planner.layouts import (
    CODEC_LEVELS,
    FLAT,
    HIERARCHICAL,
    NO_CODEC,
    NO_OFFLOAD,
    PRECISIONS,
    Job,
    Layout,
    SearchSpace,
)
from plait.planner.model_shape import shape_from_config
from plait.planner.search import PlanResult, plan

# The planner's dp algorithms by the `comm.algorithm` that runs them.
COMM_ALGORITHMS = {FLAT: "torch", HIERARCHICAL: "hierarchical"}


def unplanned_algorithm(config: Mapping[str, Any]) -> str:
    """The `comm.algorithm` the config names when it is one the planner does not model (a
    compression or a ring of the user's choice), else "": `--auto` keeps it and plans around it
    as flat data parallelism, rather than replacing the user's choice."""
    named = str((config.get("comm") or {}).get("algorithm") or "")
    return named if named and named not in COMM_ALGORITHMS.values() else ""


def layout_config(layout: Layout, *, keep_algorithm: bool = False) -> dict[str, Any]:
    """The config sections that make the engine run `layout` (`keep_algorithm`: leave
    `comm.algorithm` as the config has it)."""
    transforms: dict[str, str] = {}
    sections: dict[str, Any] = {
        "parallel": {
            "dp": layout.dp,
            "tp": layout.tp,
            "pp": layout.pp,
            "cp": layout.cp,
            "ep": layout.ep,
            "dp_strategy": f"zero{layout.zero}" if layout.zero else "ddp",
        },
        # Named either way: left unset, a run on several nodes picks "hierarchical" itself.
        "comm": {"algorithm": COMM_ALGORITHMS[layout.dp_algorithm]},
        "train": {"micro_batch_size": layout.micro_batch},
        "schedule": {
            "name": layout.schedule if layout.pp > 1 else "accumulate",
            "virtual_stages": layout.virtual_stages,
        },
    }
    if keep_algorithm:
        del sections["comm"]
    if layout.dp_shard:
        sections["parallel"]["dp_shard"] = layout.dp_shard
    # Named either way, so a config's own ZeRO++ knobs do not outlive a plan without them (a
    # stage that does not read one refuses it, `plait.plugins.zero.check_stage_knobs`). The
    # optimizer across replicas is not planned: a config's own stays where it applies.
    sections["zero"] = {
        "secondary_shard": "node" if layout.secondary_shard else "none",
        "quantize_weights": layout.quantize_weights,
        "quantize_gradients": layout.quantize_gradients,
    }
    if layout.quantized:
        sections["zero"]["quantize_block"] = layout.quantize_block
    # Named either way too: the plan's memory and time assume it on or off. A config's own
    # `offload.path` and `io_workers` stay (the sections merge a level deeper).
    sections["zero"]["offload"] = {"device": layout.offload if layout.offloaded else NO_OFFLOAD}
    if layout.zero not in (1, 2) or not layout.dp_shard:
        sections["zero"]["shard_optimizer_across_replicas"] = False
    if layout.recompute != "none":
        transforms["ac"] = "checkpoint"
        sections["checkpoint"] = {"mode": layout.recompute}
    if layout.tp > 1:
        sections["tp"] = {"sequence_parallel": layout.sequence_parallel}
    if transforms:
        sections["parallel"]["transforms"] = transforms
    return sections


def merge_sections(config: Mapping[str, Any], sections: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with `sections` merged in, one level deep (a section's other fields stay)."""
    merged = copy.deepcopy(dict(config))
    for name, values in sections.items():
        current = dict(merged.get(name) or {})
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(current.get(key), dict):
                current[key] = {**current[key], **value}
            else:
                current[key] = value
        merged[name] = current
    return merged


def config_names_a_codec(config: Mapping[str, Any]) -> bool:
    """Whether the config already asks for a ZeRO++ codec: the user's own permission to plan
    quantized communication."""
    zero = config.get("zero") or {}
    fields = ("quantize_weights", "quantize_gradients")
    return any(zero.get(field, NO_CODEC) != NO_CODEC for field in fields)


def quantized_comm_note(layout: Layout) -> str:
    """What a layout's codecs change, e.g. "qwZ int8: weights gathered across nodes within
    absmax/254 of each block of 256" ("" without codecs); docs/zero-plus-plus.md derives the
    bounds."""
    parts = []
    if layout.quantize_weights != NO_CODEC:
        parts.append(
            f"qwZ {layout.quantize_weights}: weights gathered across nodes within "
            f"absmax/{2 * CODEC_LEVELS[layout.quantize_weights]}"
        )
    if layout.quantize_gradients != NO_CODEC:
        parts.append(
            f"qgZ {layout.quantize_gradients}: each other node's gradient partial sum within "
            f"absmax/{2 * CODEC_LEVELS[layout.quantize_gradients]}"
        )
    if not parts:
        return ""
    return "; ".join(parts) + f" of each block of {layout.quantize_block}"


def offload_devices(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Where the plan may offload when nothing fits without: "nvme" when the config names it
    with a directory (the planner cannot choose a drive), else the host memory ("cpu")."""
    offload = dict((config.get("zero") or {}).get("offload") or {})
    return ("nvme",) if offload.get("device") == "nvme" and offload.get("path") else ("cpu",)


def offload_note(candidate: Any) -> str:
    """What an offloaded plan moves and costs, e.g. "optimizer state offloaded to cpu: 100.4
    GiB of host memory per rank, +1.8 s per step of transfers, the optimizer step 4.3 s on
    the CPU" ("" without offload; `candidate` is a `search.Candidate`)."""
    layout, memory, time = candidate.layout, candidate.memory, candidate.time
    if not layout.offloaded:
        return ""
    moved = "optimizer state and parameter shards" if layout.zero >= 3 else "optimizer state"
    note = (
        f"{moved} offloaded to {layout.offload}: {memory.host_total / 2**30:.1f} GiB of host "
        f"memory per rank, +{time.offload:.2f} s per step of transfers, the optimizer step "
        f"{time.optimizer:.2f} s on the CPU"
    )
    if memory.disk_optimizer_state:
        note += f", {memory.disk_optimizer_state / 2**30:.1f} GiB per rank in files"
    return note


def job_for_config(
    config: Mapping[str, Any], *, world: int, per_node: int, device: DeviceSpec
) -> Job:
    from plait.core.config import load_config
    from plait.plugins.models import resolve_model_config

    resolved = load_config(dict(config))
    model = resolved.model
    model_config = resolve_model_config(model.name, model.size, model.overrides)
    # plait's amp keeps fp32 weights and computes in bf16; without it everything is fp32.
    precision = "amp-bf16" if "precision" in resolved.parallel.transforms else "fp32"
    return Job(
        model=shape_from_config(model.name, model_config, name=f"{model.name}:{model.size}"),
        seq_len=resolved.data.seq_len,
        global_batch=resolved.train.global_batch_size,
        world=world,
        per_node=per_node,
        device=device,
        precision=PRECISIONS[precision],
        checkpoint=checkpoint_plan(config),
    )


def auto_config(
    config: Mapping[str, Any],
    *,
    world: int,
    per_node: int,
    device: DeviceSpec,
    space: SearchSpace | None = None,
    allow_quantized_comm: bool = False,
) -> tuple[dict[str, Any], PlanResult]:
    """`config` with the fastest fitting layout for `world` ranks written in; ZeRO++'s codecs
    among the choices only with `allow_quantized_comm` or a config that names one already."""
    job = job_for_config(config, world=world, per_node=per_node, device=device)
    space = space or SearchSpace()
    if allow_quantized_comm or config_names_a_codec(config):
        block = int((config.get("zero") or {}).get("quantize_block", space.quantize_block))
        space = replace(space, quantized_comm=True, quantize_block=block)
    kept = unplanned_algorithm(config)
    if kept:  # the user's algorithm runs the dp collectives: no hierarchical variants
        space = replace(space, hierarchical=False)
    space = replace(space, offload=offload_devices(config))
    result = plan(job, space)
    if not result.ranked:
        smallest = result.smallest_rejected
        hint = ""
        if smallest is not None:
            hint = (
                f"; the smallest, {smallest.layout.describe()}, needs "
                f"{smallest.memory.total / 2**30:.1f} GiB of {device.usable_memory / 2**30:.1f}"
            )
        raise ConfigError(
            f"--auto: no layout of {job.model.name} fits {world} × {device.name}{hint}"
        )
    chosen = layout_config(result.best.layout, keep_algorithm=bool(kept))
    return merge_sections(config, chosen), result


def layout_from_config(
    config: Mapping[str, Any], *, world: int, per_node: int | None = None
) -> Layout:
    """The layout a config runs on `world` ranks (degrees resolved as the engine resolves them).
    With `per_node`, what depends on the nodes is resolved as a launch of `world / per_node`
    nodes would: `dp_shard = "node"`, and the algorithm a config that names none gets."""
    from plait.core.comm_algorithms import chosen_algorithm
    from plait.core.config import load_config
    from plait.core.host_map import HostMap
    from plait.planner.link_traffic import hierarchical_applies

    resolved = load_config(dict(config))
    parallel = resolved.parallel
    tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
    if world % (tp * pp * cp):
        raise ConfigError(f"--world {world} is not divisible by tp·pp·cp = {tp * pp * cp}")
    dp = parallel.dp if parallel.dp > 0 else world // (tp * pp * cp)
    strategy = parallel.dp_strategy
    zero = int(strategy[4:]) if strategy.startswith("zero") and strategy[4:].isdigit() else 0
    per_dp = resolved.train.global_batch_size // dp
    recompute = "none"
    if "ac" in parallel.transforms:
        recompute = str(dict(config).get("checkpoint", {}).get("mode", "full"))
        recompute = "full" if recompute == "every" else recompute
    tp_section = dict(config).get("tp", {})
    host_map = None
    if per_node is not None:
        nodes = max(world // per_node, 1)
        host_map = HostMap.assumed(nodes, min(per_node, world))
    dp_shard = parallel.dp_shard
    if dp_shard == "node":
        if host_map is None:
            raise ConfigError('parallel.dp_shard = "node" needs the ranks per node (--per-node)')
        dp_shard = min(max(host_map.ranks_per_node // (cp * tp), 1), dp)
    dp_shard = 0 if dp_shard is None or dp_shard == dp or not zero else dp_shard
    algorithm = chosen_algorithm(resolved, host_map).name
    dp_algorithm = HIERARCHICAL if algorithm == COMM_ALGORITHMS[HIERARCHICAL] else FLAT
    zero_section = dict(dict(config).get("zero") or {})
    layout = Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=parallel.ep,
        zero=zero,
        dp_shard=dp_shard,
        dp_algorithm=dp_algorithm,
        micro_batch=resolved.train.micro_batch_size or per_dp,
        schedule=resolved.schedule.name if pp > 1 else "accumulate",
        virtual_stages=resolved.schedule.virtual_stages,
        recompute=recompute,
        sequence_parallel=bool(tp_section.get("sequence_parallel", False)) and tp > 1,
        # ZeRO++ as the strategies read it: hpZ in stage 3, the codecs in the stages they apply to
        secondary_shard=zero == 3 and zero_section.get("secondary_shard", "none") == "node",
        quantize_weights=str(zero_section.get("quantize_weights", NO_CODEC)) if zero == 3
        else NO_CODEC,
        quantize_gradients=str(zero_section.get("quantize_gradients", NO_CODEC)) if zero >= 2
        else NO_CODEC,
        quantize_block=int(zero_section.get("quantize_block", 256)),
        # what `plait.plugins.zero` reads; DDP reads no `[zero]` at all
        offload=str(dict(zero_section.get("offload") or {}).get("device", NO_OFFLOAD)) if zero
        else NO_OFFLOAD,
    )  # fmt: skip
    if (
        dp_algorithm == HIERARCHICAL
        and per_node is not None
        and not hierarchical_applies(layout, world=world, per_node=per_node)
    ):
        layout = replace(layout, dp_algorithm=FLAT)  # its dp traffic is the flat rings'
    return layout


def layout_overrides(layout: Layout, *, keep_algorithm: bool = False) -> list[str]:
    """`layout_config(layout)` as `section.field=value` overrides (what `--set` takes)."""
    out = []

    def walk(prefix: str, values: Mapping[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, Mapping):
                walk(f"{prefix}{key}.", value)
            elif isinstance(value, str):
                out.append(f'{prefix}{key}="{value}"')
            else:
                out.append(
                    f"{prefix}{key}={str(value).lower() if isinstance(value, bool) else value}"
                )

    walk("", layout_config(layout, keep_algorithm=keep_algorithm))
    return out


def detect_device(per_node: int) -> DeviceSpec:
    """This node's device as the planner prices it: a CUDA GPU by its name and memory, else
    the CPU from `plait calibrate`'s measured peak (split between the node's ranks)."""
    from dataclasses import replace

    import torch

    from plait.planner.devices import DEVICES, GIB

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        memory = torch.cuda.get_device_properties(0).total_memory
        for spec in DEVICES.values():
            family = spec.name.split("-")[0]
            if family in name and abs(spec.memory_bytes - memory) < 0.15 * spec.memory_bytes:
                return spec
        raise ConfigError(
            f"--auto: no planner device matches {name!r} ({memory / GIB:.0f} GiB); known: "
            f"{', '.join(DEVICES)}"
        )
    import os

    from plait.daemon.peak_flops import host_cpu_calibration

    calibration, _ = host_cpu_calibration()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    base = DEVICES["A100-80GB"]
    return replace(
        base,
        name="cpu",
        memory_bytes=ram / per_node,
        peak_flops=calibration.flops / per_node,
        memory_bandwidth=10e9 / per_node,
        gemm_efficiency=0.8,
        gemm_half_flops=1e8,
        attention_efficiency=0.3,
        host_memory_bytes=None,  # the CPU is its own host: offload to it moves nothing
    )


def auto_overrides(
    config: Any, *, world: int, per_node: int, console: Any, allow_quantized_comm: bool = False
) -> list[str]:
    """For `plait train --auto`: plan `config` (a `PlaitConfig`) on `world` ranks, print the
    choice and the resolved config with it, and return it as overrides for the ranks."""
    from plait.core.config import dump_toml, load_config
    from plait.planner.search import why_slower

    data = config.model_dump(mode="json")
    device = detect_device(per_node)
    merged, result = auto_config(
        data, world=world, per_node=per_node, device=device,
        allow_quantized_comm=allow_quantized_comm,
    )  # fmt: skip
    best = result.best
    console.print(
        f"--auto: {best.layout.describe()} on {world} × {device.name}: predicted "
        f"{best.time.total:.3f} s per step, {best.memory.total / 2**30:.2f} GiB per rank, "
        f"{best.time.cross_node_bytes / 1e9:.2f} GB across nodes "
        f"(of {len(result.ranked)} fitting meshes; next: "
        + "; ".join(f"{c.layout.describe()} ({why_slower(c, best)})" for c in result.ranked[1:3])
        + ")",
        highlight=False,
        markup=False,  # a device's name is the machine's, not plait's
    )
    moved = offload_note(best)
    if moved:
        console.print(
            f"--auto: no layout fits {world} × {device.name} without ZeRO offload: {moved} "
            "(docs/offload.md)",
            highlight=False,
            markup=False,
        )
    note = quantized_comm_note(best.layout)
    if note:
        console.print(
            f"--auto: the plan quantizes what crosses nodes (quantized communication allowed): "
            f"{note} (docs/zero-plus-plus.md)",
            highlight=False,
            markup=False,
        )
    resolved = load_config(merged)
    console.print(
        dump_toml(resolved.model_dump(mode="json")), highlight=False, markup=False, end=""
    )
    return layout_overrides(best.layout, keep_algorithm=bool(unplanned_algorithm(data)))

"""The `zero1`, `zero2` and `zero3` data-parallel strategies (ZeRO, Rajbhandari et al. 2020).

- `zero1` shards the optimizer state: gradients are all-reduced (bucketed, overlapped with
  backward), each rank updates its chunk of the fp32 master parameters, chunks are all-gathered.
- `zero2` also shards gradients: buckets are reduce-scattered during backward and only this
  rank's chunk is kept.
- `zero3` also shards parameters, FSDP-style, one unit per transformer block by default.

`parallel.dp_shard` (HSDP) shards over a `dp_shard` group only and replicates across the
`dp_replicate = dp / dp_shard` groups. Stages 1 and 2 reduce buckets and shard the optimizer
state inside the shard group; stage 3 also gathers parameters there, every micro-batch (inside
a node with `dp_shard = "node"`). All three average the gradient chunks across the replicas
once per optimizer step (FSDP2's HSDP, torchtitan's `dp_replicate × dp_shard`). With
`[zero] shard_optimizer_across_replicas = true` stages 1 and 2 shard the optimizer state over
every dp rank instead (`plait.plugins.zero.replica_shards`).

ZeRO++'s codecs: `quantize_weights = "int8"` (qwZ, stage 3) and `quantize_gradients = "int8" |
"int4"` (qgZ, stages 2 and 3) ask the hierarchical algorithm to encode the cross-node hop of the
parameter all-gather, resp. the gradient reduce-scatter, block-wise with one scale per block
(`plait.plugins.collectives.codecs`); a configuration in which they would encode nothing is
refused.

All three read the `[zero]` section (`plait.plugins.zero.config.ZeroConfig`): bucket size,
stage 3 prefetch depth and unit rule, and offload of the optimizer state to CPU memory or to
files (`offload = {device = "nvme", path = "/local/nvme"}`).

Per-rank model-state bytes for fp32 AdamW with N parameters on d ranks, as held at the optimizer
step (`memory_report()["total"]`): stage 1: 4N params + 4N grads + 8N/d Adam; stage 2: 4N +
12N/d; stage 3: 16N/d plus the units gathered at a time. Stages 2 and 3 release their gradient
shards after the step, as FSDP2 does, so between steps they hold 4N/d less
(`resident_total`).
"""

from __future__ import annotations

from functools import partial

from torch import nn

from plait.core.comm import Group
from plait.core.comm_algorithms import HIERARCHICAL, chosen_algorithm, config_rank_sets
from plait.core.config import PlaitConfig
from plait.core.errors import ConfigError
from plait.core.hookspecs import hookimpl
from plait.core.sharding import ParallelRuntime, ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.plugins.zero.config import OffloadConfig, ZeroConfig
from plait.plugins.zero.offload import check_writable

__all__ = [
    "OffloadConfig",
    "ZeroConfig",
    "plait_configure",
    "plait_register_strategies",
    "plait_shard",
]

SECTION = "zero"
STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
# The `[zero]` knobs that only some stages read, with those stages: set for any other stage (or
# a dp strategy that is not ZeRO, which reads no `[zero]` at all) they would silently do nothing.
STAGE_KNOBS = {
    "quantize_weights": (3,),
    "quantize_gradients": (2, 3),
    "secondary_shard": (3,),
    "shard_optimizer_across_replicas": (1, 2),
}
DESCRIPTIONS = {
    "zero1": "ZeRO-1: sharded optimizer state, bucketed overlapped all-reduce",
    "zero2": "ZeRO-2: sharded optimizer state and gradients, overlapped reduce-scatter",
    "zero3": "ZeRO-3 / FSDP: sharded parameters per block, prefetched all-gather",
}


strategies = Strategies()


def shard_zero(
    model: nn.Module, *, context: ShardContext, config: ZeroConfig, stage: int
) -> Sharded:
    if config.offload.device == "nvme":
        check_writable(config.offload.path)
    # The shard group: dp (times cp under context parallelism), or its dp_shard part under
    # HSDP; the replica group holds the other copies of this rank's shard (one rank if none).
    group, replicas = context.mesh.data_parallel_groups()
    # With ep > 1 expert parameters are reduced and sharded over the expert-dp group
    # (`plait.plugins.zero.groups`), in segments of their own.
    experts = context.expert_parallel
    if replicas.size > 1 and experts is not None and experts.degree > 1:
        raise ConfigError(
            f"parallel.dp_shard = {context.config.parallel.dp_shard!r} (HSDP) with "
            "parallel.ep > 1 is not supported yet; unset one of them"
        )
    if config.shard_optimizer_across_replicas and (stage == 3 or replicas.size == 1):
        raise ConfigError(
            "zero.shard_optimizer_across_replicas = true needs zero1 or zero2 with replicas "
            f"(parallel.dp_shard below dp); got zero{stage} with "
            f"parallel.dp_shard = {context.config.parallel.dp_shard!r} and "
            f"{replicas.size} replica(s)"
        )
    check_stage_knobs(config, f"zero{stage}")
    check_codecs(context, config, stage, group)
    runtime: ParallelRuntime
    if stage == 3:
        from plait.plugins.zero.stage3 import FullyShardedRuntime

        runtime = FullyShardedRuntime(
            model,
            comm=context.comm,
            group=group,
            mesh=context.mesh,
            config=config,
            experts=experts,
            replicas=replicas,
        )
    else:
        from plait.plugins.zero.stage12 import ShardedOptimizerRuntime

        runtime = ShardedOptimizerRuntime(
            model,
            stage=stage,
            comm=context.comm,
            group=group,
            mesh=context.mesh,
            config=config,
            experts=experts,
            replicas=replicas,
        )
    return Sharded(module=model, runtime=runtime)


def _knobs_set(config: ZeroConfig) -> list[tuple[str, object]]:
    """The stage-specific knobs (`STAGE_KNOBS`) this config sets, with their values."""
    defaults = ZeroConfig()
    return [
        (field, getattr(config, field))
        for field in STAGE_KNOBS
        if getattr(config, field) != getattr(defaults, field)
    ]


def check_stage_knobs(config: ZeroConfig, strategy: str) -> None:
    """Refuse a stage-specific `[zero]` knob under `strategy` (`parallel.dp_strategy`) when
    that strategy does not read it; the codecs' own checks (`check_codecs`) come after."""
    stage = STAGES.get(strategy)
    for field, value in _knobs_set(config):
        stages = STAGE_KNOBS[field]
        if stage in stages or (stage is not None and field.startswith("quantize_")):
            continue  # a ZeRO stage with a codec: check_codecs says what it needs
        names = [f"zero{s}" for s in stages]
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise ConfigError(
            f"zero.{field} = {shown} applies to {' and '.join(names)}, not "
            f"parallel.dp_strategy = {strategy!r}, which would ignore it: unset it or choose "
            f"{' or '.join(names)}"
        )


@hookimpl
def plait_configure(config: PlaitConfig) -> None:
    """A dp strategy that is not ZeRO reads no `[zero]` section: refuse its ZeRO++ and
    optimizer-across-replicas knobs rather than run without them."""
    strategy = config.parallel.dp_strategy
    if strategy not in STAGES and SECTION in config.extensions:
        check_stage_knobs(config.section(SECTION, ZeroConfig), strategy)


def check_codecs(context: ShardContext, config: ZeroConfig, stage: int, group: Group) -> None:
    """Refuse a ZeRO++ codec that would encode nothing: every op that asks for one must have a
    cross-node hop that the hierarchical algorithm encodes."""
    asked = [
        (field, codec, stages)
        for field, codec, stages in (
            ("quantize_weights", config.weight_codec, (3,)),
            ("quantize_gradients", config.gradient_codec, (2, 3)),
        )
        if codec is not None
    ]
    if not asked:
        return
    mesh = context.mesh
    algorithm = chosen_algorithm(context.config, mesh.host_map).name
    for field, codec, stages in asked:
        where = f"zero.{field} = {codec!r}"
        if stage not in stages:
            allowed = " and ".join(f"zero{s}" for s in stages)
            raise ConfigError(f"{where} applies to {allowed}, not zero{stage}")
        if algorithm != HIERARCHICAL:
            raise ConfigError(
                f"{where} encodes the cross-node hop of hierarchical collectives; "
                f"comm.algorithm is {algorithm!r}: set it to 'hierarchical'"
            )
        if mesh.host_map is None or mesh.host_map.hierarchy(group.ranks) is None:
            described = mesh.host_map.describe() if mesh.host_map else "unknown"
            raise ConfigError(
                f"{where}: the {group.name} group ({list(group.ranks)}) has no cross-node hop "
                f"to encode (nodes: {described}); under HSDP its collectives stay inside a node"
            )
        # The hierarchical algorithm takes over the dp groups it built sub-groups for at
        # configure time, no other: any other group's ops would run unencoded.
        taken_over = set(config_rank_sets(context.config))
        experts = context.expert_parallel
        groups = [group]
        if experts is not None and experts.degree > 1 and experts.expert_data_group.size > 1:
            groups.append(experts.expert_data_group)
        for other in groups:
            if tuple(other.ranks) not in taken_over:
                raise ConfigError(
                    f"{where}: the hierarchical algorithm encodes the dp groups only, and ZeRO "
                    f"reduces over the {other.name} group ({list(other.ranks)}), which is none "
                    "of them (parallel.cp > 1 makes it dp × cp; parallel.ep > 1 reduces expert "
                    "parameters over the expert-data-parallel group): its ops would run "
                    "unencoded; unset the codec or parallel.cp / parallel.ep"
                )


for _name, _stage in STAGES.items():
    strategies.provide(
        name=_name,
        axis="dp",
        config_cls=ZeroConfig,
        config_section=SECTION,
        description=DESCRIPTIONS[_name],
        # Stages 2 and 3 reduce-scatter gradient buckets (on GPUs, or when forced).
        gradient_collectives=("all_reduce",) if _stage == 1 else ("all_reduce", "reduce_scatter"),
    )(partial(shard_zero, stage=_stage))

plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard

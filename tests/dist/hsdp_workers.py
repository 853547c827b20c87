"""Rank functions for HSDP (`parallel.dp_shard`) on 2 nodes x 2 ranks (torchrun's environment,
Gloo): the tiny Llama under ZeRO-1/2/3, flat and hybrid-sharded, exporting spans to a daemon."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from plait.core.engine import Engine
from plait.core.errors import PlaitError
from plait.core.plugins import Plugins
from plait.plugins.collectives.step_bytes import replica_step_bytes, sharded_step_bytes
from plait.plugins.zero.stage3 import FullyShardedRuntime
from plait.plugins.zero.stage12 import ShardedOptimizerRuntime
from plait.testing.distributed import VOCAB_SIZE, merged_config
from tests.dist.host_workers import as_nodes

STEPS = 3
GLOBAL_BATCH = 8
ZERO_RUNTIMES = (FullyShardedRuntime, ShardedOptimizerRuntime)
MICRO_BATCH = 1  # 2 micro-batches per rank on 4 ranks: the replica all-reduce must stay once


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB_SIZE, (STEPS, GLOBAL_BATCH, 17), generator=generator)


def train_jobs(
    rank: int, world_size: int, nnodes: int, jobs: dict[str, dict[str, Any]], address: str
) -> dict[str, Any]:
    """Train each job (job id -> config overrides); return losses, parameters, the formulas'
    bytes per step for this rank and the mesh's view of the split."""
    if nnodes:
        as_nodes(rank, world_size, nnodes)
    out: dict[str, Any] = {}
    for job_id, job in jobs.items():
        overrides: dict[str, Any] = {
            "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH},
            "telemetry": {"enabled": bool(address), "daemon": address, "job_id": job_id},
            **job,
        }
        engine = Engine(config=merged_config(overrides), plugins=Plugins.create(autoload=False))
        mesh = engine.mesh
        dp, dp_size = mesh.coordinate("dp"), mesh.size("dp")
        share = GLOBAL_BATCH // dp_size
        tokens = _tokens()
        losses, grad_norms = [], []
        for step in range(STEPS):
            batch = tokens[step, dp * share : (dp + 1) * share]
            losses.append(engine.train_step((batch[:, :-1], batch[:, 1:])))
            report = engine.last_report
            grad_norms.append(float("nan") if report is None else report.grad_norm)
        runtime = next((r for r in engine.runtimes if isinstance(r, ZERO_RUNTIMES)), None)
        result: dict[str, Any] = {"losses": losses, "grad_norms": grad_norms}
        gathered = (
            runtime.full_parameters()
            if isinstance(runtime, FullyShardedRuntime)
            else contextlib.nullcontext()
        )
        with gathered:
            params = [p for p in engine.module.parameters() if p.requires_grad]
            result["parameters"] = torch.cat([p.detach().reshape(-1) for p in params])
        if isinstance(runtime, FullyShardedRuntime):
            result.update(_expected_bytes(engine, runtime, share // MICRO_BATCH))
        elif isinstance(runtime, ShardedOptimizerRuntime):
            result.update(_expected_replica_bytes(engine, runtime))
        result["coordinates"] = mesh.coordinates()
        result["shard_group"] = runtime.group.ranks if runtime else ()
        result["replica_group"] = runtime.replicas.ranks if runtime and runtime.replicas else ()
        out[job_id] = result
        del runtime  # holds the process groups that closing the engine destroys
        engine.close()
    return out


def _expected_bytes(engine: Engine, runtime: FullyShardedRuntime, microbatches: int) -> dict:
    """This rank's bytes per step by `plait.plugins.collectives.step_bytes.sharded_step_bytes`:
    forward gathers every unit, backward every unit but the root and the last block (kept gathered)."""
    units = runtime.units
    kept = {id(units[0]), id(units[-1])} if runtime.root is not None else {id(units[-1])}
    padded = [u.segment.padded_numel for u in units]
    gathers = padded + [u.segment.padded_numel for u in units if id(u) not in kept]
    algorithm = engine.config.comm.algorithm or "torch"
    host_map = engine.mesh.host_map
    assert host_map is not None
    expected = sharded_step_bytes(
        engine.mesh.rank,
        shard_group=runtime.group.ranks,
        replica_group=runtime.replicas.ranks if runtime.replicas else (engine.mesh.rank,),
        host_map=host_map,
        gathers=gathers,
        reductions=padded,
        itemsize=4,
        microbatches=microbatches,
        algorithm=algorithm,
    )
    return {
        "expected": (expected.intra_node, expected.inter_node),
        "units": len(units),
        "model_bytes": sum(padded) * 4,
        "microbatches": microbatches,
    }


def _expected_replica_bytes(engine: Engine, runtime: ShardedOptimizerRuntime) -> dict:
    """Stages 1 and 2 with the shard group inside a node: only the once-per-step exchange of
    each bucket's gradient chunk across the replicas leaves it (an all-reduce, or a
    reduce-scatter and an all-gather with the optimizer state sharded across them). Also the
    optimizer state this rank holds and the full state gathered from every rank's shard."""
    host_map = engine.mesh.host_map
    assert host_map is not None and runtime.replicas is not None
    sent = replica_step_bytes(
        engine.mesh.rank,
        replica_group=runtime.replicas.ranks,
        host_map=host_map,
        chunks=[b.segment.chunk_numel for b in runtime.buckets],
        itemsize=4,
        optimizer_across_replicas=runtime.replica_shards is not None,
    )
    report = runtime.memory_report()
    assert report is not None
    state = runtime.state_dict()["state"]
    keys = ("exp_avg", "exp_avg_sq")
    moments = [state[name][key].reshape(-1) for name in sorted(state) for key in keys]
    return {
        "expected": (None, sent.inter_node),
        "units": len(runtime.buckets),
        "model_bytes": sum(b.segment.padded_numel for b in runtime.buckets) * 4,
        "optimizer_state": report["optimizer_state"],
        "moments": torch.cat(moments),
    }


def refused_split(rank: int, world_size: int, nnodes: int, dp_shard: int | str) -> str:
    """Build a zero3 engine with `dp_shard` on `nnodes` nodes; return the error it raised."""
    as_nodes(rank, world_size, nnodes)
    parallel = {"dp_strategy": "zero3", "dp_shard": dp_shard}
    config = merged_config({"parallel": parallel, "telemetry": {"enabled": False}})
    try:
        Engine(config=config, plugins=Plugins.create(autoload=False)).close()
    except PlaitError as error:
        return str(error)
    return ""


def checkpoint_round(
    rank: int,
    world_size: int,
    ckpt_dir: str,
    stop_at: int,
    save_at: tuple[int, ...],
    resume: bool,
    parallel: dict[str, Any],
    dp_strategy: str = "zero3",
    zero: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`checkpoint_workers.train_and_checkpoint` under `dp_strategy` with `parallel` (dp_shard
    or not) and `zero`, also returning what this rank writes: the chunks of every tensor the
    checkpoint takes from it, and the axes the parameters are declared replicated over."""
    from plait.core.state_chunks import first_replica, layout_for, tensor_pieces
    from tests.dist.checkpoint_workers import train_and_checkpoint

    result = train_and_checkpoint(
        rank, world_size, ckpt_dir, stop_at, save_at, resume, False, parallel, dp_strategy, zero
    )
    config = merged_config(
        {
            "parallel": {"dp_strategy": dp_strategy, **parallel},
            "zero": zero or {},
            "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2},
            "telemetry": {"enabled": False},
        }
    )
    engine = Engine(config=config, plugins=Plugins.create(autoload=False))
    rows = _tokens()[0, :2]
    engine.train_step((rows[:, :-1], rows[:, 1:]))  # so that optimizer state exists
    layout, is_writer = layout_for(engine), first_replica(engine)
    written = 0
    replicated: set[tuple[str, ...]] = set()
    for entry in layout.parameters:
        replicated.add(entry.value.replicated_over)
        tensors = [entry.value, *entry.optimizer_state.values()]
        for tensor in tensors:
            pieces = tensor_pieces(tensor, is_writer=is_writer)
            written += sum(chunk.tensor.numel() for chunk in pieces.chunks)
    engine.close()
    return {**result, "written": written, "replicated_over": sorted(replicated)}


def checkpoint_rounds(
    rank: int, world_size: int, rounds: tuple[dict[str, Any], ...]
) -> list[dict[str, Any]]:
    """`checkpoint_round` once per entry of `rounds` (its keyword arguments), one after the
    other in the same ranks: several checkpoints for the price of one spawn."""
    return [checkpoint_round(rank, world_size, **arguments) for arguments in rounds]


def resume_each(rank: int, world_size: int, ckpt_dirs: tuple[str, ...]) -> list[dict[str, Any]]:
    """Resume every checkpoint of `ckpt_dirs` under plain data parallelism and train to step 5."""
    from tests.dist.checkpoint_workers import train_and_checkpoint

    return [train_and_checkpoint(rank, world_size, d, 5, (), True) for d in ckpt_dirs]

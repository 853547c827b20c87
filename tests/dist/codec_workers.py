"""Rank functions for ZeRO++ (codecs, hpZ) on 2 nodes x 2 ranks (torchrun's environment, Gloo):
the hierarchical all-gather and reduce-scatter with an int8 / int4 cross-node hop against the exact
ops, and the tiny Llama under ZeRO-3 with `quantize_weights`, `quantize_gradients` and
`secondary_shard`."""

from __future__ import annotations

from typing import Any

import torch

from plait.core.comm import QUANTIZE, QUANTIZE_BLOCK
from plait.core.engine import Engine
from plait.core.errors import ConfigError
from plait.core.plugins import Plugins
from plait.plugins.collectives import CollectivesPlugin
from plait.plugins.collectives.codecs import codec_named
from plait.plugins.collectives.step_bytes import encoded_bytes
from plait.plugins.zero.stage3 import FullyShardedRuntime
from plait.testing.distributed import merged_config
from tests.dist.host_workers import as_nodes
from tests.dist.hsdp_workers import GLOBAL_BATCH, STEPS, _tokens

BLOCK = 64
CHUNK = 1001  # per rank: 15.6 blocks, so the last block of every chunk is padded
RS = {"gradient_reduction": "reduce_scatter"}
JOBS: dict[str, dict[str, Any]] = {
    "exact": {"zero": RS},
    "int8": {"zero": {"quantize_weights": "int8", "quantize_gradients": "int8"}},
    "int4": {"zero": {"quantize_gradients": "int4"}},
    # hpZ: backward gathers from the node's secondary shards, exactly.
    "hpz": {"zero": {**RS, "secondary_shard": "node"}},
}


def _source(rank: int, numel: int, salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    # Blocks of very different magnitudes: a scale per block, not per tensor, is what keeps
    # the small ones accurate.
    return torch.randn(numel, generator=generator) * torch.logspace(-3, 1, numel)


def codec_ops(engine: Engine, runtime: FullyShardedRuntime) -> dict[str, Any]:
    """The dp group's (2 nodes x 2) quantized all-gather and reduce-scatters against the exact
    ops on the same inputs: errors and the derived bound per element."""
    comm, group = engine.comm, runtime.group
    rank, n = engine.mesh.rank, group.size
    me = group.rank_of(rank)
    host_map = engine.mesh.host_map
    assert host_map is not None
    nodes = [tuple(r for r in group.ranks if host_map.node_of(r) == v) for v in (0, 1)]
    out: dict[str, Any] = {}

    int8 = codec_named("int8", BLOCK)
    source = _source(rank, CHUNK, 1)
    exact, coded = torch.empty(n * CHUNK), torch.empty(n * CHUNK)
    comm.all_gather(exact, source, group=group)
    attributes = {QUANTIZE: "int8", QUANTIZE_BLOCK: BLOCK}
    comm.all_gather(coded, source, group=group, attributes=attributes)
    # One hop: every rank's chunk within half a step of its own block's scale.
    bound = torch.cat([int8.error_bound(_source(r, CHUNK, 1)) for r in group.ranks])
    out["all_gather"] = ((coded - exact).abs(), bound, coded)

    for name, op in (("int8", "sum"), ("int4", "avg")):
        codec = codec_named(name, BLOCK)
        sources = {r: _source(r, n * CHUNK, 2) for r in group.ranks}
        exact, coded = torch.empty(CHUNK), torch.empty(CHUNK)
        comm.reduce_scatter(exact, sources[rank], group=group, op=op)
        attributes = {QUANTIZE: name, QUANTIZE_BLOCK: BLOCK}
        comm.reduce_scatter(coded, sources[rank], group=group, op=op, attributes=attributes)
        # Each other node's partial sum of this rank's chunk crosses once, encoded.
        mine = slice(me * CHUNK, (me + 1) * CHUNK)
        bound = torch.zeros(CHUNK)
        for node in nodes:
            if rank not in node:
                bound += codec.error_bound(sum(sources[r][mine] for r in node))
        if op == "avg":
            bound /= n
        out[f"reduce_scatter_{name}"] = ((coded - exact).abs(), bound, coded)
    return out


def _collectives(engine: Engine) -> CollectivesPlugin:
    found = [p for p in engine.plugins.manager.get_plugins() if isinstance(p, CollectivesPlugin)]
    assert len(found) == 1, found
    return found[0]


def _expected_inter(engine: Engine, runtime: FullyShardedRuntime, job: str) -> int:
    """Cross-node bytes per step of this rank: each micro-batch's gathers (all units forward,
    all but the root and the last block backward) and reduce-scatters, each sending one
    encoded (or plain fp32) chunk to the other node (m − 1 = 1)."""
    units = runtime.units
    kept = {id(units[0]), id(units[-1])} if runtime.root is not None else {id(units[-1])}
    chunks = [u.segment.chunk_numel for u in units]
    backward = [] if job == "hpz" else [u.segment.chunk_numel for u in units if id(u) not in kept]
    gathered = chunks + backward
    weights, gradients = {"int8": (8, 8), "int4": (32, 4)}.get(job, (32, 32))

    def sent(numel: int, bits: int) -> int:
        return numel * 4 if bits == 32 else encoded_bytes(numel, bits=bits, block=256)

    microbatches = GLOBAL_BATCH // engine.mesh.size("dp")
    per_microbatch = sum(sent(c, weights) for c in gathered) + sum(
        sent(c, gradients) for c in chunks
    )
    return microbatches * per_microbatch


def refused(overrides: dict[str, Any]) -> str:
    """Build a ZeRO engine with `overrides`; return the configuration error it raised."""
    try:
        Engine(config=merged_config(overrides), plugins=Plugins.create(autoload=False)).close()
    except ConfigError as error:
        return str(error)
    return ""


def train_codecs(rank: int, world_size: int, address: str) -> dict[str, Any]:
    """The op checks, then each job of `JOBS` trained for `STEPS` steps under ZeRO-3 with
    hierarchical collectives: losses, the gathered (decoded) and exact parameters, the counts
    of encoded and unencoded requests, and the formulas' cross-node bytes per step."""
    as_nodes(rank, world_size, 2)
    # Under context parallelism ZeRO reduces over dp × cp, a group the hierarchical algorithm
    # does not take over (it builds the dp groups' hierarchies): a codec would encode nothing.
    cp = {"parallel": {"dp_strategy": "zero3", "cp": 2}, "comm": {"algorithm": "hierarchical"}}
    out: dict[str, Any] = {
        "refused_under_cp": refused({**cp, "zero": {"quantize_gradients": "int8"}}),
    }
    for job_id, job in JOBS.items():
        overrides: dict[str, Any] = {
            "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1},
            "telemetry": {"enabled": bool(address), "daemon": address, "job_id": job_id},
            "parallel": {"dp_strategy": "zero3"},
            "comm": {"algorithm": "hierarchical"},
            **job,
        }
        engine = Engine(config=merged_config(overrides), plugins=Plugins.create(autoload=False))
        runtime = next(r for r in engine.runtimes if isinstance(r, FullyShardedRuntime))
        if job_id == "exact":
            out["ops"] = codec_ops(engine, runtime)
        dp, share = engine.mesh.coordinate("dp"), GLOBAL_BATCH // engine.mesh.size("dp")
        tokens = _tokens()
        losses = []
        for step in range(STEPS):
            batch = tokens[step, dp * share : (dp + 1) * share]
            losses.append(engine.train_step((batch[:, :-1], batch[:, 1:])))
        exact = []
        for unit in runtime.units:
            whole = torch.empty(unit.segment.padded_numel)
            engine.comm.all_gather(whole, unit.shard.float(), group=runtime.group)
            exact.append(whole)
        with runtime.full_parameters():
            gathered = [unit.full.detach().float().clone() for unit in runtime.units]
            params = [p for p in engine.module.parameters() if p.requires_grad]
            parameters = torch.cat([p.detach().reshape(-1) for p in params])
        plugin = _collectives(engine)
        out[job_id] = {
            "losses": losses,
            "parameters": parameters,
            "gathered": gathered,
            "exact": exact,
            "encoded": dict(plugin.encoded),
            "unencoded": dict(plugin.unencoded),
            "expected_inter": _expected_inter(engine, runtime, job_id),
        }
        del runtime, plugin
        engine.close()
    return out

"""The toolkit communication-algorithm plugins share: purposes, request binding and overlap.

An algorithm plugin (ring/tree all-reduce, gradient compression, a parameter server, or a third
party's) answers `plait_communicate` for the requests it takes over and carries each one out as
smaller *sub-ops* issued through the `Comm` that issued the request (`issuer_of`), so telemetry
and byte counters see the real traffic. Sub-ops carry a purpose of their own,
`sub_purpose(algorithm, parent)` = `"<algorithm>/<parent>"`; `is_sub_op` tells any plugin not to
take them over again.

Overlap. The data-parallel strategies issue gradient reductions asynchronously from the backward
pass and wait for them at the gradient-sync boundary. An algorithm keeps that overlap by handing
its steps to `AlgorithmRunner.run`, which returns a `Work` at once and carries the steps out on
one background worker thread per group, in issue order (a FIFO, so every rank runs the same ops
in the same order). The worker issues its sub-ops on a *dedicated* process group that mirrors the
request's group: two threads issuing collectives on one Gloo process group can interleave
differently on different ranks (Gloo numbers collectives per group as they are enqueued), and an
algorithm's point-to-point steps must not be matched against another thread's messages. Creating
a process group is collective over the whole world, so `AlgorithmRunner.dedicate_groups` runs in
`plait_configure`, on every rank, in the same order. A request on a group without a dedicated
mirror runs on the calling thread and is complete when the hook returns.

Carried by. An algorithm that takes a request over says so with `mark_carried_by(request,
name)` before it returns from the hook (the default implementation marks what reaches it), so
telemetry can apply the algorithm's byte model (`plait.core.link_bytes`) to the op's span and
count the bytes of the ops that reached the backend as the bytes on the wire.

Hierarchical by default. With `comm.algorithm` left unset, a world whose host map has several
nodes holding several ranks each runs the "hierarchical" algorithm (`chosen_algorithm`); a
named algorithm, "torch" included, is always taken as named.

Completion rule: a request with `async_op=True` may return unfinished work whose `wait()`
completes it; a request with `async_op=False` is complete when the hook returns.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.core.comm import CARRIED_BY, Comm, CompletedWork, Group, Work
from plait.core.config import PlaitConfig
from plait.core.errors import PluginError
from plait.core.host_map import HostMap
from plait.core.mesh import MESH_AXES
from plait.core.parallel_dims import resolve_degrees
from plait.core.records import CommRequest

__all__ = [
    "ACTIVATION",
    "ACTIVATION_GRAD",
    "BARRIER",
    "CP_A2A",
    "CP_KV",
    "GENERIC",
    "GRADIENT_PURPOSES",
    "GRAD_BUCKET",
    "GRAD_NORM",
    "GRAD_SHARD",
    "HIERARCHICAL",
    "LOSS_SCALE",
    "METRICS",
    "MOE_AUX_LOSS",
    "MOE_COMBINE",
    "MOE_DISPATCH",
    "NONFINITE_CHECK",
    "OPTIMIZER_STATE",
    "PARAM_GATHER",
    "PARAM_SYNC",
    "PURPOSES",
    "TP_ACTIVATION",
    "TP_GRAD",
    "AlgorithmChoice",
    "AlgorithmRunner",
    "AlgorithmWork",
    "CommBinding",
    "axis_rank_sets",
    "chosen_algorithm",
    "group_of",
    "is_sub_op",
    "issuer_of",
    "mark_carried_by",
    "reduce_scatter_by_all_reduce",
    "sub_purpose",
]

log = logging.getLogger("plait.comm")

# -- purposes: what an op is for (`CommRequest.purpose`) ------------------------------------------

GRAD_BUCKET = "grad_bucket"  # a data-parallel gradient bucket (DDP, ZeRO): all-reduce or r-s
GRAD_SHARD = "grad_shard"  # a gradient shard reduced on its own
PARAM_GATHER = "param_gather"  # ZeRO/FSDP all-gather of parameter shards
PARAM_SYNC = "param_sync"  # broadcast of the initial parameters
OPTIMIZER_STATE = "optimizer_state"  # gathering sharded optimizer state (checkpoints)
ACTIVATION = "activation"  # pipeline send/recv of activations
ACTIVATION_GRAD = "activation_grad"  # pipeline send/recv of activation gradients
TP_ACTIVATION = "tp_activation"  # tensor/sequence-parallel collectives inside forward/backward
TP_GRAD = "tp_grad"  # summing replicated parameters' gradients over tp
CP_KV = "cp_kv"  # context-parallel ring: K/V blocks (and their gradients) passed around
CP_A2A = "cp_a2a"  # context-parallel Ulysses: all-to-all between sequence and head shards
MOE_DISPATCH = "moe_dispatch"  # expert parallel: tokens (and token counts) to their experts' rank
MOE_COMBINE = "moe_combine"  # expert parallel: expert outputs back to the tokens' rank
MOE_AUX_LOSS = "moe_aux_loss"  # router logits gathered for a load-balancing loss over all ranks
METRICS = "metrics"  # loss and other reported values
GRAD_NORM = "grad_norm"  # the global gradient norm for clipping
LOSS_SCALE = "loss_scale"  # the fp16 loss scaler's inf/nan vote
NONFINITE_CHECK = "nonfinite_check"  # the NaN/Inf guard's vote (plugins/resilience)
HEAL = "heal"  # fault tolerance: a healing group moving a live peer's state among its ranks
GRAD_SPLIT = "grad_split"  # fault tolerance: gradients into / out of the layout-free split
BARRIER = "barrier"
GENERIC = "generic"  # the default when a caller names none

GRADIENT_PURPOSES = frozenset({GRAD_BUCKET, GRAD_SHARD})
PURPOSES = frozenset(
    {
        GRAD_BUCKET,
        GRAD_SHARD,
        PARAM_GATHER,
        PARAM_SYNC,
        OPTIMIZER_STATE,
        ACTIVATION,
        ACTIVATION_GRAD,
        TP_ACTIVATION,
        TP_GRAD,
        CP_KV,
        CP_A2A,
        MOE_DISPATCH,
        MOE_COMBINE,
        MOE_AUX_LOSS,
        METRICS,
        GRAD_NORM,
        LOSS_SCALE,
        NONFINITE_CHECK,
        HEAL,
        GRAD_SPLIT,
        BARRIER,
        GENERIC,
    }
)


def sub_purpose(algorithm: str, parent: str) -> str:
    """The purpose of the sub-ops `algorithm` issues on behalf of a `parent`-purpose op."""
    return f"{algorithm}/{parent}"


def is_sub_op(purpose: str) -> bool:
    """Whether `purpose` tags a sub-op some algorithm issued (never to be taken over again)."""
    return "/" in purpose


def mark_carried_by(request: CommRequest, algorithm: str) -> None:
    """Record that `algorithm` carries `request` out (call it when taking the request over)."""
    request.attributes[CARRIED_BY] = algorithm


# -- which algorithm runs -------------------------------------------------------------------------

HIERARCHICAL = "hierarchical"


@dataclass(frozen=True, slots=True)
class AlgorithmChoice:
    """The communication algorithm a job runs, and why (what the banner says)."""

    name: str
    reason: str  # "comm.algorithm" or how the default was chosen


def chosen_algorithm(config: PlaitConfig, host_map: HostMap | None) -> AlgorithmChoice:
    """`comm.algorithm` when the config names one; otherwise "hierarchical" when the host map
    has several nodes with several ranks each (and "torch", the flat op, when it has not)."""
    if "algorithm" in config.comm.model_fields_set:
        return AlgorithmChoice(config.comm.algorithm, "comm.algorithm")
    if host_map is not None and host_map.num_nodes > 1:
        per_node = {len(r) for r in host_map.ranks_of_node}
        if min(per_node) > 1:
            return AlgorithmChoice(
                HIERARCHICAL,
                f"default for {host_map.num_nodes} nodes with several ranks each; "
                'comm.algorithm = "torch" for the flat ops',
            )
    return AlgorithmChoice(config.comm.algorithm, "default")


# -- binding a request back to a group and an issuer ----------------------------------------------


def group_of(request: CommRequest) -> Group:
    """The `Group` a request was issued on, rebuilt from its fields."""
    return Group(name=request.group_name, ranks=request.group_ranks, process_group=request.group)


def issuer_of(request: CommRequest, fallback: Comm | None = None, *, plugin: str = "") -> Comm:
    """The `Comm` that issued `request` (sub-ops go through it), else `fallback`."""
    comm = request.issuer if isinstance(request.issuer, Comm) else fallback
    if comm is None:
        raise PluginError(
            f"{plugin or 'a comm algorithm'} was asked to carry out {request.op!r} but has no "
            "Comm to issue its sub-ops through; issue the request through plait.core.comm.Comm "
            "or call bind(comm) on the plugin object"
        )
    return comm


class CommBinding:
    """Base for algorithm plugins: `comm_for(request)` is the request's issuer, or the `Comm`
    given to `bind` for requests built by hand (tests)."""

    plugin_name = "comm algorithm"

    def __init__(self) -> None:
        self.comm: Comm | None = None

    def bind(self, comm: Comm) -> None:
        self.comm = comm

    def comm_for(self, request: CommRequest) -> Comm:
        return issuer_of(request, self.comm, plugin=self.plugin_name)


# -- which groups get a dedicated mirror ----------------------------------------------------------


def axis_rank_sets(degrees: Mapping[str, int], axis: str) -> list[tuple[int, ...]]:
    """Every group of mesh axis `axis`, as global ranks, for the mesh `plait.core.mesh` builds
    (row-major over `MESH_AXES`, like `init_device_mesh`)."""
    shape = [degrees[a] for a in MESH_AXES]
    grid = torch.arange(math.prod(shape)).reshape(shape)
    rows = grid.movedim(MESH_AXES.index(axis), -1).reshape(-1, degrees[axis])
    return [tuple(int(r) for r in row) for row in rows]


def config_rank_sets(config: PlaitConfig, axes: Sequence[str] = ("dp",)) -> list[tuple[int, ...]]:
    """The groups of `axes` for the mesh `config` gives on the current world."""
    par = config.parallel
    degrees = resolve_degrees(dist.get_world_size(), dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp)
    return [ranks for axis in axes for ranks in axis_rank_sets(degrees, axis)]


# -- overlap: asynchronous work on a worker thread per group --------------------------------------


class AlgorithmWork:
    """A `Work` whose `wait()` blocks until the algorithm's steps have run (and re-raises their
    error on the caller's thread)."""

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def wait(self) -> bool:
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future[None]:
        """A torch future completed with the steps (telemetry times the op's end with it)."""
        result: torch.futures.Future[None] = torch.futures.Future()

        def settle(done: Future[Any]) -> None:
            error = done.exception()
            if error is None:
                result.set_result(None)
            else:
                result.set_exception(error)

        self._future.add_done_callback(settle)
        return result


@dataclass(slots=True)
class _Channel:
    group: Group  # the dedicated mirror the worker issues sub-ops on
    worker: ThreadPoolExecutor


Steps = Callable[[Comm, Group], None]


class AlgorithmRunner:
    """Runs an algorithm's steps for a request: on the group's worker thread, or inline.

    `steps(comm, group)` carries the op out, issuing sub-ops through `comm` on `group` (the
    dedicated mirror when the request runs on a worker, else the request's own group).
    """

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self._channels: dict[tuple[int, ...], _Channel] = {}
        self._dedicated: set[tuple[int, ...]] = set()  # on every rank, member or not
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def dedicate_groups(self, rank_sets: Iterable[Sequence[int]]) -> None:
        """Create a mirror process group for each rank set (collective over the world: every
        rank calls this with the same rank sets in the same order). Sets of one rank, and sets
        already dedicated, are skipped on every rank alike."""
        if not dist.is_initialized():
            return
        me = dist.get_rank()
        for ranks in (tuple(r) for r in rank_sets):
            if len(ranks) < 2 or ranks in self._dedicated:
                continue
            self._dedicated.add(ranks)
            process_group = dist.new_group(list(ranks))
            if me not in ranks:
                continue
            name = f"{self.algorithm}[{','.join(map(str, ranks))}]"
            self._channels[ranks] = _Channel(
                group=Group(name=name, ranks=ranks, process_group=process_group),
                worker=ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"plait-{name}"),
            )

    def dedicate_for(self, config: PlaitConfig, axes: Sequence[str] = ("dp",)) -> None:
        """`dedicate_groups` for the groups of `axes` in the mesh `config` describes; call it
        from `plait_configure` (the engine configures every rank at the same point)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.dedicate_groups(config_rank_sets(config, axes))

    def has_worker(self, ranks: Sequence[int]) -> bool:
        return tuple(ranks) in self._channels

    def run(self, request: CommRequest, steps: Steps, comm: Comm) -> Work:
        """Carry `request` out with `steps`; honours the completion rule (see module doc)."""
        channel = self._channels.get(request.group_ranks)
        if channel is None:
            if request.async_op:
                self._warn_once(request)
            steps(comm, group_of(request))
            return CompletedWork()
        device = next((t.device for t in request.tensors), None)
        work = AlgorithmWork(channel.worker.submit(_on_device, device, steps, comm, channel.group))
        if not request.async_op:
            work.wait()
        return work

    def call(self, ranks: Sequence[int], steps: Steps, comm: Comm, group: Group) -> None:
        """Run `steps` synchronously after everything queued for `ranks` (e.g. a final drain)."""
        channel = self._channels.get(tuple(ranks))
        if channel is None:
            steps(comm, group)
        else:
            channel.worker.submit(steps, comm, channel.group).result()

    def close(self) -> None:
        """Finish queued work and stop the workers (the dedicated groups stay valid)."""
        for channel in self._channels.values():
            channel.worker.shutdown(wait=True)
        self._channels.clear()

    def _warn_once(self, request: CommRequest) -> None:
        with self._lock:
            if request.group_name in self._warned:
                return
            self._warned.add(request.group_name)
        log.warning(
            "comm algorithm %r: group %s%s has no dedicated process group, so its asynchronous "
            "%s ops run on the calling thread (no overlap); dedicate it in plait_configure",
            self.algorithm,
            request.group_name,
            list(request.group_ranks),
            request.purpose,
        )


def _on_device(device: torch.device | None, steps: Steps, comm: Comm, group: Group) -> None:
    # A worker thread starts on the default CUDA device: run where the tensors live.
    if device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            steps(comm, group)
    else:
        steps(comm, group)


# -- reduce-scatter carried out by an algorithm's all-reduce --------------------------------------


def reduce_scatter_by_all_reduce(
    request: CommRequest, group: Group, all_reduce: Callable[[torch.Tensor], None]
) -> None:
    """Carry out a `reduce_scatter` request as `all_reduce(copy of the input)` and keep this
    rank's chunk: how an all-reduce algorithm serves ZeRO's reduce-scatter path. Moves the bytes
    of an all-reduce (what the Gloo path does anyway) and leaves the input untouched."""
    output, source = request.tensors
    reduced = source.detach().clone()
    all_reduce(reduced)
    me = group.rank_of(dist.get_rank())
    chunk = reduced.view(-1)[me * output.numel() : (me + 1) * output.numel()]
    output.copy_(chunk.view(output.shape))

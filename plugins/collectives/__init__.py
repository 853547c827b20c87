"""Collective algorithms: ring and recursive halving-doubling all-reduce over point-to-point ops,
and hierarchical collectives over intra- and cross-node groups.

Selected with `[comm] algorithm = "ring"`, `"tree"` or `"hierarchical"` (the default on a host
map of several nodes with several ranks each: `plait.core.comm_algorithms.chosen_algorithm`),
options in `[comm.ring]` / `[comm.tree]` / `[comm.hierarchical]`
(`plait.plugins.collectives.config`). When selected, the plugin takes over every `all_reduce`
and every gradient `reduce_scatter` (ZeRO-2/3's path on GPU) — or only those whose purpose is
listed in `purposes` — and carries it out as send/recv steps through the issuing `Comm`, which
is how a third party can swap the backend's collective for its own algorithm without touching
any strategy. The hierarchical algorithm takes over all-reduces, reduce-scatters and all-gathers
of the dp groups that span nodes (`plait.plugins.collectives.hierarchical`), whose sub-groups it
creates at configure time.

Asynchronous requests (gradient buckets) return at once: the steps run on the group's worker
thread over a dedicated process group (`plait.core.comm_algorithms.AlgorithmRunner`), so the
backward pass keeps running while buckets reduce. Synchronous requests are complete on return.

A request that asks for a codec (`attributes[QUANTIZE]`, ZeRO++'s qwZ and qgZ: the zero
plugin's `quantize_weights` / `quantize_gradients`) has its cross-node hop encoded by the
hierarchical algorithm (`plait.plugins.collectives.codecs`). One that reaches no encoding (no
hierarchy for its group, another algorithm, an op with no encoded form) runs unencoded, is
counted in `CollectivesPlugin.unencoded` by purpose and reason, and is logged the first time.

`make_plugin()` returns a fresh plugin object per plugin manager (one per engine).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
from pydantic import BaseModel

from plait.core.comm import QUANTIZE, QUANTIZE_BLOCK, Comm, Group, Work
from plait.core.comm_algorithms import (
    GRADIENT_PURPOSES,
    HIERARCHICAL,
    AlgorithmRunner,
    CommBinding,
    Steps,
    chosen_algorithm,
    config_rank_sets,
    is_sub_op,
    mark_carried_by,
    reduce_scatter_by_all_reduce,
    sub_purpose,
)
from plait.core.config import PlaitConfig
from plait.core.hookspecs import hookimpl
from plait.core.host_map import learn_host_map
from plait.core.records import CommAlgorithmRecord, CommRequest
from plait.plugins.collectives.codecs import Codec, codec_named
from plait.plugins.collectives.config import HierarchicalConfig, RingConfig, TreeConfig
from plait.plugins.collectives.hierarchical import (
    HierarchyGroups,
    create_hierarchies,
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
)
from plait.plugins.collectives.ring import ring_all_reduce, ring_reduce_scatter
from plait.plugins.collectives.tree import halving_doubling_all_reduce

__all__ = ["CollectivesPlugin", "HierarchicalConfig", "RingConfig", "TreeConfig", "make_plugin"]

Options = RingConfig | TreeConfig | HierarchicalConfig
CONFIG_CLASSES: dict[str, type[Options]] = {
    "ring": RingConfig,
    "tree": TreeConfig,
    HIERARCHICAL: HierarchicalConfig,
}
HIERARCHICAL_OPS = ("all_reduce", "reduce_scatter", "all_gather")
ENCODED_OPS = ("reduce_scatter", "all_gather")
log = logging.getLogger(__name__)


class CollectivesPlugin(CommBinding):
    """Answers `plait_communicate` for all-reduces (and gradient reduce-scatters) when
    `comm.algorithm` is ring or tree, and for the collectives of groups spanning nodes when it
    is hierarchical."""

    plugin_name = "collectives"

    def __init__(self, algorithm: str = "torch", options: BaseModel | None = None) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.options: Options = options if isinstance(options, Options) else self._defaults()
        self.runner = AlgorithmRunner(algorithm)
        # Hierarchical: the sub-groups of each group that spans nodes, by the group's ranks.
        self.hierarchies: dict[tuple[int, ...], HierarchyGroups] = {}
        # Requests that asked for a codec and ran unencoded: (purpose, reason) -> count.
        self.unencoded: Counter[tuple[str, str]] = Counter()
        # Requests whose cross-node hop was encoded: (purpose, codec) -> count.
        self.encoded: Counter[tuple[str, str]] = Counter()

    def _defaults(self) -> Options:
        return CONFIG_CLASSES.get(self.algorithm, RingConfig)()

    @hookimpl
    def plait_configure(self, config: PlaitConfig) -> None:
        # Learning the host map is collective on first use (every rank configures at the same
        # point); the mesh has learned it already when an engine runs.
        named = "algorithm" in config.comm.model_fields_set
        host_map = None if named and config.comm.algorithm != HIERARCHICAL else learn_host_map()
        self.algorithm = chosen_algorithm(config, host_map).name
        if self.algorithm not in CONFIG_CLASSES:
            return
        self.options = config.comm.options(self.algorithm, CONFIG_CLASSES[self.algorithm])
        self.runner = AlgorithmRunner(self.algorithm)
        self.runner.dedicate_for(config)
        if host_map is not None and self.algorithm == HIERARCHICAL and dist.is_initialized():
            self.hierarchies = create_hierarchies(config_rank_sets(config), host_map)

    @hookimpl
    def plait_register_comm_algorithms(self) -> Sequence[CommAlgorithmRecord]:
        return [
            CommAlgorithmRecord(
                name="ring",
                ops=("all_reduce", "reduce_scatter"),
                config_cls=RingConfig,
                description="ring reduce-scatter + all-gather over send/recv",
            ),
            CommAlgorithmRecord(
                name="tree",
                ops=("all_reduce", "reduce_scatter"),
                config_cls=TreeConfig,
                description="recursive halving-doubling (Rabenseifner) over send/recv",
            ),
            CommAlgorithmRecord(
                name=HIERARCHICAL,
                ops=HIERARCHICAL_OPS,
                config_cls=HierarchicalConfig,
                description="inside the node, across nodes, inside again (host map)",
            ),
        ]

    def takes_over(self, request: CommRequest) -> bool:
        if self.algorithm not in CONFIG_CLASSES or is_sub_op(request.purpose):
            return False
        if self.algorithm == HIERARCHICAL:
            wanted = request.op in HIERARCHICAL_OPS and request.group_ranks in self.hierarchies
        elif request.op == "reduce_scatter":
            wanted = request.purpose in GRADIENT_PURPOSES
        else:
            wanted = request.op == "all_reduce"
        purposes = self.options.purposes
        return wanted and (not purposes or request.purpose in purposes)

    def _codec(self, request: CommRequest, taken: bool) -> Codec | None:
        """The codec `request` asks for and will get, counting (and logging once) one it
        cannot get."""
        name = request.attributes.get(QUANTIZE)
        if name is None or is_sub_op(request.purpose):
            return None
        if not taken or self.algorithm != HIERARCHICAL:
            reason = f"not taken over by a hierarchical algorithm ({self.algorithm})"
        elif request.op not in ENCODED_OPS:
            reason = f"{request.op} has no encoded form"
        elif request.op == "reduce_scatter" and request.reduce_op not in ("sum", "avg"):
            reason = f"a {request.reduce_op} reduction has no encoded form"
        else:
            self.encoded[(request.purpose, name)] += 1
            return codec_named(name, int(request.attributes.get(QUANTIZE_BLOCK, 256)))
        key = (request.purpose, reason)
        if not self.unencoded[key]:
            log.warning(
                "%s %s over %s asked for %s and runs unencoded: %s (counted in "
                "CollectivesPlugin.unencoded)",
                request.purpose, request.op, request.group_name, name, reason,
            )  # fmt: skip
        self.unencoded[key] += 1
        return None

    @hookimpl
    def plait_communicate(self, request: CommRequest) -> Work | None:
        taken = self.takes_over(request)
        codec = self._codec(request, taken)
        if not taken:
            return None
        comm = self.comm_for(request)
        mark_carried_by(request, self.algorithm)
        purpose = sub_purpose(self.algorithm, request.purpose)
        if self.algorithm == HIERARCHICAL:
            steps = self._hierarchical_steps(request, purpose, codec)
            return self.runner.run(request, steps, comm)
        rank = dist.get_rank()

        def all_reduce(comm: Comm, group: Group, tensor: torch.Tensor) -> None:
            if isinstance(self.options, TreeConfig):
                halving_doubling_all_reduce(
                    comm,
                    tensor,
                    group=group,
                    rank=rank,
                    reduce_op=request.reduce_op,
                    purpose=purpose,
                    small_message_bytes=self.options.small_message_bytes,
                )
            else:
                ring_all_reduce(
                    comm, tensor, group=group, rank=rank, reduce_op=request.reduce_op,
                    purpose=purpose, piece_bytes=self.options.piece_bytes,
                )  # fmt: skip

        def steps(comm: Comm, group: Group) -> None:
            if request.op == "all_reduce":
                all_reduce(comm, group, request.tensors[0])
            elif isinstance(self.options, TreeConfig):
                reduce_scatter_by_all_reduce(request, group, lambda t: all_reduce(comm, group, t))
            else:
                output, source = request.tensors
                ring_reduce_scatter(
                    comm, output, source, group=group, rank=rank, reduce_op=request.reduce_op,
                    purpose=purpose, piece_bytes=self.options.piece_bytes,
                )  # fmt: skip

        return self.runner.run(request, steps, comm)

    def _hierarchical_steps(self, request: CommRequest, purpose: str, codec: Codec | None) -> Steps:
        groups = self.hierarchies[request.group_ranks]

        # The runner's mirror group goes unused: the steps run on their own sub-groups, which
        # only this group's worker (or, without one, the calling thread) ever issues on.
        def steps(comm: Comm, group: Group) -> None:
            del group
            if request.op == "all_reduce":
                hierarchical_all_reduce(
                    comm, request.tensors[0], groups=groups, reduce_op=request.reduce_op,
                    purpose=purpose,
                )  # fmt: skip
            elif request.op == "reduce_scatter":
                output, source = request.tensors
                hierarchical_reduce_scatter(
                    comm, output, source, groups=groups, reduce_op=request.reduce_op,
                    purpose=purpose, codec=codec,
                )  # fmt: skip
            else:
                output, source = request.tensors
                hierarchical_all_gather(
                    comm, output, source, groups=groups, purpose=purpose, codec=codec
                )

        return steps

    @hookimpl
    def plait_job_end(self) -> None:
        self.runner.close()


def make_plugin() -> CollectivesPlugin:
    return CollectivesPlugin()

"""The communication facade: the only way plait code issues a collective or point-to-point op.

Every method builds a `CommRequest` and hands it to the `plait_communicate` hook, so algorithm
plugins (compression, ring/tree all-reduce, a parameter server) can take an op over and telemetry
(a `wrapper=True` implementation) sees every op without any strategy knowing.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from plait.core.errors import PlaitError
from plait.core.records import CommOp, CommRequest

if TYPE_CHECKING:
    from plait.core.plugins import Plugins

# `CommRequest.attributes` keys of an all-to-all with variable blocks (rows per rank, dim 0).
INPUT_SPLIT_SIZES = "input_split_sizes"
OUTPUT_SPLIT_SIZES = "output_split_sizes"
# `CommRequest.attributes` key naming what carried the op out, written while the hook runs:
# BACKEND when the default implementation did, else the algorithm that took it over
# (`plait.core.comm_algorithms.mark_carried_by`). Telemetry reads it to know whose byte model
# applies and which ops put bytes on the wire themselves (plait.core.link_bytes).
CARRIED_BY = "carried_by"
BACKEND = "torch"
# `CommRequest.attributes` keys asking an algorithm to encode the op's cross-node hop with a
# block-wise integer codec ("int8" or "int4", blocks of QUANTIZE_BLOCK elements): ZeRO++'s
# qwZ / qgZ (`plait.plugins.collectives.codecs`). An op no algorithm encodes is counted and
# logged, never dropped silently.
QUANTIZE = "quantize"
QUANTIZE_BLOCK = "quantize_block"


class Work(Protocol):
    """The handle an op returns; `wait()` blocks until the op's result is usable."""

    def wait(self) -> Any: ...


class CompletedWork:
    """A `Work` for an op that finished synchronously."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass(slots=True)
class ChainedWork:
    """A `Work` that runs `then` once after the wrapped handle completes (e.g. unpacking)."""

    inner: Any
    then: Callable[[], None] | None = None
    _done: bool = field(default=False, init=False)

    def wait(self) -> bool:
        if not self._done:
            self.inner.wait()
            if self.then is not None:
                self.then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


@dataclass(frozen=True, slots=True, init=False)
class Group:
    """A process group with the name and global ranks telemetry reports for it.

    `Group(name, ranks, process_group)`; `process_group=None` means the default (world) group.
    The process group is held weakly: torch.distributed keeps every group it creates until
    `destroy_process_group`, and nothing plait holds (a model's hooks, an engine left open)
    may keep one alive past that, since a Gloo group's worker threads end only when the group
    is freed (`plait.core.process_groups`). An object that cannot be referenced weakly (a test
    double) is held as it is.
    """

    name: str
    ranks: tuple[int, ...]
    _process_group: Any  # weakref.ref to the group, the group itself, or None (world)

    def __init__(self, name: str, ranks: tuple[int, ...], process_group: Any = None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_process_group", _weakly(process_group))

    @property
    def process_group(self) -> Any:
        held = self._process_group
        if not isinstance(held, weakref.ref):
            return held
        group = held()
        if group is None:
            raise PlaitError(
                f"process group {self.name!r} {list(self.ranks)} was destroyed "
                "(torch.distributed.destroy_process_group); no op can be issued on it"
            )
        return group

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


def _weakly(process_group: Any) -> Any:
    if process_group is None:
        return None
    try:
        return weakref.ref(process_group)
    except TypeError:
        return process_group


def reached_default(request: CommRequest) -> None:
    """The default implementation (torch.distributed) says it carries `request` out: no
    algorithm took it over. What the selected algorithm's check counts
    (`plait.core.selection_check`), and what telemetry reads as `CARRIED_BY`."""
    request.attributes[CARRIED_BY] = BACKEND
    issuer = request.issuer
    watch = getattr(issuer, "watch", None)
    if watch is not None:
        watch.reached_default(request)


def world_group() -> Group:
    return Group(name="world", ranks=tuple(range(dist.get_world_size())), process_group=None)


class Comm:
    """Issues collectives through `plait_communicate`; numbers ops per group for hang detection."""

    def __init__(self, plugins: Plugins) -> None:
        self.plugins = plugins
        self._seq: defaultdict[str, int] = defaultdict(int)
        # While set, told of every request and of those that reached the default
        # implementation (`plait.core.selection_check.CommWatch`).
        self.watch: Any = None

    def _issue(
        self,
        op: CommOp,
        tensors: tuple[torch.Tensor, ...],
        group: Group,
        *,
        async_op: bool,
        purpose: str,
        reduce_op: str = "sum",
        peer: int | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> Work:
        seq = self._seq[group.name]
        self._seq[group.name] = seq + 1
        request = CommRequest(
            op=op,
            tensors=tensors,
            group=group.process_group,
            group_name=group.name,
            group_ranks=group.ranks,
            seq=seq,
            reduce_op=reduce_op,  # type: ignore[arg-type]
            peer=peer,
            async_op=async_op,
            purpose=purpose,
            # The request's own dict: the hook chain writes CARRIED_BY into it.
            attributes=dict(attributes) if attributes else {},
            issuer=self,
        )
        if self.watch is not None:
            self.watch.issued(request)
        return self.plugins.communicate(request)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        group: Group,
        op: str = "sum",
        async_op: bool = False,
        purpose: str = "generic",
        attributes: dict[str, Any] | None = None,
    ) -> Work:
        return self._issue(
            "all_reduce",
            (tensor,),
            group,
            async_op=async_op,
            purpose=purpose,
            reduce_op=op,
            attributes=attributes,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        group: Group,
        op: str = "sum",
        async_op: bool = False,
        purpose: str = "generic",
        attributes: dict[str, Any] | None = None,
    ) -> Work:
        """`output` receives this rank's 1/size chunk of the reduction of `input` (dim 0)."""
        return self._issue(
            "reduce_scatter",
            (output, input),
            group,
            async_op=async_op,
            purpose=purpose,
            reduce_op=op,
            attributes=attributes,
        )

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        group: Group,
        async_op: bool = False,
        purpose: str = "generic",
        attributes: dict[str, Any] | None = None,
    ) -> Work:
        """`output` (size × input along dim 0) receives every rank's `input`, in group order."""
        return self._issue(
            "all_gather",
            (output, input),
            group,
            async_op=async_op,
            purpose=purpose,
            attributes=attributes,
        )

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        group: Group,
        input_split_sizes: Sequence[int] | None = None,
        output_split_sizes: Sequence[int] | None = None,
        async_op: bool = False,
        purpose: str = "generic",
    ) -> Work:
        """Block j of `input` (dim 0) goes to the group's j-th rank; block i of `output` comes
        from its i-th rank. Equal blocks (dim 0 / group size rows) unless split sizes are
        given, as `torch.distributed.all_to_all_single` takes them: `input_split_sizes[j]` rows
        to rank j, `output_split_sizes[i]` rows from rank i (then only real rows travel).
        The sizes ride on the request as `attributes[INPUT_SPLIT_SIZES]` and
        `attributes[OUTPUT_SPLIT_SIZES]` (lists of ints)."""
        attributes: dict[str, Any] = {}
        for field_name, splits, tensor in (
            (INPUT_SPLIT_SIZES, input_split_sizes, input),
            (OUTPUT_SPLIT_SIZES, output_split_sizes, output),
        ):
            if splits is None:
                continue
            sizes = [int(n) for n in splits]
            if len(sizes) != group.size or min(sizes) < 0 or sum(sizes) != tensor.shape[0]:
                raise ValueError(
                    f"all_to_all {field_name} {sizes}: needs {group.size} non-negative sizes "
                    f"(one per rank of group {group.name!r}) summing to dim 0 of its tensor, "
                    f"{tensor.shape[0]}"
                )
            attributes[field_name] = sizes
        return self._issue(
            "all_to_all",
            (output, input),
            group,
            async_op=async_op,
            purpose=purpose,
            attributes=attributes,
        )

    def broadcast(
        self, tensor: torch.Tensor, *, src: int, group: Group, purpose: str = "generic"
    ) -> Work:
        """`src` is a global rank."""
        return self._issue("broadcast", (tensor,), group, async_op=False, purpose=purpose, peer=src)

    def send(
        self,
        tensor: torch.Tensor,
        *,
        dst: int,
        group: Group,
        async_op: bool = True,
        purpose: str = "generic",
    ) -> Work:
        """`dst` is a global rank."""
        return self._issue("send", (tensor,), group, async_op=async_op, purpose=purpose, peer=dst)

    def recv(
        self,
        tensor: torch.Tensor,
        *,
        src: int,
        group: Group,
        async_op: bool = True,
        purpose: str = "generic",
    ) -> Work:
        """`src` is a global rank."""
        return self._issue("recv", (tensor,), group, async_op=async_op, purpose=purpose, peer=src)

    def barrier(self, *, group: Group) -> Work:
        return self._issue("barrier", (), group, async_op=False, purpose="barrier")

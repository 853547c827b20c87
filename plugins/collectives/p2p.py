"""Building blocks shared by the algorithms that run over point-to-point ops.

An algorithm plugin receives one `CommRequest` and carries it out as many smaller ops. Those
sub-ops go through a `Comm` as well (so telemetry and byte counters see the real traffic), and
they carry a purpose of their own, `"<algorithm>/<parent purpose>"`, so no plugin mistakes them
for traffic it should take over.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.core.comm import Comm, Group
from plait.core.errors import PluginError
from plait.core.records import CommRequest


def sub_purpose(algorithm: str, parent: str) -> str:
    """The purpose tag of the sub-ops `algorithm` issues on behalf of a `parent`-purpose op."""
    return f"{algorithm}/{parent}"


def is_sub_op(purpose: str, algorithms: tuple[str, ...]) -> bool:
    return any(purpose.startswith(f"{name}/") for name in algorithms)


def group_of(request: CommRequest) -> Group:
    """The `Group` a request was issued on, rebuilt from its fields."""
    return Group(name=request.group_name, ranks=request.group_ranks, process_group=request.group)


def reduce_into(accumulator: torch.Tensor, incoming: torch.Tensor, reduce_op: str) -> None:
    """`accumulator ⊕= incoming` in place; avg accumulates a sum and divides once at the end."""
    if reduce_op in ("sum", "avg"):
        accumulator.add_(incoming)
    elif reduce_op == "max":
        torch.maximum(accumulator, incoming, out=accumulator)
    elif reduce_op == "min":
        torch.minimum(accumulator, incoming, out=accumulator)
    else:
        raise ValueError(f"unsupported reduce op {reduce_op!r}; allowed: sum, avg, max, min")


def exchange(
    comm: Comm,
    *,
    group: Group,
    purpose: str,
    send: torch.Tensor | None = None,
    dst: int | None = None,
    recv: torch.Tensor | None = None,
    src: int | None = None,
) -> None:
    """Send `send` to global rank `dst` while receiving `recv` from `src`, then wait for both.

    Both are posted before either is waited on, so two ranks exchanging with each other (or a
    ring of ranks each sending right and receiving left) cannot deadlock. Empty tensors are
    skipped; every algorithm computes the same sizes on both sides, so the skip is symmetric.
    """
    handles = []
    if recv is not None and recv.numel() > 0:
        assert src is not None
        handles.append(comm.recv(recv, src=src, group=group, async_op=True, purpose=purpose))
    if send is not None and send.numel() > 0:
        assert dst is not None
        handles.append(comm.send(send, dst=dst, group=group, async_op=True, purpose=purpose))
    for handle in handles:
        handle.wait()


def flat_working_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `tensor` when it is contiguous (results land in place), else a copy."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy the result into `tensor` unless `flat` already is a view of it."""
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


class CommBinding:
    """Holds the `Comm` an algorithm issues its sub-ops through.

    The request's issuer is used when the core provides one (`request.issuer`); otherwise the
    `Comm` given to `bind` — the engine (or a test) binds each algorithm plugin to the `Comm` it
    built over the same plugin manager, so sub-ops pass through the same hook and wrappers.
    """

    plugin_name = "comm algorithm"

    def __init__(self) -> None:
        self.comm: Comm | None = None

    def bind(self, comm: Comm) -> None:
        self.comm = comm

    def comm_for(self, request: CommRequest) -> Comm:
        issuer: Any = getattr(request, "issuer", None)
        comm = issuer if isinstance(issuer, Comm) else self.comm
        if comm is None:
            raise PluginError(
                f"{self.plugin_name} was asked to carry out {request.op!r} but has no Comm to "
                "issue its point-to-point steps through; call bind(comm) on the plugin object"
            )
        return comm

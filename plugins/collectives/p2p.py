"""Building blocks of the ring and tree algorithms: paired exchanges and in-place reduction.

What every algorithm plugin shares (purposes, binding a request to its group and issuer, the
overlap worker) is public in `plait.core.comm_algorithms`; these helpers are the collectives
plugin's own.
"""

from __future__ import annotations

import torch

from plait.core.comm import Comm, Group


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

"""Push/pull rounds of a colocated parameter server over point-to-point ops.

The key space of a gradient bucket is its flat offset range, cut into `num_servers` contiguous
shards (`tensor_split`); shard `j` is served by group rank `j`. Every rank is a worker (BytePS's
colocated mode): one round of a bucket is

1. push — each worker sends shard `j` of its gradient to server `j` (its own shard stays local);
2. aggregate — server `j` adds the pushes of all workers, in worker order, so the result does not
   depend on arrival order;
3. pull — server `j` sends the aggregated shard back to every worker.

Synchronous mode completes a round before returning: the result equals an all-reduce. Bounded-
staleness mode (stale-synchronous parallel, Ho et al. 2013) posts the push of step `t` and
returns the aggregate of step `t − s`: the sends of the last `s` rounds stay in flight while the
worker computes, and a worker can run at most `s` steps ahead of the slowest one, because
completing round `t − s` needs every worker's push of step `t − s`. The first `s` pulls have no
aggregate yet and return zeros (those steps do not move the parameters).

Point-to-point messages between two ranks are matched in the order they are posted; every rank
runs the same sequence of rounds, so pushes and pulls of different steps never cross.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.core.comm import Comm, Group


@dataclass(slots=True)
class PushRound:
    """One bucket's push of one step, in flight until `complete_round`."""

    shards: tuple[torch.Tensor, ...]  # this worker's gradient, split by server
    pending_sends: list[Any]
    received: list[tuple[int, torch.Tensor, Any]]  # (worker index, buffer, handle) on a server


@dataclass(slots=True)
class BucketChannel:
    """The rounds of one bucket still in flight, oldest first."""

    rounds: deque[PushRound] = field(default_factory=deque)


@dataclass(frozen=True, slots=True)
class ServerLayout:
    """Who serves what: shards of a bucket and the ranks that hold them."""

    comm: Comm
    group: Group
    rank: int  # this process's global rank
    num_servers: int
    push_purpose: str
    pull_purpose: str

    @property
    def index(self) -> int:
        return self.group.rank_of(self.rank)

    @property
    def is_server(self) -> bool:
        return self.index < self.num_servers

    def server_rank(self, shard: int) -> int:
        return self.group.ranks[shard]


def push(layout: ServerLayout, gradient: torch.Tensor) -> PushRound:
    """Post the push of `gradient` (a private flat copy) and, on a server, the receives."""
    comm, group = layout.comm, layout.group
    shards = gradient.tensor_split(layout.num_servers)
    pending = [
        comm.send(shard, dst=layout.server_rank(j), group=group, purpose=layout.push_purpose)
        for j, shard in enumerate(shards)
        if j != layout.index and shard.numel() > 0
    ]
    received = []
    if layout.is_server and shards[layout.index].numel() > 0:
        for worker, worker_rank in enumerate(group.ranks):
            if worker == layout.index:
                continue
            buffer = torch.empty_like(shards[layout.index])
            handle = comm.recv(buffer, src=worker_rank, group=group, purpose=layout.push_purpose)
            received.append((worker, buffer, handle))
    return PushRound(shards=shards, pending_sends=pending, received=received)


def complete_round(layout: ServerLayout, pushed: PushRound, reduce_op: str) -> torch.Tensor:
    """Aggregate a round on the servers, pull every shard, and return the full bucket."""
    comm, group = layout.comm, layout.group
    first = pushed.shards[0]
    numel = sum(s.numel() for s in pushed.shards)
    result = torch.empty(numel, dtype=first.dtype, device=first.device)
    result_shards = result.tensor_split(layout.num_servers)
    handles: list[Any] = []

    if layout.is_server:
        contributions = {layout.index: pushed.shards[layout.index]}
        for worker, buffer, handle in pushed.received:
            handle.wait()
            contributions[worker] = buffer
        aggregate = result_shards[layout.index]
        aggregate.zero_()
        for worker in sorted(contributions):
            aggregate += contributions[worker]
        if reduce_op == "avg":
            aggregate /= group.size
        if aggregate.numel() > 0:
            handles += [
                comm.send(aggregate, dst=r, group=group, purpose=layout.pull_purpose)
                for r in group.ranks
                if r != layout.rank
            ]

    for j, shard in enumerate(result_shards):
        if j != layout.index and shard.numel() > 0:
            handles.append(
                comm.recv(
                    shard, src=layout.server_rank(j), group=group, purpose=layout.pull_purpose
                )
            )
    for handle in [*handles, *pushed.pending_sends]:
        handle.wait()
    return result


def push_pull(
    layout: ServerLayout,
    channel: BucketChannel,
    tensor: torch.Tensor,
    *,
    reduce_op: str,
    staleness: int,
) -> None:
    """Push `tensor`, then write the newest aggregate at most `staleness` rounds old into it."""
    channel.rounds.append(push(layout, tensor.detach().reshape(-1).clone()))
    newest: torch.Tensor | None = None
    while len(channel.rounds) > staleness:
        newest = complete_round(layout, channel.rounds.popleft(), reduce_op)
    if newest is None:
        tensor.zero_()
    else:
        tensor.copy_(newest.view(tensor.shape))


def drain(layout: ServerLayout, channel: BucketChannel) -> None:
    """Complete the rounds still in flight (at shutdown), so no rank waits for a lost message."""
    while channel.rounds:
        complete_round(layout, channel.rounds.popleft(), "sum")

"""Keeping the global batch whole while replica groups are missing (`keep_global_batch`).

Group g's data-parallel rank r reads share g of the global batch (`data_share`). With
`keep_global_batch` on, every step starts by learning which groups are in its quorum: one
all-reduce of a presence vector through torchft's manager (every participant sets its own
group's entry; torchft's quorum does not publish which groups it holds, only how many). From that
vector alone, the same on every survivor, `assign_missing_shares` hands each missing group's
share to exactly one survivor, round-robin over the survivors in group order. A survivor's rank r
then reads, for the same step, rank r's slice of each share it took, and trains on its own rows
and theirs concatenated in group order, in micro-batches of the size its own share has: more
micro-batches (gradient accumulation), not bigger ones, so activation memory stays what it was
and the sum over micro-batches is the same token-weighted mean a bigger batch would give. The
cross-group average then weighs each group by the tokens it trained on (`commit.py`), so a step
equals one process's step on the whole global batch.

The data position is one step counter over the global batch, shared by every group: a survivor
advances it once per committed step, as every group would have, and a group that heals later
takes it over and continues at the rows of the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed import ReduceOp
from torch.utils._pytree import tree_flatten, tree_unflatten

from plait.core.errors import ConfigError, PlaitError


class ShareSampler(Protocol):
    """What a sampler offers for a survivor to read missing groups' shares (`StepSampler`)."""

    dp_rank: int
    dp_size: int
    local_batch_size: int  # rows of one rank's slice

    @property
    def step(self) -> int: ...

    def next_batch(self) -> Any: ...

    def batch_at(self, step: int, *, dp_rank: int | None = None) -> Any: ...


def assign_missing_shares(present: Collection[int], groups: int) -> dict[int, tuple[int, ...]]:
    """Which shares of the global batch each live group trains on: its own, and the missing
    groups' dealt round-robin over the live groups in ascending order (missing share k, in
    ascending order, to the (k mod live)-th live group). Every share is read exactly once, and
    every survivor computes the same answer from the same `present`."""
    live = sorted(set(present))
    if not live:
        raise PlaitError("no replica group is live: there is no one to read the global batch")
    if live[0] < 0 or live[-1] >= groups:
        raise PlaitError(f"live groups {live} are not all among the job's groups 0 .. {groups - 1}")
    missing = [group for group in range(groups) if group not in live]
    taken: dict[int, list[int]] = {group: [group] for group in live}
    for index, share in enumerate(missing):
        taken[live[index % len(live)]].append(share)
    return {group: tuple(sorted(shares)) for group, shares in taken.items()}


def live_groups(
    manager: Any, *, group: int, groups: int, device: torch.device
) -> tuple[int, ...] | None:
    """The groups in this step's quorum, learnt by one all-reduce through `manager`; `None`
    when the all-reduce failed (torchft recorded the error: the step will not commit)."""
    presence = torch.zeros(groups, dtype=torch.float64, device=device)
    presence[group] = 1.0
    manager.allreduce(presence, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    counts = [round(float(value)) for value in presence.cpu()]
    doubled = [index for index, count in enumerate(counts) if count > 1]
    if doubled:
        raise ConfigError(
            f"fault_tolerance.replica_group = {doubled[0]} is claimed by {counts[doubled[0]]} "
            "live groups: each group of the job needs its own index, 0 .. replica_groups-1"
        )
    live = tuple(index for index, count in enumerate(counts) if count == 1)
    if group not in live or len(live) != manager.num_participants():
        raise PlaitError(
            f"the quorum's presence vector {counts} does not match this group ({group}) and "
            f"the quorum's {manager.num_participants()} participants"
        )
    return live


def concatenate_rows(batches: Sequence[Any]) -> Any:
    """One batch holding the rows of `batches` in order (each a pytree of the same structure:
    `(inputs, targets)`, a dict, a tensor); tensors are joined along dim 0, anything else must
    be equal across them."""
    flat, spec = tree_flatten(batches[0])
    leaves = [flat]
    for batch in batches[1:]:
        other, other_spec = tree_flatten(batch)
        if other_spec != spec:
            raise PlaitError("the shares of one step have batches of different structures")
        leaves.append(other)
    joined = []
    for pieces in zip(*leaves, strict=True):
        if isinstance(pieces[0], torch.Tensor) and pieces[0].ndim:
            joined.append(torch.cat(pieces))
        elif all(piece == pieces[0] for piece in pieces[1:]):
            joined.append(pieces[0])
        else:
            raise PlaitError(f"the shares of one step differ in a non-tensor entry: {pieces}")
    return tree_unflatten(joined, spec)


@dataclass(frozen=True, slots=True)
class StepShares:
    """What one group trains on in one step."""

    batch: Any  # the rows of `shares`, this rank's slice of each, in group order
    shares: tuple[int, ...]  # groups whose share of the global batch it holds
    micro_batch_size: int  # rows per micro-batch: as many as the group's own share has


class GlobalBatchKeeper:
    """Reads each step's batch for one rank of one group so the live groups together train on
    the whole global batch; see the module docstring."""

    def __init__(
        self,
        *,
        manager: Any,
        batches: ShareSampler,
        group: int,
        groups: int,
        dp_rank: int,
        dp_size: int,
        micro_batch_size_for: Callable[[int], int],
        device: torch.device,
    ) -> None:
        """`micro_batch_size_for(rows)`: the engine's micro-batch size for a batch of `rows`,
        asked once for this rank's own share."""
        if not callable(getattr(batches, "batch_at", None)):
            raise ConfigError(
                "fault_tolerance.keep_global_batch needs a sampler that reads any rank's rows "
                f"of a step (batch_at(step, dp_rank=)); {type(batches).__name__} has none"
            )
        expected = (group * dp_size + dp_rank, groups * dp_size)
        if (batches.dp_rank, batches.dp_size) != expected:
            raise ConfigError(
                f"fault_tolerance.keep_global_batch: the sampler reads rank {batches.dp_rank} of "
                f"{batches.dp_size}, but group {group}'s rank {dp_rank} of {dp_size} reads rank "
                f"{expected[0]} of {expected[1]}; build it with replica_data_coordinates"
            )
        self.manager, self.batches = manager, batches
        self.group, self.groups = group, groups
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_batch_size = micro_batch_size_for(batches.local_batch_size)
        self.device = device

    def next_step(self) -> StepShares:
        """This step's batch (the sampler advances one step), after the quorum has formed."""
        live = live_groups(self.manager, group=self.group, groups=self.groups, device=self.device)
        # A failed exchange fails the step: train on the own share only, which is rolled back.
        shares = (
            (self.group,) if live is None else assign_missing_shares(live, self.groups)[self.group]
        )
        step = self.batches.step
        own = self.batches.next_batch()
        rows = [
            own
            if share == self.group
            else self.batches.batch_at(step, dp_rank=share * self.dp_size + self.dp_rank)
            for share in shares
        ]
        batch = rows[0] if len(rows) == 1 else concatenate_rows(rows)
        return StepShares(batch=batch, shares=shares, micro_batch_size=self.micro_batch_size)

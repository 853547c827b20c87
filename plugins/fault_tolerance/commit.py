"""The step callbacks that put one replica group's step under torchft's quorum.

Added after the group's own data-parallel runtime, so its `sync_gradients` runs on gradients the
group already reduced (DDP's all-reduce, ZeRO's reduced chunks): it averages the gradients the
optimizer steps on across the live groups, through torchft's `Manager.allreduce`, which records a
failure instead of raising. `skip_step` is the one place a step's commit is decided: torchft's
`should_commit`, a vote of every rank of the group, false if any of them saw an error.

Each group's gradient is the token-weighted mean over the rows it trained on. Groups that train
on equal shares weigh the same (torchft's AVG). When the job keeps its global batch
(`batch_share.py`), a survivor trains on more than its own share, so the groups are weighed by
the tokens each trained on (the rows, where the loss is not a token mean): group g's gradient
times N_g / Σ N, summed (`_weighted_sum`).

The all-reduce adds rank i's buffers of every group element by element: groups of one inner
layout reduce the optimizer's gradients as they hold them; when the quorum mixes layouts (a
ZeRO-3 group healed from a ZeRO-1 one) every group reduces through the canonical split
(`gradient_split.py`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ReduceOp

from plait.core.sharding import ParallelRuntime, StepState

if TYPE_CHECKING:
    from plait.plugins.fault_tolerance.gradient_split import GradientSplit


class _Layouts(enum.Enum):
    """What the groups of a quorum hold their optimizer's gradients as."""

    SAME = "same"  # every group one layout: reduce the gradients as held
    DIFFER = "differ"  # some group another: reduce through the canonical split
    UNKNOWN = "unknown"  # the judging all-reduce failed on some rank of this group


class ReplicaGroupCommit(ParallelRuntime):
    """Average gradients across the quorum; commit the step only when the group agrees."""

    name = "fault_tolerance"

    def __init__(
        self,
        *,
        manager: Any,
        optimizer: torch.optim.Optimizer,
        weigh_by_tokens: bool = False,
        split_factory: Callable[[], GradientSplit] | None = None,
        group_max: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.manager = manager
        self.optimizer = optimizer
        self.committed: bool | None = None
        # On with keep_global_batch: groups may train on unequal numbers of shares.
        self.weigh_by_tokens = weigh_by_tokens
        # This step's shares (set by the step driver) and token counts (read from the step).
        self.shares_trained = 1
        # Shared by every group (set with keep_global_batch): the scale groups weigh against.
        self.global_shares = 1
        self.global_batch_tokens = 1.0  # train.global_batch_size × data.seq_len
        self._step_state: StepState | None = None
        # Made on first need (collective over the group): groups of other inner layouts.
        self._split_factory = split_factory
        self._split: GradientSplit | None = None
        self._layouts_judged_for: int | None = None
        self._layouts_differ_now = False
        # Max-reduces a tensor over the group's own ranks (its torchrun world, not torchft's
        # cross-group one), so every rank of the group takes the same path through a step.
        self._group_max = group_max

    def action_handlers(self, step: StepState) -> dict[type, Any]:
        if self.weigh_by_tokens:
            self._step_state = step  # its token weights, once the engine has counted them
        return {}

    def _optimizer_gradients(self) -> list[torch.Tensor]:
        # What the optimizer steps on: whole parameters under DDP, this rank's shard under ZeRO.
        return [
            p.grad
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def sync_gradients(self) -> None:
        self.committed = None
        grads = self._optimizer_gradients()
        if not grads:
            return
        layouts = self._judge_layouts(grads[0].device)
        if layouts is _Layouts.UNKNOWN:
            # Some rank of the group lost a peer while judging: the step cannot commit (that
            # rank votes against it), and averaging now could leave this group's ranks on
            # different paths, one of them waiting in a collective the others never enter.
            return
        if layouts is _Layouts.DIFFER:
            assert self._split is not None
            self._split.average(self._average)
            return
        flat = _flatten_dense_tensors(grads)
        self._average(flat)
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(averaged)

    def _average(self, flat: torch.Tensor) -> None:
        """`flat` (this rank's gradients, in whichever split every group shares) averaged
        across the quorum, in place."""
        if self.weigh_by_tokens:
            self._weighted_sum(flat)
        else:
            # Sum, then divide by the participants (torchft's AVG): exact with two contributors.
            self.manager.allreduce(flat).wait()

    def _judge_layouts(self, device: torch.device) -> _Layouts:
        """Whether some group of this quorum holds its optimizer's gradients in another layout
        (then all of them average through the canonical split). Asked once per quorum, by every
        group alike: a sum over the quorum of each group's fingerprint and its square is
        n·Σf² = (Σf)² exactly when every f is the same. `UNKNOWN` when the sums' all-reduce
        failed on any rank of this group (a peer died): its sums are garbage, and the ranks must
        not split on them (one would enter the canonical split's collectives alone)."""
        if self._split_factory is None:
            return _Layouts.SAME
        quorum = int(self.manager._quorum_id)  # torchft 0.2 has no public getter for it
        if quorum == self._layouts_judged_for:
            return _Layouts.DIFFER if self._layouts_differ_now else _Layouts.SAME
        if self._split is None:
            self._split = self._split_factory()
        first, second = self._split.fingerprint
        sums = torch.tensor(
            [first, second, first * first, second * second], dtype=torch.float64, device=device
        )
        self.manager.allreduce(sums, reduce_op=ReduceOp.SUM).wait()
        groups = self.manager.num_participants()
        differ = bool(groups * sums[2] != sums[0] ** 2 or groups * sums[3] != sums[1] ** 2)
        # One small all-reduce over the group's ranks, once per quorum: any rank's failure or
        # verdict becomes every rank's.
        verdict = torch.tensor(
            [float(self.manager.errored() is not None), float(differ)], device=device
        )
        if self._group_max is not None:
            self._group_max(verdict)
        if verdict[0]:
            # Judge again on the retry's quorum.
            self._layouts_judged_for = None
            return _Layouts.UNKNOWN
        self._layouts_judged_for = quorum
        self._layouts_differ_now = bool(verdict[1])
        return _Layouts.DIFFER if self._layouts_differ_now else _Layouts.SAME

    def _weighted_sum(self, flat: torch.Tensor) -> None:
        """`flat` ← Σ N_g · flat_g / Σ N_g over the live groups, N_g this group's scored tokens
        (the engine's count, over the group's ranks), or its shares where the loss is not a token
        mean. The gradients are summed first, pre-scaled by N_g / a bound every group shares (no
        overflow, one scale everywhere), and the counts after: a peer that dies in the step
        breaks the large all-reduce on every survivor at once, where a one-element all-reduce
        first could leave a survivor waiting out `step_timeout_seconds` on a peer that already
        gave up."""
        step, self._step_state = self._step_state, None  # not kept past the step: its batch
        weights = step.runner.weights if step is not None else None
        if weights is not None:
            mine = weights.global_scored.to(flat.device, torch.float64).reshape(1)
            bound = self.global_batch_tokens
        else:
            mine = torch.tensor(
                [float(self.shares_trained)], dtype=torch.float64, device=flat.device
            )
            bound = float(self.global_shares)
        flat.mul_(float(mine) / bound)
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        total = mine.clone()
        self.manager.allreduce(total, reduce_op=ReduceOp.SUM).wait()
        # After a failed all-reduce the sums are garbage; the step does not commit.
        flat.mul_(bound / max(float(total), 1.0))

    def skip_step(self) -> bool:
        self.committed = bool(self.manager.should_commit())
        return not self.committed

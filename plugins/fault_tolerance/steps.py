"""The training step of one replica group under torchft: quorum, step, commit or roll back.

`FaultTolerantSteps.step()` asks the lighthouse for this step's quorum (healing first, from a
live peer, when this group is behind: `healing`, across inner layouts), runs the engine's step on
the next batch with the gradients averaged across the quorum, and keeps the step only when it
commits. A step that does not commit (a peer died in it, or stopped answering within
`step_timeout_seconds`) is undone where the engine advanced — learning-rate schedule, step count,
data position — so the next call retries it with the groups still alive.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from plait.core.comm import world_group
from plait.core.comm_algorithms import GENERIC
from plait.core.errors import PlaitError
from plait.plugins.fault_tolerance.batch_share import GlobalBatchKeeper
from plait.plugins.fault_tolerance.commit import ReplicaGroupCommit
from plait.plugins.fault_tolerance.config import FaultToleranceConfig
from plait.plugins.fault_tolerance.gradient_split import GradientSplit
from plait.plugins.fault_tolerance.group_loss import GroupLossExit
from plait.plugins.fault_tolerance.healing import heal_state, load_heal_state
from plait.plugins.fault_tolerance.job_progress import (
    JobProgress,
    agree_on_job_progress,
    lighthouse_answers,
)
from plait.plugins.fault_tolerance.quorum_events import QuorumEvent, QuorumWatch
from plait.plugins.fault_tolerance.replica_group import open_manager


class NoStateToResume(PlaitError):
    """A restarted replica group has neither a live peer nor a checkpoint to continue from."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutcome:
    """What became of one try of a step."""

    step: int  # the optimizer step tried (the engine's step count before it)
    committed: bool
    loss: float
    quorum_id: int
    participants: int  # replica groups in the quorum that tried it
    events: tuple[QuorumEvent, ...]  # joins, leaves, heals, failed commits seen by this try
    # Groups whose share of the global batch this group trained on (keep_global_batch); () =
    # its own only.
    shares: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _RewindPoint:
    step: int
    sampler: dict[str, Any]
    lr_scheduler: dict[str, Any] | None
    # The schedule sets each group's rate when it steps: its state alone does not undo that.
    learning_rates: tuple[float, ...]


class FaultTolerantSteps:
    """Drive an engine's steps through torchft's manager; see the module docstring."""

    def __init__(
        self,
        *,
        engine: Any,
        batches: Any,
        manager: Any,
        store: Any,
        restarted: bool = False,
        job_reached: JobProgress | None = None,
        lighthouse: str = "",
        quorum_timeout: float = 0.0,
    ) -> None:
        self.engine, self.batches = engine, batches
        self.manager, self._store = manager, store
        # A group torchrun restarted has trained before: it must not start over from step 0.
        self.restarted = restarted
        # How far the job had come at the lighthouse before this group joined (None: unknown);
        # a group alone at step 0 of a job that trained must not start it over either.
        self.job_reached = job_reached
        self.lighthouse, self.quorum_timeout = lighthouse, quorum_timeout
        self._first_quorum = True
        self.commit = ReplicaGroupCommit(
            manager=manager,
            optimizer=engine.optimizer,
            # Used only when a group of another inner layout joins the quorum.
            split_factory=lambda: GradientSplit(engine, group=world_group()),
            group_max=lambda tensor: engine.comm.all_reduce(
                tensor, group=world_group(), op="max", purpose=GENERIC
            ),
        )
        # After the group's data-parallel runtime: it averages what that runtime reduced.
        engine.append_runtime(self.commit)
        self.watch = QuorumWatch()
        # Started by `attach` (it owns the process's signal wakeup fd); inert until then.
        self.group_loss = GroupLossExit(replica_group=-1)
        # Set by `keep_global_batch`: survivors also read the missing groups' shares.
        self.shares: GlobalBatchKeeper | None = None

    @property
    def replica_id(self) -> str:
        """This group's id at the lighthouse (`<job>-group<N>:<uuid>`, new for every start)."""
        from torchft.manager import REPLICA_ID_KEY

        # torchft publishes it only in the group's store, under this key.
        return self.manager._store.get(REPLICA_ID_KEY).decode("utf-8")

    @classmethod
    def attach(
        cls, engine: Any, batches: Any, settings: FaultToleranceConfig, *, job_id: str = ""
    ) -> FaultTolerantSteps:
        """Join the replica groups `settings` names (collective over the group's ranks)."""
        holder: list[FaultTolerantSteps] = []

        def load(state: dict[str, Any]) -> None:
            load_heal_state(engine, batches, state)
            holder[0].watch.healed_to(int(state["step"]))

        job_id = job_id or engine.job_info().job_id
        # Read before this group's first quorum replaces the lighthouse's last one.
        job_reached = agree_on_job_progress(settings.lighthouse, job_id)
        manager, store = open_manager(
            settings=settings,
            job_id=job_id,
            device=engine.device,
            state_dict=lambda: heal_state(engine, batches),
            load_state_dict=load,
        )
        steps = cls(
            engine=engine,
            batches=batches,
            manager=manager,
            store=store,
            restarted=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0,
            job_reached=job_reached,
            lighthouse=settings.lighthouse,
            quorum_timeout=settings.quorum_timeout_seconds,
        )
        holder.append(steps)
        steps.group_loss = GroupLossExit(replica_group=settings.replica_group).start()
        if settings.keep_global_batch:
            steps.keep_global_batch(settings)
        steps.resume_from(engine.global_step)
        return steps

    def keep_global_batch(self, settings: FaultToleranceConfig) -> None:
        """From now on every committed step trains on the whole global batch (`batch_share`)."""
        engine = self.engine
        self.shares = GlobalBatchKeeper(
            manager=self.manager,
            batches=self.batches,
            group=settings.replica_group,
            groups=settings.replica_groups,
            dp_rank=engine.mesh.coordinate("dp"),
            dp_size=engine.mesh.size("dp"),
            micro_batch_size_for=engine.micro_batch_size,
            device=engine.device,
        )
        self.commit.weigh_by_tokens = True
        self.commit.global_shares = settings.replica_groups
        self.commit.global_batch_tokens = float(
            engine.config.train.global_batch_size * engine.config.data.seq_len
        )

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's disk checkpoint after the step that just
        committed: the first group of that step's quorum (replica rank 0; torchft orders the
        groups by id). Exactly one live group writes, whichever groups died, group 0 included;
        the checkpoint holds the state every group shares, so any group resumes from it."""
        return self.manager.participating_rank() == 0

    def resume_from(self, step: int) -> None:
        """Start torchft's step count where the engine stands (after a disk checkpoint's
        resume): a peer further on heals this group; one behind heals from it."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def step(self, *, data_start_ns: int | None = None) -> StepOutcome:
        """One try of the next step; on failure everything is as before it, ready to retry."""
        engine = self.engine
        quorum_start = time.time_ns()
        self._join_quorum()  # blocks for the quorum; heals this group if behind
        participants = self.manager.num_participants()
        quorum_id = int(self.manager._quorum_id)  # torchft 0.2 has no public getter for it
        self.watch.quorum(
            quorum_id=quorum_id,
            participants=participants,
            step=engine.global_step,
            start_ns=quorum_start,
            end_ns=time.time_ns(),
        )
        self._refuse_starting_over(participants)
        rewind = _RewindPoint(
            step=engine.global_step,
            sampler=copy.deepcopy(dict(self.batches.state_dict())),
            lr_scheduler=(
                copy.deepcopy(engine.lr_scheduler.state_dict())
                if engine.lr_scheduler is not None
                else None
            ),
            learning_rates=tuple(group["lr"] for group in engine.optimizer.param_groups),
        )
        shares: tuple[int, ...] = ()
        if self.shares is None:
            batch = self.batches.next_batch()
            step_start = time.time_ns()
            loss = engine.train_step(batch, data_start_ns=data_start_ns)
        else:
            read = self.shares.next_step()
            shares, self.commit.shares_trained = read.shares, len(read.shares)
            step_start = time.time_ns()
            loss = engine.train_step(
                read.batch, data_start_ns=data_start_ns, micro_batch_size=read.micro_batch_size
            )
        committed = bool(self.commit.committed)
        if not committed:
            self._rewind(rewind)
            self.watch.failed_commit(
                step=rewind.step,
                quorum_id=quorum_id,
                participants=participants,
                start_ns=step_start,
                end_ns=time.time_ns(),
                error=str(self.manager.errored() or "a rank of the group voted against"),
            )
        return StepOutcome(
            step=rewind.step,
            committed=committed,
            loss=loss,
            quorum_id=quorum_id,
            participants=participants,
            events=self.watch.take(),
            shares=shares,
        )

    def _join_quorum(self) -> None:
        """torchft's quorum for this step, asked again by every rank of the group while the
        lighthouse answers but has formed none within `quorum_timeout_seconds`: a group that
        hangs keeps heartbeating, and the lighthouse waits up to its join timeout for it before
        it leaves it out, which may well be longer. Giving up there would end the very group
        that fault tolerance keeps alive."""
        while True:
            timed_out: TimeoutError | None = None
            try:
                self.manager.start_quorum()
            except TimeoutError as exc:
                timed_out = exc
            # Every rank asks again if any timed out (one that was answered just in time too):
            # the group's ranks must enter the step together.
            if not self._any_rank(timed_out is not None):
                return
            if self._any_rank(not lighthouse_answers(self.lighthouse)):
                raise PlaitError(
                    f"no quorum within {self.quorum_timeout:g} s (fault_tolerance."
                    f"quorum_timeout_seconds), and the lighthouse at {self.lighthouse} does not "
                    "answer"
                ) from timed_out
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(
                    f"plait: no quorum within {self.quorum_timeout:g} s: the lighthouse waits for "
                    "a replica group that has not asked (hung, or starting); asking again",
                    file=sys.stderr,
                    flush=True,
                )
            # torchft re-raises a failed quorum at the next start; this one has been dealt with.
            self.manager._quorum_future = None

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank of this group (one small all-reduce over the
        group's own ranks; none for a group of one rank)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        verdict = torch.tensor([float(flag)], device=self.engine.device)
        self.engine.comm.all_reduce(verdict, group=world_group(), op="max", purpose=GENERIC)
        return bool(verdict.item())

    def _refuse_starting_over(self, participants: int) -> None:
        """A group alone at step 0 of a job that has trained — torchrun restarted it, or the
        lighthouse's last quorum had the job further on — found no live peer to heal from and no
        checkpoint: training on would silently start the run over from initial weights."""
        first, self._first_quorum = self._first_quorum, False
        if not first or participants != 1 or self.engine.global_step != 0:
            return
        remedy = (
            "Set checkpoint_io.dir to the job's checkpoint directory (and checkpoint_io.every) "
            "so a group can resume from disk"
        )
        if self.restarted:
            raise NoStateToResume(
                "this replica group was restarted, but no live group is left to heal from and "
                f"no checkpoint was resumed: it would train from its initial weights. {remedy}"
            )
        reached = self.job_reached
        if reached is not None and reached.step > 0:
            raise NoStateToResume(
                f"job {reached.job_id!r} had trained {reached.step} steps at the lighthouse's "
                f"last quorum ({reached.replica_id}), but no live replica group is left to heal "
                "this group from and no checkpoint was resumed: it would train from its initial "
                f"weights. {remedy}, or start a new run under another telemetry.job_id"
            )

    def step_until_committed(self, *, data_start_ns: int | None = None) -> StepOutcome:
        """Try the next step until it commits (with whichever groups are alive); the outcome of
        the committed try, carrying the events of every try."""
        events: list[QuorumEvent] = []
        while True:
            outcome = self.step(data_start_ns=data_start_ns)
            events.extend(outcome.events)
            if outcome.committed:
                return replace(outcome, events=tuple(events))
            data_start_ns = None  # a retry's data wait is the failed try's

    def _rewind(self, point: _RewindPoint) -> None:
        engine = self.engine
        engine.global_step = point.step
        self.batches.load_state_dict(point.sampler)
        if engine.lr_scheduler is not None and point.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(point.lr_scheduler)
        for group, rate in zip(engine.optimizer.param_groups, point.learning_rates, strict=True):
            group["lr"] = rate

    def close(self) -> None:
        self.group_loss.stop()
        self.manager.shutdown(wait=False)

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
import time
from dataclasses import dataclass, replace
from typing import Any

from plait.core.comm import world_group
from plait.core.config import FaultToleranceSection
from plait.core.errors import PlaitError
from plait.plugins.fault_tolerance.batch_share import GlobalBatchKeeper
from plait.plugins.fault_tolerance.commit import ReplicaGroupCommit
from plait.plugins.fault_tolerance.gradient_split import GradientSplit
from plait.plugins.fault_tolerance.healing import heal_state, load_heal_state
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
        self, *, engine: Any, batches: Any, manager: Any, store: Any, restarted: bool = False
    ) -> None:
        self.engine, self.batches = engine, batches
        self.manager, self._store = manager, store
        # A group torchrun restarted has trained before: it must not start over from step 0.
        self.restarted = restarted
        self._first_quorum = True
        self.commit = ReplicaGroupCommit(
            manager=manager,
            optimizer=engine.optimizer,
            # Used only when a group of another inner layout joins the quorum.
            split_factory=lambda: GradientSplit(engine, group=world_group()),
        )
        # After the group's data-parallel runtime: it averages what that runtime reduced.
        engine.runtimes.append(self.commit)
        self.watch = QuorumWatch()
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
        cls, engine: Any, batches: Any, settings: FaultToleranceSection, *, job_id: str = ""
    ) -> FaultTolerantSteps:
        """Join the replica groups `settings` names (collective over the group's ranks)."""
        holder: list[FaultTolerantSteps] = []

        def load(state: dict[str, Any]) -> None:
            load_heal_state(engine, batches, state)
            holder[0].watch.healed_to(int(state["step"]))

        manager, store = open_manager(
            settings=settings,
            job_id=job_id or engine._job_info().job_id,
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
        )
        holder.append(steps)
        if settings.keep_global_batch:
            steps.keep_global_batch(settings)
        steps.resume_from(engine.global_step)
        return steps

    def keep_global_batch(self, settings: FaultToleranceSection) -> None:
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
        self.manager.start_quorum()  # blocks for the quorum; heals this group if behind
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

    def _refuse_starting_over(self, participants: int) -> None:
        """A restarted group alone at step 0 found no live peer to heal from and no checkpoint:
        training on would silently start the run over from initial weights."""
        first, self._first_quorum = self._first_quorum, False
        if first and self.restarted and participants == 1 and self.engine.global_step == 0:
            raise NoStateToResume(
                "this replica group was restarted, but no live group is left to heal from and "
                "no checkpoint was resumed: it would train from its initial weights. Set "
                "checkpoint_io.dir (and checkpoint_io.every) so a group can resume from disk"
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
        self.manager.shutdown(wait=False)

"""The training loop's checkpoint policy: resume at start, save every N steps, keep the last K.

    checkpointer = Checkpointer.from_config(engine, batches, config)
    start = checkpointer.maybe_resume()           # 0, or the step of the latest good checkpoint
    for step in range(start, config.train.steps):
        engine.train_step(batches.next_batch())
        checkpointer.maybe_save(step + 1)
    checkpointer.close()                          # waits for an asynchronous save

Configured by the `[checkpoint_io]` section (`config.py`; `[checkpoint]` is activation
checkpointing). The section's NaN/Inf guard and fault injection are not the checkpointer's: the
training loop attaches them beside it (`plait.plugins.resilience.attach_resilience`). Rank 0
publishes each save's start and end for the daemon (`save_events.py`).
"""

from __future__ import annotations

import atexit
import logging
import shutil
import time
import weakref
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait.core.comm import Group
from plait.core.config import PlaitConfig
from plait.core.state_chunks import layout_for
from plait.plugins.checkpoint.background import (
    BackgroundWrite,
    SaveFailure,
    SaveTiming,
    describe_error,
)
from plait.plugins.checkpoint.config import CheckpointIOConfig, checkpoint_io_config
from plait.plugins.checkpoint.save_events import CheckpointSaveSpan, publish_save
from plait.plugins.checkpoint.staging import HostStaging
from plait.plugins.checkpoint.state import (
    LoadReport,
    engine_state_dict,
    load_engine_state,
    save_state_dict,
)
from plait.plugins.checkpoint.storage import (
    CheckpointError,
    describe_files,
    find_latest_complete,
    fsync_dir,
    publish,
    resolve_checkpoint,
    step_dir_name,
    temp_dir_name,
    verify,
    write_manifest,
)

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves and resumes one engine (and its sampler) under `config.dir`."""

    def __init__(self, engine: Any, batches: Any, config: CheckpointIOConfig) -> None:
        self.engine = engine
        self.batches = batches
        self.config = config
        self.root = Path(config.dir).expanduser() if config.dir else None
        self.total_steps = engine.config.train.steps
        self.rank = engine.mesh.rank
        self.last_saved_step: int | None = None
        self._staging = HostStaging()
        self._pending: BackgroundWrite | None = None
        self._pending_blocked = (0.0, 0.0, 0.0)
        self.timings: list[SaveTiming] = []
        self.failed_saves: list[SaveFailure] = []
        self.last_published: str | None = None
        self._written_bytes: int | None = None  # rank 0: the files of the last save published
        # A script that never calls close() still gets its last save written before exit;
        # registered after the engine's own exit handlers, so it runs before they tear down
        # the process groups the write needs.
        atexit.register(_settle_at_exit, weakref.ref(self))
        # DCP coordinates over a process group of its own: a dedicated Gloo group keeps checkpoint
        # traffic out of the training groups' op sequence and lets a save thread run beside
        # training. Creating a group is collective, so it is made here, on every rank.
        # Held weakly (a `Group`), so destroying the process groups at exit frees it.
        distributed = self.root is not None and dist.get_world_size() > 1
        self._group = (
            Group(
                name="checkpoint",
                ranks=tuple(range(dist.get_world_size())),
                process_group=dist.new_group(backend="gloo"),
            )
            if distributed
            else None
        )

    @property
    def group(self) -> Any:
        """The checkpoint's own Gloo process group (None in one process or without a dir)."""
        return self._group.process_group if self._group is not None else None

    @classmethod
    def from_config(cls, engine: Any, batches: Any, config: PlaitConfig) -> Checkpointer:
        return cls(engine, batches, checkpoint_io_config(config))

    # -- resume -----------------------------------------------------------------------------------

    def maybe_resume(self) -> int:
        """Load the latest complete checkpoint (or `init_from` weights); return the next step.

        A job whose checkpoints leave part of its state out (`StateLayout.left_out`: a LoRA
        job's frozen base) resumes from `init_from` first, for that part, then from its own
        checkpoint for the rest."""
        if self.root is not None and self.config.resume:
            path = self._agree_on(self._find_resumable)
            if path is not None:
                if self.config.init_from and layout_for(self.engine).left_out:
                    self.load(resolve_checkpoint(Path(self.config.init_from)), model_only=True)
                report = self.load(Path(path))
                self.last_published = Path(path).name
                log.warning("resumed from %s at step %d", path, report.step)
                return report.step
        if self.config.init_from:
            self.load(resolve_checkpoint(Path(self.config.init_from)), model_only=True)
        return int(self.engine.global_step)

    def _find_resumable(self) -> str | None:
        assert self.root is not None
        path, rejected = find_latest_complete(self.root, checksums=self.config.verify_checksums)
        for verdict in rejected:
            print(
                f"plait: checkpoint {verdict.path} is unusable ({verdict.problem}); "
                "trying the previous one",
                flush=True,
            )
        return str(path) if path is not None else None

    def load(self, path: Path, *, model_only: bool = False) -> LoadReport:
        """Load one checkpoint directory into the engine (resharding as needed)."""
        if not model_only:
            verdict = verify(path, checksums=self.config.verify_checksums)
            if not verdict.ok:
                raise CheckpointError(f"checkpoint {path} is unusable: {verdict.problem}")
        return load_engine_state(
            self.engine,
            path,
            batches=None if model_only else self.batches,
            process_group=self.group,
            model_only=model_only,
        )

    def _agree_on(self, choose: Any) -> Any:
        """Rank 0 decides (e.g. which checkpoint verifies); every rank gets its answer."""
        value = [choose() if self.rank == 0 else None]
        if self.group is not None:
            dist.broadcast_object_list(value, src=0, group=self.group)
        return value[0]

    # -- save -------------------------------------------------------------------------------------

    def maybe_save(self, steps_done: int) -> bool:
        """Save if `steps_done` is a multiple of `every`, or the last step; True if it saved."""
        if self.root is None:
            return False
        periodic = self.config.every > 0 and steps_done % self.config.every == 0
        final = self.config.save_final and steps_done == self.total_steps
        if not (periodic or final) or steps_done == self.last_saved_step:
            return False
        self.save(steps_done)
        return True

    def save(self, step: int) -> None:
        """Write a checkpoint of the current state as `step-N`.

        Asynchronous (the default): returns once the state is copied to host memory, and the
        write runs in a thread; the next save, `wait()` or `close()` waits for it first. A
        previous asynchronous save that failed is reported here, by name, and training goes on.
        """
        if self.root is None:
            raise CheckpointError("checkpoint_io.dir is not set")
        started = time.perf_counter()
        self._settle()
        waited = time.perf_counter() - started
        begun_ns = time.time_ns()  # a synchronous save's write counts from here (SaveTiming)
        asynchronous = self.config.async_save
        if self.rank == 0:  # after the previous save's end was told
            publish_save(CheckpointSaveSpan.started(step=step, asynchronous=asynchronous))
        temp = self.root / temp_dir_name(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if temp.exists():
                shutil.rmtree(temp)  # left by a crash during an earlier attempt at this step
        self._barrier()
        state = engine_state_dict(self.engine, batches=self.batches)
        self.last_saved_step = step
        if not asynchronous:
            try:
                self._write(state, temp, step)
            except BaseException as exc:
                blocked = time.perf_counter() - started
                self._tell_ended(step, False, begun_ns, blocked, blocked - waited, exc)
                raise
            blocked = time.perf_counter() - started
            self._record(SaveTiming(step, False, blocked, waited, 0.0, blocked - waited))
            self._tell_ended(step, False, begun_ns, blocked, blocked - waited)
            return
        copy_started = time.perf_counter()
        staged = self._staging.stage(state)
        del state  # the engine's own tensors: nothing of them may reach the thread
        copy_s = time.perf_counter() - copy_started
        # Set before the thread starts: its end reads what the step waited.
        self._pending_blocked = (time.perf_counter() - started, waited, copy_s)
        self._pending = BackgroundWrite(
            step, temp, lambda: self._write(staged, temp, step), on_end=self._write_ended
        )

    def _write_ended(self, write: BackgroundWrite) -> None:
        """In the write's thread, as it ends: tell the daemon how it went (rank 0)."""
        failure = write.failure
        self._tell_ended(
            write.step,
            True,
            write.started_ns,
            self._pending_blocked[0],
            write.write_s or 0.0,
            failure.error if failure is not None else None,
        )

    def _tell_ended(
        self,
        step: int,
        asynchronous: bool,
        start_ns: int,
        blocked_s: float,
        write_s: float,
        error: BaseException | str | None = None,
    ) -> None:
        """Rank 0 publishes the end of a save's write for the telemetry (one per job)."""
        if self.rank != 0:
            return
        if isinstance(error, BaseException):
            error = describe_error(error)
        publish_save(
            CheckpointSaveSpan.ended(
                step=step,
                asynchronous=asynchronous,
                start_ns=start_ns,
                blocked_s=blocked_s,
                write_s=write_s,
                nbytes=self._written_bytes,
                error=error or "",
            )
        )

    def _write(self, state: dict[str, Any], temp: Path, step: int) -> None:
        """Write, make durable, and publish only once every rank's files are on disk.

        Every rank ends with the same outcome (all return or all raise), so no rank is left
        waiting in a collective for a peer that gave up.
        """
        assert self.root is not None
        self._written_bytes = None
        try:
            # DCP fsyncs each data file and `.metadata`; a rank's failure raises on every rank.
            save_state_dict(state, temp, process_group=self.group)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(temp, ignore_errors=True)  # give a full disk its space back
            raise
        own = sorted(p.name for p in temp.glob(f"__{self.rank}_*.distcp"))
        try:
            # The files' directory entries are durable too (a shared file system sees each
            # rank's own), then each rank checksums the data files it wrote.
            fsync_dir(temp)
            files: dict[str, dict[str, int]] | str = describe_files(temp, own)
        except OSError as exc:
            files = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        parts: list[Any] = [files]
        if self.group is not None:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, files, group=self.group)
        outcome = self._publish(parts, temp, step) if self.rank == 0 else None
        outcome = self._agree_on(lambda: outcome)
        if outcome is not None:
            raise CheckpointError(outcome)

    def _publish(self, parts: list[Any], temp: Path, step: int) -> str | None:
        """Rank 0: manifest, sync, rename, `latest`. Returns why it did not publish, or None."""
        assert self.root is not None
        problems = [part for part in parts if isinstance(part, str)]
        try:
            if problems:
                raise CheckpointError("; ".join(problems))
            merged: dict[str, dict[str, int]] = {}
            for part in parts:
                merged.update(part)
            merged.update(describe_files(temp, [".metadata"]))
            write_manifest(temp, merged, step)
            fsync_dir(temp)  # the manifest's rename, before the directory's own
            publish(self.root, temp, step, keep=self.config.keep)
            self._written_bytes = sum(entry["size"] for entry in merged.values())
        except Exception as exc:
            shutil.rmtree(temp, ignore_errors=True)
            return describe_error(exc)
        return None

    def _settle(self) -> None:
        """Wait for an asynchronous save; report (not raise) its failure, and its timing."""
        failure = self._join()
        if failure is not None:
            self.failed_saves.append(failure)
            message = f"plait: {failure.describe()}; training goes on"
            if self.last_published is not None:
                message += f", the previous checkpoint {self.last_published} is intact"
            log.error("%s", message.removeprefix("plait: "))
            if self.rank == 0:  # every rank has the same failure: one line for the job
                print(message, flush=True)

    def _join(self) -> SaveFailure | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.join()
        if pending.failure is not None:
            return pending.failure
        blocked, waited, copy_s = self._pending_blocked
        assert pending.write_s is not None
        self._record(SaveTiming(pending.step, True, blocked, waited, copy_s, pending.write_s))
        return None

    def _record(self, timing: SaveTiming) -> None:
        self.timings.append(timing)
        self.last_published = step_dir_name(timing.step)
        log.info("%s", timing.describe())

    def wait(self) -> None:
        """Block until an asynchronous save has been published; raise if it failed."""
        failure = self._join()
        if failure is not None:
            self.failed_saves.append(failure)
            raise CheckpointError(failure.describe())

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Wait for an asynchronous save; a failure is reported by name, not raised."""
        self._settle()


def _settle_at_exit(checkpointer: weakref.ref[Checkpointer]) -> None:
    live = checkpointer()
    if live is not None and live._pending is not None:
        live._settle()

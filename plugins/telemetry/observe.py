"""`plait.observe`: live MFU, the bottleneck split, stragglers and hangs for a training loop
plait did not launch — a plain loop, DDP or FSDP2 — with the telemetry of plait's own ranks.

    model = DDP(model)                                  # or fully_shard(...), or a plain module
    observer = plait.observe(model, optimizer=optimizer)
    for batch in loader:
        with observer.step() as step:                   # one optimizer step
            loss = loss_fn(model(batch["input_ids"]), batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step.loss = loss                            # optional: the model's `.loss` is read
    observer.close()                                    # optional: also done at exit

The observer hooks the module (forward pre/post hooks, a gradient hook on its outputs for the
backward) and the optimizer (step pre/post hooks) to split each step into data, forward,
backward and optimizer (`plait.plugins.telemetry.observe_timeline`); times DDP's gradient
buckets and FSDP2's all-gathers and reduce-scatters (`observe_comm`); counts the model's
FLOPs once (`observe_flops`) unless given; and learns who the rank is from torchrun or Slurm
(`observe_identity`). Each step becomes the same `StepReport` and comm records plait's engine
produces, queued to the same off-thread exporter (`RankTelemetry`), so the daemon cannot tell
an observed job from one of its own.

Telemetry starts at the first forward (the compute dtype is known then, autocast included).
With no daemon reachable the observer warns once, removes its hooks and every later step is a
no-op. Tokens per step are read from the model's integer inputs (`input_ids`) unless given;
the job's tokens are this rank's times the world size (every rank a data-parallel replica).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from plait.core.batches import loss_from_output
from plait.core.errors import PlaitError
from plait.core.memory import memory_report
from plait.core.step import PhaseSpan, StepReport
from plait.daemon import telemetry_schema as schema
from plait.daemon.address import resolve_daemon_address
from plait.plugins.telemetry.comm_links import CommLinks
from plait.plugins.telemetry.comm_records import CudaAnchor
from plait.plugins.telemetry.control_client import ControlClient
from plait.plugins.telemetry.observe_comm import CommLedger, install_ddp_hook, install_fsdp_comms
from plait.plugins.telemetry.observe_flops import ModelFlops
from plait.plugins.telemetry.observe_identity import (
    launch_host_map,
    launch_identity,
    model_device,
    observed_job_info,
)
from plait.plugins.telemetry.observe_timeline import StepClock, StepTimeline
from plait.plugins.telemetry.rank_telemetry import RankTelemetry

__all__ = ["Observer", "StepHandle", "observe"]

logger = logging.getLogger("plait.telemetry")

_OPEN: weakref.WeakSet[Observer] = weakref.WeakSet()


def observe(
    model: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    job_id: str | None = None,
    daemon: str | None = None,
    flops_per_token: float | None = None,
) -> Observer:
    """Watch `model` (plain, DDP- or FSDP2-wrapped: pass what the loop calls) and `optimizer`
    for the node daemon at `daemon` (else `$PLAIT_DAEMON`, else 127.0.0.1:7461).

    `flops_per_token`: training FLOPs per token (forward + backward), else counted over the
    first step. `job_id`: else `$PLAIT_JOB_ID`, torchrun's rendezvous id, Slurm's job id.
    Call on every rank, after wrapping the model and before training (and, for DDP, before
    `model.register_comm_hook`: plait's timing hook runs the one registered after it).
    """
    return Observer(
        model, optimizer=optimizer, job_id=job_id, daemon=daemon, flops_per_token=flops_per_token
    )


class StepHandle:
    """What `observer.step()` yields: the step's number, and a place for its loss."""

    __slots__ = ("loss", "number", "tokens")

    def __init__(self, number: int, tokens: int | None) -> None:
        self.number = number
        self.tokens = tokens
        # A tensor or a number; unset, the mean `.loss` (or scalar output) of the forwards.
        self.loss: torch.Tensor | float | None = None


@dataclass(slots=True)
class _EndedStep:
    """A step whose report waits for the device to pass its end (GPU) or for a logged loss."""

    timeline: StepTimeline
    rank_tokens: int
    loss: torch.Tensor | float | None
    lr: float


class Observer:
    """One rank's observation of a training loop; built by `plait.observe`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None,
        job_id: str | None,
        daemon: str | None,
        flops_per_token: float | None,
        module_hooks: bool = True,
    ) -> None:
        """`module_hooks=False`: forward and backward are marked by the caller (an adapter for a
        trainer that calls its module's methods directly, not through `forward`)."""
        if not isinstance(model, nn.Module):
            raise PlaitError(
                f"plait.observe: model must be a torch.nn.Module (plain, DDP or FSDP2), got "
                f"{type(model).__name__}"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise PlaitError(
                f"plait.observe: optimizer must be a torch.optim.Optimizer or None, got "
                f"{type(optimizer).__name__}"
            )
        if daemon is not None and (not isinstance(daemon, str) or ":" not in daemon):
            raise PlaitError(
                f"plait.observe: daemon must be 'host:port' or None ($PLAIT_DAEMON), got {daemon!r}"
            )
        self.model, self.optimizer = model, optimizer
        self.launch = launch_identity(job_id)
        self.flops = ModelFlops(flops_per_token)
        self.ledger = CommLedger()
        self.device = model_device(model)
        self.clock = StepClock(torch.cuda if self.device.type == "cuda" else None)
        self.telemetry: RankTelemetry | None = None
        # The control channel (`plait profile`, `plait stacks`, `plait memory`), once running.
        self._control: ControlClient | None = None
        self.state = "new"  # "on" once telemetry runs, "off" without a daemon, then "closed"
        self.last_step = -1
        self._address = resolve_daemon_address(daemon or "")
        self._next_number = 0
        self._timeline: StepTimeline | None = None
        self._handle: StepHandle | None = None
        self._rank_tokens = 0
        self._losses: list[torch.Tensor] = []
        self._previous_end: Any = None
        self._pending: deque[_EndedStep] = deque()
        self._held: _EndedStep | None = None
        self._failed = False
        self._ddp_hooked = isinstance(model, nn.parallel.DistributedDataParallel)
        if self._ddp_hooked:  # first: it refuses a model that already has a comm hook
            install_ddp_hook(model, self.ledger)
        install_fsdp_comms(model, self.ledger)
        self._hooks: list[Any] = []
        if module_hooks:
            self._hooks += [
                model.register_forward_pre_hook(self._before_forward, prepend=True,
                                                with_kwargs=True),
                model.register_forward_hook(self._after_forward, with_kwargs=True),
            ]  # fmt: skip
        if optimizer is not None:
            self._hooks += [
                optimizer.register_step_pre_hook(lambda *_: self.optimizer_started()),
                optimizer.register_step_post_hook(lambda *_: self.optimizer_finished()),
            ]
        _OPEN.add(self)

    # -- the loop's side --------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, tokens: int | None = None) -> Iterator[StepHandle]:
        """One optimizer step; `tokens`: this rank's tokens in it (else read from the inputs)."""
        handle = self.begin_step(tokens=tokens)
        try:
            yield handle
        except BaseException:
            self.abandon_step()
            raise
        self.end_step()

    def begin_step(self, *, tokens: int | None = None, number: int | None = None) -> StepHandle:
        """Start a step (`number`: the trainer's 0-based count, else the observer's own)."""
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                                   or tokens < 0):  # fmt: skip
            raise PlaitError(f"observer.step: tokens must be an int >= 0 or None, got {tokens!r}")
        if self._handle is not None:
            raise PlaitError("observer.step: a step is already open (steps do not nest)")
        number = self._next_number if number is None else number
        handle = self._handle = StepHandle(number, tokens)
        if self.state in ("off", "closed"):
            return handle
        clock = self.clock
        clock.anchor_if_idle()
        start = self._previous_end or clock.mark()
        self._timeline = StepTimeline(number, clock, start, anchor=clock.anchor)
        self.ledger.step = number
        if clock.anchor is not None:
            self.ledger.cuda_anchor = CudaAnchor(clock.anchor.event, clock.anchor.wall_ns)
        self._rank_tokens, self._losses = 0, []
        self.flops.start_counting()
        control = self._control
        if control is not None:
            control.step = number  # where `plait stacks` says the rank is
            if control.armed:  # a profile or memory capture may start with this step
                control.step_started(number)
        return handle

    def end_step(self, *, hold: bool = False) -> None:
        """End the open step and queue its report (`hold`: keep it until `release()`, for a
        trainer that logs the step's loss after its end)."""
        timeline, handle = self._timeline, self._handle
        if handle is None:
            raise PlaitError("observer.end_step: no step is open")
        self._timeline = self._handle = None
        self._next_number = handle.number + 1
        rank_tokens = handle.tokens if handle.tokens is not None else self._rank_tokens
        self.flops.stop_counting(rank_tokens, completed=True)
        if timeline is None:
            return
        if self.state == "new":
            self._start_telemetry()  # a step without a forward
        if self.state != "on":
            return
        self._failed = False
        loss = self._step_loss(handle)  # queued before the end mark, on a GPU
        self._previous_end = timeline.finish()
        self.ledger.step = None
        self.last_step = handle.number
        ended = _EndedStep(timeline, rank_tokens, loss, self._learning_rate())
        if hold:
            self.release()
            self._held = ended
        else:
            self._pending.append(ended)
        self._send_ready(final=False)
        control = self._control
        if control is not None and control.armed:
            control.step_finished(handle.number)  # after the step's spans are queued

    def abandon_step(self) -> None:
        """The open step failed: drop it (the run is marked failed unless a step succeeds)."""
        control, handle = self._control, self._handle
        if control is not None and control.armed and handle is not None:
            control.step_finished(handle.number)  # a capture's step ends with it
        self.flops.stop_counting(None, completed=False)
        self._timeline = self._handle = None
        self.ledger.step = None
        self._previous_end = None
        self._failed = True

    @property
    def step_open(self) -> bool:
        return self._handle is not None

    def note_loss(self, loss: Any) -> None:
        """A micro-batch's loss (the step reports their mean unless `step.loss` is set)."""
        if self._timeline is not None and isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())

    def optimizer_started(self) -> None:
        if self._timeline is not None:
            self._timeline.optimizer_started()

    def optimizer_finished(self) -> None:
        if self._timeline is not None:
            self._timeline.optimizer_finished()

    def set_loss(self, loss: float) -> None:
        """The loss of the held step (a trainer's logged loss)."""
        if self._held is not None:
            self._held.loss = float(loss)

    def release(self) -> None:
        """Send the held step."""
        if self._held is not None:
            self._pending.append(self._held)
            self._held = None
            self._send_ready(final=False)

    def close(self, outcome: str | None = None) -> None:
        """Send what is left and tell the daemon the run ended (`finished`, or `failed` when the
        last step raised). Idempotent; also run at interpreter exit."""
        if self.state == "closed":
            return
        state, self.state = self.state, "closed"
        _OPEN.discard(self)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._timeline is not None:
            self.abandon_step()
        telemetry = self.telemetry
        if state != "on" or telemetry is None:
            return
        self.release()
        if self.clock.cuda is not None:
            self.clock.cuda.synchronize()  # once, at the end: the last steps' events complete
        self._send_ready(final=True)
        self.ledger.active = False
        outcome = outcome or (schema.JOB_OUTCOME_FAILED if self._failed else
                              schema.JOB_OUTCOME_FINISHED)  # fmt: skip
        telemetry.end_job(outcome, last_step=self.last_step)
        telemetry.shutdown()

    def __enter__(self) -> Observer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.close(schema.JOB_OUTCOME_FAILED if kind is not None else None)

    # -- hooks ------------------------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._timeline is None:
            return
        if self.state == "new":
            self._start_telemetry()
        if self.state != "on":
            return
        if not self._ddp_hooked:
            self._hook_enclosing_ddp(module)
        tokens = count_tokens(args, kwargs) if self._handle and self._handle.tokens is None else 0
        self.forward_started(tokens)

    def forward_started(self, tokens: int = 0) -> None:
        """A forward begins (`tokens`: its token ids, counted when the step was given none)."""
        timeline = self._timeline
        if timeline is None:
            return
        if self.state == "new":
            self._start_telemetry()
        if self.state != "on":
            return
        self._rank_tokens += tokens
        timeline.forward_started()

    def forward_finished(self) -> None:
        if self._timeline is not None:
            self._timeline.forward_finished()

    def backward_started(self) -> None:
        if self._timeline is not None:
            self._timeline.backward_started()

    def backward_finished(self) -> None:
        if self._timeline is not None:
            self._timeline.backward_finished()

    def _hook_enclosing_ddp(self, module: nn.Module) -> None:
        """A module observed inside a DDP wrapper (a trainer that wraps it and hands out the
        inner module): time the wrapper's buckets, found while it runs this forward."""
        self._ddp_hooked = True
        active = getattr(nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)
        ddp = active() if active is not None else None
        if ddp is None or ddp.module is not module:
            return
        try:
            install_ddp_hook(ddp, self.ledger)
        except PlaitError as error:  # a comm hook the trainer registered: not timed
            logger.warning("%s; its gradient buckets are not timed", error)

    def _after_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        timeline = self._timeline
        if timeline is None or timeline.forward_finished() is None:
            return
        self.note_loss(loss_from_output(output))
        self.watch_backward(output)

    def watch_backward(self, output: Any) -> None:
        """Mark the backward through `output`'s tensors: it starts when the first of their
        gradients is computed and ends when autograd finishes the pass."""
        if not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):
            # One tensor: a hook of its own, much lighter than a multi-grad hook.
            if output.requires_grad:
                output.register_hook(self._backward_started)
            return
        outputs = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(
                outputs, self._backward_started, mode="any"
            )

    def _backward_started(self, _grad: torch.Tensor) -> None:
        timeline = self._timeline
        if timeline is None:
            return
        timeline.backward_started()
        # Runs when this backward pass is over (before DDP's wait for its last buckets, which
        # is queued later: the wait shows as the buckets' exposed tail).
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self) -> None:
        self.backward_finished()

    # -- reports ----------------------------------------------------------------------------------

    def _start_telemetry(self) -> None:
        info = observed_job_info(
            self.model,
            self.launch,
            flops_per_token=self.flops.per_token or 0.0,
            tokens_per_step=0,
            memory_report=functools.partial(memory_report, self.model, self.optimizer),
        )
        telemetry = RankTelemetry.start(info, self._address)
        if telemetry is None:  # warned once; nothing more to do in this run
            self.state = "off"
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            self.flops.stop_counting(None, completed=False)
            self._timeline = None
            return
        self.telemetry, self.state = telemetry, "on"
        host_map = launch_host_map(self.launch.world_size)
        self.ledger.links = CommLinks(self.launch.rank, host_map) if host_map else None
        self.ledger.active = True
        telemetry.start_heartbeat(self.ledger.in_flight)
        self._control = telemetry.control
        if self._handle is not None:
            self._control.step = self._handle.number

    def _step_loss(self, handle: StepHandle) -> torch.Tensor | float | None:
        loss: Any = handle.loss
        losses = self._losses
        if loss is None and losses:
            many = len(losses) > 1
            loss = (
                torch.stack([t.float().reshape(()) for t in losses]).mean() if many else losses[0]
            )
        if isinstance(loss, torch.Tensor):
            if loss.device.type == "cpu" and loss.numel() == 1:
                return float(loss.item())  # on the host already: read now, no copies
            loss = loss.detach().float().reshape(-1)[:1]
            # Copied to host memory behind the step's work; read once the step's end event has
            # completed, so the training thread never waits for the device.
            return loss.to("cpu", non_blocking=True) if loss.is_cuda else float(loss)
        return None if loss is None else float(loss)

    def _learning_rate(self) -> float:
        if self.optimizer is None or not self.optimizer.param_groups:
            return 0.0
        lr = self.optimizer.param_groups[0].get("lr", 0.0)
        return float(lr)

    def _send_ready(self, *, final: bool) -> None:
        telemetry = self.telemetry
        if telemetry is None:
            return
        while self._pending and (final or self._pending[0].timeline.ready()):
            telemetry.spans.put_step(self._report(self._pending.popleft()))
        telemetry.spans.put_comm(self.ledger.take_finished(final=final))

    def _report(self, ended: _EndedStep) -> StepReport:
        timeline = ended.timeline
        start_ns, data_end_ns, end_ns = timeline.bounds_ns()
        world = self.launch.world_size
        loss = ended.loss
        value = float(loss) if loss is not None else math.nan
        return StepReport(
            step=timeline.number,
            loss=value,
            tokens=ended.rank_tokens * world,
            step_seconds=max(end_ns - start_ns, 0) / 1e9,
            data_wait_seconds=max(data_end_ns - start_ns, 0) / 1e9,
            model_flops=self.flops.job_flops(ended.rank_tokens, world),
            lr=ended.lr,
            start_ns=start_ns,
            end_ns=end_ns,
            spans=tuple(timeline.phases),
            phase_seconds=_phase_totals(timeline.phases),
        )


def count_tokens(args: Any, kwargs: Any) -> int:
    """Token ids in a forward's inputs: `input_ids`, else the first tensor if it holds
    integers (0 when the inputs are not token ids)."""
    ids = kwargs.get("input_ids") if isinstance(kwargs, dict) else None
    if not isinstance(ids, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
        ids = args[0]  # the first leaf of the inputs, without flattening them
    elif not isinstance(ids, torch.Tensor):
        ids = next((t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), None)
    if ids is None or ids.is_floating_point() or ids.is_complex():
        return 0
    return ids.numel()


def _phase_totals(spans: list[PhaseSpan]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for span in spans:
        totals[span.name] = totals.get(span.name, 0.0) + (span.end_ns - span.start_ns) / 1e9
    return totals


def close_open_observers() -> None:
    """Close every observer still open (at interpreter exit: the daemon sees the run end)."""
    for observer in list(_OPEN):
        observer.close()


atexit.register(close_open_observers)

"""The pipeline runtime: runs a rank's schedule actions on its model chunks over P2P messages.

Execution model (the one `checker.check_schedule` verifies): a rank runs its action list in
order; a send is an asynchronous `comm.send` issued right after the compute that produced its
tensor and completed at `SyncGradients`; a receive is waited on before the next action (the
schedule builder puts receives right before the compute that needs the last of them, and a
channel delivers in order, so this never waits longer than waiting at the compute would). A
receive is posted ahead, before the compute action that precedes it in the list, so the
peer's message travels while this rank computes; receives keep their list order. Shapes are
known in advance — `[micro_batch, seq, dim]` in the parameters' dtype — so no shape is ever
exchanged.

A rank's first global stage consumes the micro-batch's inputs, its last computes the loss with
the engine's loss function. A built-in model's chunk is called as `chunk(tokens_or_hidden,
positions=…, documents=…)` with the micro-batch's positions and documents of packed rows on
every stage (`stages.ChunkInputs`); a stage of any other model (`stages.ModelStage`) as
`stage(hidden_or_None, batch)`, so it can read positions, masks and labels from the
micro-batch. Parameters that two stages on different ranks share (tied input and output
embeddings) get their gradients summed over the pipeline ranks at `SyncGradients`, so every
copy takes the same optimizer step.

Zero-bubble schedules split the backward: the input gradient (`Backward(kind=
"input")`) runs autograd only towards the stage input and keeps the gradients of the
intermediate tensors that weights hang off (torch's own zero-bubble helper
`stage_backward_input` does this graph surgery); the weight gradient (`kind="weight"`) finishes
from those through autograd, without replaying the input path, so gradient hooks fire as usual.

The runtime measures every compute action and every wait for a peer. Waits become `idle` phase
spans of the step; at `SyncGradients` the pipeline ranks exchange (busy time, first compute
start, last compute end) and `last_bubble_fraction` is `1 - Σ busy / (P · makespan)`, the same
definition `timeline.simulate_timeline` uses for the theoretical figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input

from plait.core.batches import input_tokens
from plait.core.comm import Work
from plait.core.comm_algorithms import GENERIC
from plait.core.grad_norm import mark_sharded
from plait.core.schedule import (
    Action,
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleRequest,
    SendActivation,
    SendGrad,
)
from plait.core.sharding import ParallelRuntime, ShardContext, StepState
from plait.core.state_layout import StateLayout
from plait.core.step import PhaseSpan
from plait.plugins.pipeline.layout import pipeline_layout
from plait.plugins.pipeline.split import StagePlan
from plait.plugins.pipeline.stages import ChunkInputs, ModelStage
from plait.plugins.pipeline.topology import Layout

MessageKey = tuple[str, int, int]  # ("activation" | "grad", micro-batch, local chunk)
# `StageTimes` kinds, by `Backward.kind`, named as `timeline.ActionCosts`' fields
BACKWARD_KINDS = {"full": "backward", "input": "backward_input", "weight": "backward_weight"}


@dataclass
class _Saved:
    """What a forward leaves for its backward."""

    stage_input: Any  # the received activation, or the micro-batch's inputs on a first stage
    output: torch.Tensor  # the scaled loss on the last stage
    output_grad: torch.Tensor | None = None
    param_groups: list[dict[str, Any]] | None = None  # from the input-gradient half


@dataclass
class StageTimes:
    """One rank's measured step: compute time, waits for peers, and the compute window."""

    busy_seconds: float = 0.0
    # Waits for a peer's message inside the window (a last stage's wait for its first
    # activation comes before the window, and is not the pipeline's to count).
    recv_wait_seconds: float = 0.0
    first_start_ns: int = 0
    last_end_ns: int = 0
    # compute seconds and action count by kind ("forward", "backward", "backward_input",
    # "backward_weight"): what a replay of the schedule with this rank's costs needs
    kind_seconds: dict[str, float] = field(default_factory=dict)
    kind_counts: dict[str, int] = field(default_factory=dict)

    def mean_seconds(self, kind: str) -> float | None:
        count = self.kind_counts.get(kind, 0)
        return self.kind_seconds[kind] / count if count else None

    @property
    def window_seconds(self) -> float:
        return max(0, self.last_end_ns - self.first_start_ns) / 1e9

    @property
    def idle_seconds(self) -> float:
        """Waits for peers plus gaps between actions, inside this rank's compute window."""
        return max(0.0, self.window_seconds - self.busy_seconds)

    @property
    def host_seconds(self) -> float:
        """The gaps between actions that are not waits: the runtime's own host work in the
        window (posting receives, sends, bookkeeping)."""
        return max(0.0, self.idle_seconds - self.recv_wait_seconds)


@dataclass
class _StepRun:
    """The state of one optimizer step on this rank."""

    state: StepState
    saved: dict[tuple[int, int], _Saved] = field(default_factory=dict)
    received: dict[MessageKey, torch.Tensor] = field(default_factory=dict)
    # Receives posted ahead, before the compute that precedes them in the action list.
    posted: dict[MessageKey, tuple[Work, torch.Tensor]] = field(default_factory=dict)
    ahead: dict[Action, list[RecvActivation | RecvGrad]] = field(default_factory=dict)
    outgoing: dict[MessageKey, torch.Tensor] = field(default_factory=dict)
    sends: list[tuple[Work, torch.Tensor]] = field(default_factory=list)
    idle_spans: list[PhaseSpan] = field(default_factory=list)
    times: StageTimes = field(default_factory=StageTimes)


class PipelineRuntime(ParallelRuntime):
    """Forward, backward and P2P handlers for this rank's chunks (by local chunk index)."""

    name = "pipeline"

    def __init__(
        self,
        *,
        chunks: Sequence[nn.Module],
        plan: StagePlan,
        context: ShardContext,
        hidden_dim: int,
        measure_bubble: bool = True,
        tied: Sequence[tuple[torch.Size, nn.Parameter | None]] = (),
    ) -> None:
        self.chunks = list(chunks)
        self.plan = plan
        self.layout = Layout(plan.num_stages, plan.virtual_stages)
        self.context = context
        self.comm = context.comm
        self.group = context.mesh.group("pp")
        self.rank = context.mesh.coordinate("pp")
        self.hidden_dim = hidden_dim
        self.measure_bubble = measure_bubble
        self.last_bubble_fraction: float | None = None
        self.last_stage_times: StageTimes | None = None
        self._run: _StepRun | None = None
        self._ahead: dict[int, dict[Action, list[RecvActivation | RecvGrad]]] = {}
        # (shape, this rank's copy or None) of every parameter stages on several ranks share,
        # in the same order on every pipeline rank.
        self.tied = list(tied)

    def _is_first(self, chunk: int) -> bool:
        return self.layout.global_stage(self.rank, chunk) == 0

    def _is_last(self, chunk: int) -> bool:
        return self.layout.global_stage(self.rank, chunk) == self.layout.last_global_stage

    def _activation_dtype(self) -> torch.dtype:
        for p in self.chunks[0].parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.get_default_dtype()

    # -- ParallelRuntime -----------------------------------------------------------------------

    def action_handlers(self, step: StepState) -> dict[type, Callable[[Any], None]]:
        # Marked every step: later transforms or materialisation may have replaced the
        # Parameter objects since the split. One pipeline stage holds each parameter, so the
        # global gradient norm counts it once across the pp axis.
        tied = {id(p) for _, p in self.tied if p is not None}
        for chunk in self.chunks:
            for p in chunk.parameters():
                # A tied copy is held whole by two pipeline ranks (first and last stage): with
                # pp = 2 it is replicated over pp, and its norm counts once per replica.
                if id(p) not in tied:
                    mark_sharded(p, ("pp",))
        run = _StepRun(state=step, ahead=self._receives_ahead(step.num_microbatches))
        self._run = run
        return {
            Forward: lambda action: self._forward(run, action),
            Backward: lambda action: self._backward(run, action),
            SendActivation: lambda action: self._send(run, action, "activation"),
            SendGrad: lambda action: self._send(run, action, "grad"),
            RecvActivation: lambda action: self._recv(run, action, "activation"),
            RecvGrad: lambda action: self._recv(run, action, "grad"),
        }

    def _receives_ahead(
        self, num_microbatches: int
    ) -> dict[Action, list[RecvActivation | RecvGrad]]:
        """For each compute action, the receives that follow it in this rank's action list
        (before the next compute): they are posted before it runs, so the peer's message
        arrives while this rank computes instead of after. Channel order is kept: receives are
        posted in list order, only earlier."""
        if num_microbatches not in self._ahead:
            config = self.context.config
            actions = self.context.plugins.schedule(
                ScheduleRequest(
                    name=config.schedule.name,
                    num_microbatches=num_microbatches,
                    stage=self.context.mesh.coordinate("pp"),
                    num_stages=self.context.mesh.size("pp"),
                    virtual_stages=config.schedule.virtual_stages,
                )
            )
            ahead: dict[Action, list[RecvActivation | RecvGrad]] = {}
            compute: Action | None = None
            for action in actions:
                if isinstance(action, Forward | Backward):
                    compute = action
                elif isinstance(action, RecvActivation | RecvGrad) and compute is not None:
                    ahead.setdefault(compute, []).append(action)
            self._ahead[num_microbatches] = ahead
        return self._ahead[num_microbatches]

    def _post_ahead(self, run: _StepRun, action: Forward | Backward) -> None:
        for receive in run.ahead.get(action, ()):
            kind = "activation" if isinstance(receive, RecvActivation) else "grad"
            key = (kind, receive.microbatch, receive.chunk)
            run.posted[key] = self._post_recv(run, receive, kind)

    def sync_gradients(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        if run.posted:
            raise RuntimeError(
                f"pipeline rank {self.rank}: receives {sorted(run.posted)} were posted ahead "
                "but the step never reached them; the executed actions differ from the schedule"
            )
        for work, _ in run.sends:
            work.wait()
        run.sends.clear()
        self._sum_tied_gradients()
        if run.saved or run.received:
            raise RuntimeError(
                f"pipeline rank {self.rank}: the step ended with {len(run.saved)} forwards "
                f"without backward and {len(run.received)} received tensors never used; the "
                "schedule is not complete"
            )
        self.last_stage_times = run.times
        if self.measure_bubble:
            self.last_bubble_fraction = self._pipeline_bubble(run.times)
            for span in run.idle_spans:
                span.attributes["bubble_fraction"] = self.last_bubble_fraction
        run.state.extra_spans.extend(run.idle_spans)

    def _sum_tied_gradients(self) -> None:
        """Each copy of a shared parameter got the gradient of its own stage's use; the sum over
        the pipeline ranks is the full model's gradient (ranks without a copy add zeros)."""
        if not self.tied:
            return
        device = self.context.device
        dtype = self._activation_dtype()
        flat = torch.cat(
            [
                (
                    p.grad.detach().reshape(-1).to(device, dtype)
                    if p is not None and p.grad is not None
                    else torch.zeros(shape.numel(), dtype=dtype, device=device)
                )
                for shape, p in self.tied
            ]
        )
        self.comm.all_reduce(flat, group=self.group, op="sum", purpose=GENERIC)
        offset = 0
        for shape, p in self.tied:
            piece = flat[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
            if p is None:
                continue
            if p.grad is None:
                p.grad = piece.to(p.dtype).clone()
            else:
                p.grad.copy_(piece)

    def state_layout(self, previous: StateLayout) -> StateLayout:
        return pipeline_layout(previous, self.chunks)

    def _pipeline_bubble(self, times: StageTimes) -> float:
        """`1 - Σ busy / (P · makespan)` over the pipeline ranks of this rank's replica."""
        mine = torch.tensor(
            [times.busy_seconds, times.first_start_ns / 1e9, times.last_end_ns / 1e9],
            dtype=torch.float64,
        )
        every = torch.empty(self.group.size * 3, dtype=torch.float64)
        self.comm.all_gather(every, mine, group=self.group, purpose="metrics")
        busy, starts, ends = every.view(-1, 3).unbind(1)
        makespan = float(ends.max() - starts.min())
        if makespan <= 0:
            return 0.0
        return max(0.0, 1.0 - float(busy.sum()) / (self.group.size * makespan))

    # -- handlers ------------------------------------------------------------------------------

    def _timed(self, run: _StepRun, start_ns: int, kind: str) -> None:
        end = time.time_ns()
        times = run.times
        seconds = (end - start_ns) / 1e9
        times.busy_seconds += seconds
        times.kind_seconds[kind] = times.kind_seconds.get(kind, 0.0) + seconds
        times.kind_counts[kind] = times.kind_counts.get(kind, 0) + 1
        times.first_start_ns = min(times.first_start_ns or start_ns, start_ns)
        times.last_end_ns = max(times.last_end_ns, end)

    def _forward(self, run: _StepRun, action: Forward) -> None:
        mb, chunk = action.microbatch, action.chunk
        self._post_ahead(run, action)
        run.state.runner.before_forward(action)
        start = time.time_ns()
        batch = run.state.inputs[mb]
        if self._is_first(chunk):
            stage_input = batch
        else:
            stage_input = run.received.pop(("activation", mb, chunk)).requires_grad_()
        module = self.chunks[chunk]
        if isinstance(module, ModelStage):
            output = module(None if self._is_first(chunk) else stage_input, batch)
        else:
            inputs = ChunkInputs.of(batch)
            hidden = inputs.tokens if self._is_first(chunk) else stage_input
            output = module(hidden, **inputs.keywords())
        if self._is_last(chunk):
            output = run.state.runner.loss(run.state, mb, output)
        else:
            run.outgoing[("activation", mb, chunk)] = output.detach().to(self._activation_dtype())
        run.saved[(mb, chunk)] = _Saved(stage_input=stage_input, output=output)
        self._timed(run, start, "forward")

    def _backward(self, run: _StepRun, action: Backward) -> None:
        mb, chunk = action.microbatch, action.chunk
        key = (mb, chunk)
        self._post_ahead(run, action)
        if action.kind != "weight" and not self._is_last(chunk):
            run.saved[key].output_grad = run.received.pop(("grad", mb, chunk))
        run.state.runner.before_backward(action)
        if action.kind == "full":
            start = time.time_ns()
            saved = run.saved.pop(key)
            grads = None if saved.output_grad is None else [saved.output_grad]
            torch.autograd.backward([saved.output], grads)
            # A first stage's input is the batch (token ids, or a dict of them): no gradient.
            input_grad = None if self._is_first(chunk) else saved.stage_input.grad
            self._queue_input_grad(run, action, input_grad)
        elif action.kind == "input":
            start = time.time_ns()
            saved = run.saved[key]
            # The first stage's input is token ids: there is no input gradient to hurry, so its
            # whole backward runs as the weight half (as torch's zero-bubble stages do).
            if not self._is_first(chunk):
                grads = None if saved.output_grad is None else [saved.output_grad]
                params = self._params(chunk)
                input_grads, saved.param_groups = stage_backward_input(
                    [saved.output], grads, [saved.stage_input], iter(params)
                )
                self._check_weight_groups(chunk, params, saved.param_groups)
                self._queue_input_grad(run, action, input_grads[0])
        else:
            start = time.time_ns()
            saved = run.saved.pop(key)
            if saved.param_groups is not None:
                self._backward_weight(chunk, saved.param_groups)
            else:
                grads = None if saved.output_grad is None else [saved.output_grad]
                torch.autograd.backward([saved.output], grads)
        self._timed(run, start, BACKWARD_KINDS[action.kind])

    def _check_weight_groups(
        self, chunk: int, params: list[nn.Parameter], param_groups: list[dict[str, Any]]
    ) -> None:
        """Every weight must hang off the input path, or the split backward would drop its
        gradient (the output side of the graph is already released)."""
        covered = set().union(*(group["params"] for group in param_groups))
        missing = [p for p in params if _get_grad_fn_or_grad_acc(p) not in covered]
        if missing:
            names = {id(p): n for n, p in self.chunks[chunk].named_parameters()}
            raise RuntimeError(
                f"pipeline rank {self.rank}, chunk {chunk}: the split backward cannot reach "
                f"{[names.get(id(p), '?') for p in missing]} from the stage input; use a "
                "schedule with full backwards (1f1b)"
            )

    def _backward_weight(self, chunk: int, param_groups: list[dict[str, Any]]) -> None:
        """The weight half of a split backward, from the intermediate gradients the input half
        saved. Unlike torch's `stage_backward_weight` (which adds `autograd.grad` results to
        `.grad` by hand), the gradients accumulate through autograd, so post-accumulate-grad
        hooks — data-parallel buckets, tensor-parallel sums — fire as in a full backward."""
        param_of = {_get_grad_fn_or_grad_acc(p): p for p in self._params(chunk)}
        for index, group in enumerate(param_groups):
            edges: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for saved_grads, intermediate in zip(
                group["grads"], group["intermediates"], strict=True
            ):
                for slot, grad in enumerate(saved_grads):
                    if grad is not None:
                        edges.append(GradientEdge(intermediate, slot))
                        grads.append(grad)
            if not edges:
                continue
            handles = []
            if len(group["intermediates"]) > 1:
                # An intermediate may feed another one of the group: pin each to its saved
                # gradient so nothing flowing in from a sibling is counted twice.
                handles = [
                    intermediate.register_prehook(lambda _, saved=saved_grads: saved)
                    for saved_grads, intermediate in zip(
                        group["grads"], group["intermediates"], strict=True
                    )
                ]
            try:
                torch.autograd.backward(
                    edges,  # type: ignore[arg-type]
                    grad_tensors=grads,
                    inputs=[param_of[node] for node in group["params"]],
                    retain_graph=index < len(param_groups) - 1,
                )
            finally:
                for handle in handles:
                    handle.remove()

    def _params(self, chunk: int) -> list[nn.Parameter]:
        return [p for p in self.chunks[chunk].parameters() if p.requires_grad]

    def _queue_input_grad(self, run: _StepRun, action: Backward, grad: torch.Tensor | None) -> None:
        if self._is_first(action.chunk):
            return
        if grad is None:
            raise RuntimeError(
                f"pipeline rank {self.rank}: chunk {action.chunk} produced no gradient for its "
                f"input on micro-batch {action.microbatch}"
            )
        key = ("grad", action.microbatch, action.chunk)
        run.outgoing[key] = grad.detach().to(self._activation_dtype())

    def _send(self, run: _StepRun, action: SendActivation | SendGrad, kind: str) -> None:
        tensor = run.outgoing.pop((kind, action.microbatch, action.chunk)).contiguous()
        work = self.comm.send(
            tensor,
            dst=self.group.ranks[action.peer_stage],
            group=self.group,
            async_op=True,
            purpose="activation" if kind == "activation" else "activation_grad",
        )
        # The tensor must outlive the send: it is released once the send completes.
        run.sends.append((work, tensor))

    def _boundary_shape(self, inputs: Any) -> tuple[int, int, int]:
        """[micro_batch, seq, dim] of the hidden states between stages; under sequence
        parallelism the residual stream between blocks holds this rank's sequence shard."""
        batch, seq = input_tokens(inputs).shape[:2]
        tensor_parallel = self.context.tensor_parallel
        if tensor_parallel is not None and tensor_parallel.sequence_parallel:
            seq //= tensor_parallel.degree
        return batch, seq, self.hidden_dim

    def _post_recv(
        self, run: _StepRun, action: RecvActivation | RecvGrad, kind: str
    ) -> tuple[Work, torch.Tensor]:
        shape = self._boundary_shape(run.state.inputs[action.microbatch])
        buffer = torch.empty(shape, dtype=self._activation_dtype(), device=self.context.device)
        work = self.comm.recv(
            buffer,
            src=self.group.ranks[action.peer_stage],
            group=self.group,
            async_op=True,
            purpose="activation" if kind == "activation" else "activation_grad",
        )
        return work, buffer

    def _recv(self, run: _StepRun, action: RecvActivation | RecvGrad, kind: str) -> None:
        mb = action.microbatch
        posted = run.posted.pop((kind, mb, action.chunk), None)
        work, buffer = posted if posted is not None else self._post_recv(run, action, kind)
        start = time.time_ns()
        work.wait()
        end = time.time_ns()
        if run.times.first_start_ns:  # inside the compute window
            run.times.recv_wait_seconds += (end - start) / 1e9
        run.idle_spans.append(
            PhaseSpan(
                name="idle",
                start_ns=start,
                end_ns=end,
                microbatch=mb,
                chunk=action.chunk,
                attributes={"waiting_for": kind, "peer_stage": action.peer_stage},
            )
        )
        run.received[(kind, mb, action.chunk)] = buffer

"""The engine: mesh, model, shard transforms, optimizer and one `train_step` that runs a schedule.

`plait.initialize(model, config=...)` is the public entry for users with their own loop (like
`deepspeed.initialize`); `plait train` builds the same engine around a built-in model.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from plait.core.batches import (
    batch_rows,
    call_model,
    default_loss,
    input_tokens,
    split_batch,
    to_device,
)
from plait.core.checks import check_config
from plait.core.comm import Comm
from plait.core.config import PlaitConfig, load_config
from plait.core.document_inputs import DocumentInputs, ModelInputs, attention_square
from plait.core.errors import ConfigError, InertSelection, PlaitError, ScheduleError
from plait.core.executor import Executor
from plait.core.flops import register_cpu_attention_flops
from plait.core.grad_norm import clip_grads_, global_grad_norm
from plait.core.host import cpu_model, host_name
from plait.core.kernels import Kernels
from plait.core.manual_loop import ManualLoop
from plait.core.memory import memory_report
from plait.core.mesh import Mesh
from plait.core.microbatch import MicrobatchRunner
from plait.core.microbatch_count import default_microbatch_count
from plait.core.optim import default_optimizer_factory, warmup_cosine
from plait.core.phase_timing import PhaseTimer
from plait.core.plugins import Plugins
from plait.core.records import SHARD_ORDER
from plait.core.schedule import (
    Action,
    Backward,
    Forward,
    MicrobatchPosition,
    OptimizerStep,
    ScheduleRequest,
    SyncGradients,
    microbatch_positions,
)
from plait.core.selection_check import FALLBACK_SCHEDULE, SelectionCheck
from plait.core.sharding import ParallelRuntime, ShardContext, StepState
from plait.core.step import JobInfo, PhaseSpan, StepReport
from plait.core.token_loss import LossCounting, TokenWeights, scored_tokens, token_weights
from plait.core.transformers_models import prepare_for_training

OptimizerArg = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]
ConfigArg = str | Path | Mapping[str, Any] | PlaitConfig


def initialize(
    model: nn.Module,
    *,
    config: ConfigArg,
    optimizer: OptimizerArg | None = None,
    loss_fn: LossFn | None = None,
    plugins: Plugins | None = None,
) -> Engine:
    """Wrap a user's `nn.Module` in the configured parallel strategies.

    `optimizer` is a callable taking parameters (e.g. `lambda ps: torch.optim.SGD(ps, lr=0.1)`);
    by default the config's AdamW with warmup + cosine. `loss_fn(output, targets)` defaults to
    token cross-entropy. Call from every rank (under torchrun, or in one process).
    """
    return Engine(config=config, model=model, optimizer=optimizer, loss_fn=loss_fn, plugins=plugins)


class Engine:
    """One rank's training state; `train_step(batch)` runs one optimizer step."""

    def __init__(
        self,
        *,
        config: ConfigArg,
        model: nn.Module | None = None,
        optimizer: OptimizerArg | None = None,
        loss_fn: LossFn | None = None,
        plugins: Plugins | None = None,
        overrides: Sequence[str] = (),
    ) -> None:
        self.config = load_config(config, overrides)
        cfg = self.config
        self.plugins = plugins or Plugins.create(blocked=cfg.plugins.disable)
        self._check_plugin_sections()
        self.mesh = self._build_mesh()
        self.device = self.mesh.device
        self.kernels = Kernels(
            self.plugins,
            prefer=cfg.kernels.prefer,
            overrides=cfg.kernels.overrides,
            provider=cfg.kernels.provider,
        )
        self.comm = Comm(self.plugins)
        self.plugins.switch_off(cfg.plugins_switched_off())
        self.plugins.configure(cfg)
        # The plugins the config selects by name must act (checked over the first steps).
        self.selection_check = SelectionCheck(
            config=cfg,
            plugins=self.plugins,
            kernels=self.kernels,
            comm=self.comm,
            rank=dist.get_rank() if dist.is_initialized() else 0,
        )
        torch.manual_seed(cfg.train.seed)

        self.model_record = None
        self.model_config: Any = None
        self.flops_per_token = 0.0
        self._attention_flops_per_square = 0.0
        if model is None:
            model = self._build_builtin_model()
        self.context = ShardContext(
            mesh=self.mesh,
            config=cfg,
            comm=self.comm,
            kernels=self.kernels,
            plugins=self.plugins,
            device=self.device,
            model_record=self.model_record,
            model_config=self.model_config,
        )
        self.runtimes: list[ParallelRuntime] = []
        model_counting = self._read_model_inputs(model)
        self.module = self._shard(model)
        self._refuse_an_unused_shard_split()
        self.loss_fn = self._choose_loss_fn(loss_fn)
        # Which tokens a step's losses are means over (`plait.core.token_loss`): a replacement
        # loss is a token cross-entropy; a user's loss_fn is opaque; else the model's default.
        self._loss_counting: LossCounting = model_counting
        if self._loss_replaced:
            self._loss_counting = "targets"
        elif loss_fn is not None:
            self._loss_counting = None
        self.optimizer = self._build_optimizer(optimizer)
        self.lr_scheduler = (
            torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, warmup_cosine(cfg.optimizer, cfg.train)
            )
            if optimizer is None
            else None
        )
        # Groups used every step are created now: creating a group is collective. The cp ranks
        # of a replica each hold a loss over their positions: the loss is averaged over them.
        cp = ("cp",) if self.mesh.size("cp") > 1 else ()
        self._loss_group = self.mesh.group("pp", "dp", *cp)
        if cfg.train.flops_per_token > 0:
            self.flops_per_token = cfg.train.flops_per_token
            self._attention_flops_per_square = 0.0  # the user's figure is taken as it is
        # A model without a FLOPs formula is counted on the first step, summed over the ranks
        # that split one replica's work.
        self._flops_group = self.mesh.group("pp", *cp, "tp") if self.flops_per_token == 0 else None
        self._actions: dict[int, list[Action]] = {}
        self._positions: dict[int, dict[Action, MicrobatchPosition]] = {}
        self.global_step = 0  # optimizer steps taken (restored by a checkpoint resume)
        self.last_report: StepReport | None = None
        self._last_grad_norm = torch.tensor(float("nan"))
        self._skipped = False
        self._manual: ManualLoop | None = None
        self.plugins.job_start(self.job_info())

    # -- construction ---------------------------------------------------------------------------

    def _check_plugin_sections(self) -> None:
        check_config(self.config, self.plugins, with_model=False)

    def _build_mesh(self) -> Mesh:
        """Join the job and build its mesh from the degrees `[parallel]` declares, validated
        (`ParallelDims`) before any plugin runs."""
        cfg = self.config
        return Mesh.from_env(
            dp=cfg.parallel.dp,
            tp=cfg.parallel.tp,
            pp=cfg.parallel.pp,
            cp=cfg.parallel.cp,
            ep=cfg.parallel.ep,
            dp_shard=cfg.parallel.dp_shard,
            device=cfg.train.device,
            timeout_seconds=cfg.train.collective_timeout_seconds,
        )

    def _read_model_inputs(self, model: nn.Module) -> LossCounting:
        """What the model's forward takes (read before the shard transforms: context
        parallelism installs its own attention) and which tokens its own loss is a mean over."""
        answered = self.plugins.model_inputs(model)  # a plugin that knows this kind of model
        self.document_inputs: ModelInputs = answered or DocumentInputs.of(model)
        prepare_for_training(model)
        return self.document_inputs.loss_counting(model)

    def _refuse_an_unused_shard_split(self) -> None:
        """`parallel.dp_shard` declared, but the dp strategy never asked for its groups."""
        dims = self.mesh.dims
        assert dims is not None, "the engine's mesh is built from its declared degrees"
        if dims.dp_shard_requested is not None and not self.mesh.data_parallel_split:
            raise ConfigError(
                f"parallel.dp_shard = {dims.dp_shard_requested!r} splits data parallelism into "
                f"shard and replica groups, but dp strategy {self.config.parallel.dp_strategy!r} "
                "does not shard: it would be ignored. Use zero1, zero2 or zero3, or leave "
                "dp_shard unset"
            )

    def _build_builtin_model(self) -> nn.Module:
        cfg = self.config
        self.model_record = self.plugins.model(cfg.model.name)
        record = self.model_record
        if record.make_config is not None:
            self.model_config = record.make_config(cfg.model.size, cfg.model.overrides)
        else:
            self.model_config = record.config_cls.model_validate(cfg.model.overrides)
        self.flops_per_token = self.model_record.flops_per_token(
            self.model_config, cfg.data.seq_len
        )
        # The formula is 6·N + c·T per token: c, the attention FLOPs of one (query, key) row of
        # the score square's lower half, lets a packed step count each document's own nᵢ².
        self._attention_flops_per_square = self.flops_per_token - self.model_record.flops_per_token(
            self.model_config, cfg.data.seq_len - 1
        )
        with torch.device("meta"):
            return self.model_record.build(self.model_config, self.kernels)

    def _strategy_for(self, axis: str) -> str | None:
        par = self.config.parallel
        if axis in ("pp", "tp", "cp"):
            if self.mesh.size(axis) == 1:
                return None
            return getattr(par, f"{axis}_strategy")
        if axis == "dp":
            return par.dp_strategy
        return par.transform_strategies().get(axis)

    def _shard(self, module: nn.Module) -> nn.Module:
        for axis in SHARD_ORDER:
            if axis != "pp":
                # The pipeline split runs on the meta device (it only drops layers); every other
                # transform sees real tensors, initialised by parameter name like the full model.
                module = self._materialize(module)
            name = self._strategy_for(axis)
            if name is None:
                continue
            sharded = self.plugins.shard(axis=axis, name=name, model=module, context=self.context)
            module = sharded.module
            if sharded.runtime is not None:
                self.runtimes.append(sharded.runtime)
        return self._materialize(module)

    def _materialize(self, module: nn.Module) -> nn.Module:
        if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            return module.to(self.device)
        if not hasattr(module, "init_weights"):
            raise PlaitError(
                f"{type(module).__name__} is on the meta device but has no init_weights(seed=)"
            )
        module.to_empty(device=self.device)
        with torch.no_grad():
            module.init_weights(seed=self.config.train.seed)
        return module

    def _choose_loss_fn(self, loss_fn: LossFn | None) -> LossFn:
        self._loss_replaced = False
        for runtime in self.runtimes:
            replacement = runtime.loss_fn()
            if replacement is not None:
                self._loss_replaced = True  # a token cross-entropy against the targets
                return replacement
        if loss_fn is not None:
            return loss_fn

        def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            ce = self.kernels.get("softmax_cross_entropy", logits.device, logits.dtype)
            return ce(logits.flatten(0, -2), targets.flatten())

        return default_loss(token_cross_entropy)

    def _build_optimizer(self, optimizer: OptimizerArg | None) -> torch.optim.Optimizer:
        factory = optimizer or default_optimizer_factory(self.config.optimizer, self.kernels)
        # Data parallel is applied last, so its runtime (ZeRO shards the optimizer) asks first.
        for runtime in reversed(self.runtimes):
            built = runtime.build_optimizer(self.module, factory)
            if built is not None:
                return built
        return factory(p for p in self.module.parameters() if p.requires_grad)

    def append_runtime(self, runtime: ParallelRuntime) -> None:
        """Run `runtime` around every step, after the runtimes the shard transforms built
        (runtimes are asked in that order: its gradient hooks see what theirs reduced, its
        `skip_step` is asked after theirs). For what a feature adds around the step: fault
        tolerance's commit, the NaN/Inf guard. Call before the first step."""
        self.runtimes.append(runtime)

    def job_info(self) -> JobInfo:
        """Who this rank is in its job (what `plait_job_start` is given): job id, rank, world,
        device, model and its FLOPs per token, tokens per step, and the replica group a plugin
        names (`plait_replica_group`: fault tolerance's)."""
        device = self.device
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
        num_params = sum(p.numel() for p in self.module.parameters())
        cfg = self.config
        return JobInfo(
            # `plait train` sets PLAIT_JOB_ID (rendezvous id, or config name + launch time).
            job_id=cfg.telemetry.job_id
            or os.environ.get("PLAIT_JOB_ID")
            or os.environ.get("TORCHELASTIC_RUN_ID", "local"),
            rank=self.mesh.rank,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=self.mesh.world_size,
            host=host_name(),
            degrees=dict(self.mesh.degrees),
            coordinates=self.mesh.coordinates(),
            device=str(device),
            device_name=device_name,
            compute_dtype=str(self._compute_dtype()).removeprefix("torch."),
            model_name=cfg.model.name if self.model_record else type(self.module).__name__,
            num_params=num_params,
            flops_per_token=self.flops_per_token,
            tokens_per_step=cfg.train.global_batch_size * cfg.data.seq_len,
            replica_group=self.plugins.replica_group(cfg),
            memory_report=self.memory_report,
        )

    def _compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in: the precision policy's (autocast keeps fp32 parameters
        but computes in bf16/fp16), else the parameters'."""
        if self.context.precision is not None:
            return self.context.precision.compute_dtype
        return next(self.module.parameters()).dtype

    # -- one step --------------------------------------------------------------------------------

    def actions(self, num_microbatches: int) -> list[Action]:
        if num_microbatches not in self._actions:
            request = ScheduleRequest(
                name=self.config.schedule.name,
                num_microbatches=num_microbatches,
                stage=self.mesh.coordinate("pp"),
                num_stages=self.mesh.size("pp"),
                virtual_stages=self.config.schedule.virtual_stages,
            )
            try:
                actions = self.plugins.schedule(request)
            except InertSelection as exc:
                fallback = replace(request, name=FALLBACK_SCHEDULE)
                if request.num_stages > 1 or request.name == FALLBACK_SCHEDULE:
                    raise  # no default program for a pipeline: nothing to train on with
                self.selection_check.schedule_answered_nothing(str(exc))  # raises, or warns
                actions = self.plugins.schedule(fallback)
            self._actions[num_microbatches] = actions
        return self._actions[num_microbatches]

    def positions(self, num_microbatches: int) -> dict[Action, MicrobatchPosition]:
        """Where each compute action of the step sits, from the schedule's own action list."""
        if num_microbatches not in self._positions:
            self._positions[num_microbatches] = microbatch_positions(
                self.actions(num_microbatches),
                num_microbatches=num_microbatches,
                gradients_consumed_each_microbatch=any(
                    rt.gradients_consumed_each_microbatch for rt in self.runtimes
                ),
            )
        return self._positions[num_microbatches]

    def _handlers(self, state: StepState) -> dict[type, Callable[[Any], None]]:
        runtimes, runner = self.runtimes, state.runner
        awaiting_backward: dict[int, torch.Tensor] = {}  # micro-batch -> scaled loss

        def forward(action: Forward) -> None:
            runner.before_forward(action)
            output = call_model(self.module, state.inputs[action.microbatch])
            awaiting_backward[action.microbatch] = runner.loss(state, action.microbatch, output)

        def backward(action: Backward) -> None:
            runner.before_backward(action)
            scaled = awaiting_backward.pop(action.microbatch, None)
            assert scaled is not None, f"backward of micro-batch {action.microbatch} before forward"
            scaled.backward()

        def sync(_: SyncGradients) -> None:
            self.sync_gradients()

        def optimizer_step(_: OptimizerStep) -> None:
            self.optimizer_step()

        handlers: dict[type, Callable[[Any], None]] = {
            Forward: forward,
            Backward: backward,
            SyncGradients: sync,
            OptimizerStep: optimizer_step,
        }
        for rt in runtimes:
            handlers.update(rt.action_handlers(state))
        return handlers

    def sync_gradients(self) -> None:
        """Make gradients final on every runtime (wait for or start the reductions)."""
        for rt in self.runtimes:
            rt.sync_gradients()

    def optimizer_step(self) -> None:
        """Clip, step the optimizer and the LR schedule, zero gradients (or skip on overflow)."""
        if any(rt.skip_step() for rt in self.runtimes):
            self._last_grad_norm = torch.tensor(float("nan"))
            self._skipped = True
        else:
            self._last_grad_norm = self._clip_gradients()
            self.optimizer.step()
            for rt in self.runtimes:
                rt.after_optimizer_step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if not any(rt.zero_grad() for rt in self.runtimes):
            self.optimizer.zero_grad(set_to_none=True)

    def _clip_gradients(self) -> torch.Tensor:
        max_norm = self.config.train.max_grad_norm
        for rt in self.runtimes:
            norm = rt.clip_gradients(max_norm)
            if norm is not None:
                return norm
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = global_grad_norm(params, mesh=self.mesh, comm=self.comm)
        clip_grads_(params, norm, max_norm)
        return norm

    def micro_batch_size(self, rows: int) -> int:
        """Rows per micro-batch of a batch of `rows` on this rank: `train.micro_batch_size`, or
        with it unset as many micro-batches as the schedule wants (`plait.core.microbatch_count`:
        one without a pipeline)."""
        size = self.config.train.micro_batch_size
        if size is not None:
            if self.mesh.size("pp") > 1 and rows % size == 0:
                try:
                    self.actions(rows // size)
                except ScheduleError as exc:
                    raise ConfigError(
                        f"train.micro_batch_size = {size} splits this rank's {rows} rows into "
                        f"{rows // size} micro-batches, which the schedule cannot run: {exc}. "
                        "Choose another train.micro_batch_size, or leave it unset and plait "
                        "splits the batch for the schedule"
                    ) from None
            return size
        count = default_microbatch_count(
            rows,
            num_stages=self.mesh.size("pp"),
            schedule=self.config.schedule.name,
            program=self.actions,
        )
        return rows // count

    def train_step(
        self, batch: Any, *, data_start_ns: int | None = None, micro_batch_size: int | None = None
    ) -> float:
        """Forward, backward, gradient sync and optimizer step over `batch`.

        `batch` is this rank's share: `(inputs, targets)`, a dict such as a Hugging Face batch
        (`input_ids`, `labels`, …), or a tensor for a model that computes its own loss (see
        `plait.core.batches`). Every tensor's dim 0 is split into micro-batches of
        `micro_batch_size` rows (default `micro_batch_size(rows)`; a caller handing a batch of
        several ranks' shares passes the size one share would have, to accumulate more
        micro-batches rather than grow them). Returns the mean loss across
        micro-batches and data-parallel ranks, identical on every rank.
        """
        start_ns = time.time_ns()
        self.begin_step()
        # Document structure is read from whole rows, before context parallelism cuts them (and
        # before the move to the device, where the batch was made: no device sync).
        squares: list[tuple[int, bool]] = []

        def prepare(inputs: Any) -> Any:
            inputs = self.document_inputs.prepare(inputs)
            squares.append(attention_square(inputs))
            return inputs

        microbatches = split_batch(
            batch,
            micro_batch_size=micro_batch_size or self.micro_batch_size(batch_rows(batch)),
            device=self.device,
            prepare_inputs=prepare,
        )
        inputs, targets, n = microbatches.inputs, microbatches.targets, len(microbatches)
        tokens = sum(input_tokens(x).numel() for x in inputs)
        # Σ nᵢ² over the step's documents, when any micro-batch holds packed rows.
        packed = any(is_packed for _, is_packed in squares)
        attention_squares = sum(square for square, _ in squares) if packed else None
        for cut in self.context.microbatch_cuts:
            # A transform holding part of every sequence (context parallelism) keeps this rank's
            # positions of inputs and targets alike; `tokens` counted them all.
            pieces = [
                cut(x, y, input_tokens(x).shape[1]) for x, y in zip(inputs, targets, strict=True)
            ]
            inputs, targets = [x for x, _ in pieces], [y for _, y in pieces]
        weights = self._token_weights(inputs, targets)
        runner = MicrobatchRunner(
            runtimes=self.runtimes,
            loss_fn=self.loss_fn,
            positions=self.positions(n),
            num_microbatches=n,
            weights=weights,
        )
        state = StepState(
            inputs=inputs, targets=targets, losses=[None] * n, num_microbatches=n, runner=runner
        )
        lr = self.optimizer.param_groups[0]["lr"]
        with self._flop_counter(tokens):
            # On CUDA every action is also timed with device events, read after the step.
            timer, handlers = PhaseTimer.for_device(self.device), self._handlers(state)
            spans = Executor(timer.wrap(handlers) if timer else handlers).run(self.actions(n))
            spans = timer.attach(spans) if timer else spans
        # Spans a runtime timed inside its actions (a pipeline stage's waits for a peer: "idle").
        spans = sorted([*spans, *state.extra_spans], key=lambda s: s.start_ns)
        return self.end_step(
            losses=state.losses,
            weights=weights,
            tokens=tokens,
            lr=lr,
            spans=spans,
            start_ns=start_ns,
            data_start_ns=data_start_ns,
            attention_squares=attention_squares,
        )

    def scored_tokens(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        """The tokens a micro-batch's loss is the mean over (0-d tensor), or `None` when this
        model's loss is not one plait can weigh (`plait.core.token_loss`)."""
        return scored_tokens(inputs, targets, self._loss_counting)

    def _token_weights(self, inputs: Sequence[Any], targets: Sequence[Any]) -> TokenWeights | None:
        """Each micro-batch's share of the step's token-weighted mean (`plait.core.token_loss`):
        scored tokens counted on this rank's pieces, summed over the ranks averaging gradients."""
        if self._loss_counting is None:
            return None
        group = self.mesh.gradient_group()
        counts = [self.scored_tokens(x, y) for x, y in zip(inputs, targets, strict=True)]

        def all_reduce_sum(totals: torch.Tensor) -> None:
            if group.size > 1:
                self.comm.all_reduce(totals, group=group, op="sum", purpose="metrics")

        return token_weights(
            counts, all_reduce_sum=all_reduce_sum, replicas=group.size, device=self.device
        )

    @contextlib.contextmanager
    def _flop_counter(self, tokens: int) -> Iterator[None]:
        """Count the step's FLOPs once, when the model has no formula: matmul and attention
        FLOPs of forward and backward per token, summed over the pipeline stages and
        tensor-parallel ranks of one replica. Activation recomputation is counted too, so
        `train.flops_per_token` gives the exact figure for a checkpointed model."""
        if self._flops_group is None:
            yield
            return
        register_cpu_attention_flops()
        counter = FlopCounterMode(display=False)
        # NOTE: torch.compile does not trace under a dispatch mode such as the counter, and a
        # compiled block first called under one is never compiled afterwards: the counted step
        # runs compiled code eagerly, and compiles nothing until the next.
        with torch.compiler.set_stance("force_eager"), counter:
            yield
        per_token = torch.tensor(
            [counter.get_total_flops() / max(tokens, 1)], dtype=torch.float64, device=self.device
        )
        if self._flops_group.size > 1:
            self.comm.all_reduce(per_token, group=self._flops_group, op="sum", purpose="metrics")
        self.flops_per_token = float(per_token)
        self._flops_group = None

    def begin_step(self) -> None:
        """Start an optimizer step: tell the plugins (profilers, telemetry)."""
        self._skipped = False
        self.selection_check.step_started()
        self.plugins.step_start(self.global_step)

    def end_step(
        self,
        *,
        losses: Sequence[torch.Tensor | None],
        tokens: int,
        lr: float,
        spans: list[PhaseSpan],
        start_ns: int,
        data_start_ns: int | None = None,
        weights: TokenWeights | None = None,
        attention_squares: int | None = None,
    ) -> float:
        """Reduce the step's loss, report the step to the plugins and advance the step count.

        `attention_squares` is Σ nᵢ² over the documents of this rank's packed rows (`None`: rows
        of one sequence each, whose attention the per-token formula counts)."""
        loss = self._mean_loss(losses, weights)
        end_ns = time.time_ns()
        if data_start_ns is not None:
            spans.insert(0, PhaseSpan(name="data", start_ns=data_start_ns, end_ns=start_ns))
        model_flops = self.flops_per_token * tokens
        if attention_squares is not None and self._attention_flops_per_square:
            # Packed rows: each document attends only to itself, Σ nᵢ² instead of rows · T².
            seq_len = self.config.data.seq_len
            model_flops += self._attention_flops_per_square * (attention_squares - tokens * seq_len)
        dp = self.mesh.size("dp")
        tokens *= dp
        model_flops *= dp  # every data-parallel rank's rows counted like this rank's
        report = StepReport(
            step=self.global_step,
            loss=loss,
            tokens=tokens,
            step_seconds=(end_ns - (data_start_ns or start_ns)) / 1e9,
            data_wait_seconds=(start_ns - data_start_ns) / 1e9 if data_start_ns else 0.0,
            model_flops=model_flops,
            lr=lr,
            grad_norm=float(self._last_grad_norm),
            skipped=self._skipped,
            start_ns=data_start_ns or start_ns,
            end_ns=end_ns,
            spans=tuple(spans),
            phase_seconds=_phase_totals(spans),
        )
        self.last_report = report
        self.plugins.step_end(report)
        self.selection_check.step_ended(self.global_step)
        self.global_step += 1
        return loss

    def _mean_loss(
        self, losses: Sequence[torch.Tensor | None], weights: TokenWeights | None = None
    ) -> float:
        """The step's loss over the ranks that hold losses (the last pipeline stage): the mean
        over every scored token of the global batch when the losses can be `weights`-weighed,
        else the mean of the micro-batch losses."""
        # One tensor on the compute device (NCCL reduces device tensors) and one host sync.
        held = [i for i, loss in enumerate(losses) if loss is not None]
        # float64 on every rank: a stage holding no loss must send what the last stage sends.
        if not held:
            totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        else:
            means = torch.stack([losses[i].detach().double().reshape(()) for i in held])
            if weights is None:
                counts = torch.ones_like(means)
            else:
                counts = weights.scored[held].to(means.device)
                # A micro-batch that scores no token has a NaN mean and weighs nothing.
                means = torch.where(counts > 0, means, torch.zeros_like(means))
            totals = torch.stack([(means * counts).sum(), counts.sum()])
        if self._loss_group.size > 1:
            self.comm.all_reduce(totals, group=self._loss_group, op="sum", purpose="metrics")
        return (totals[0] / totals[1]).item()

    # -- a loop that calls forward, backward and step itself (DeepSpeed's engine API) ----------

    def _manual_loop(self) -> ManualLoop:
        if self._manual is None:
            self._manual = ManualLoop(self)
        return self._manual

    def to_device(self, data: Any) -> Any:
        """`data` with every tensor moved to this rank's device."""
        return to_device(data, self.device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward one micro-batch, for loops that do more than `train_step` allows: returns the
        model's output. Pair with `engine.backward(loss)` and `engine.step()`."""
        return self._manual_loop().forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the micro-batch the last `engine(...)` call computed: the loss is divided
        by `train.gradient_accumulation_steps` and scaled as the runtimes need (fp16)."""
        self._manual_loop().backward(loss)

    def step(self) -> bool:
        """Sync gradients and step the optimizer once every `gradient_accumulation_steps`
        backwards; between boundaries it does nothing. True when the optimizer stepped."""
        return self._manual_loop().step()

    # -- reporting and shutdown ----------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer state."""
        for rt in reversed(self.runtimes):
            report = rt.memory_report()
            if report is not None:
                return report
        return memory_report(self.module, self.optimizer)

    def close(self) -> None:
        self.plugins.job_end()


def _phase_totals(spans: Sequence[PhaseSpan]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for span in spans:
        totals[span.name] = totals.get(span.name, 0.0) + (span.end_ns - span.start_ns) / 1e9
    return totals

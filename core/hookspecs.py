"""The plait hook specifications: the whole surface a plugin can implement.

Hooks are grouped in lifecycle order, the way pytest's `hookspec.py` is:

1. configuration (`plait_configure`, historic),
2. registration: plain records of what a plugin provides,
3. the four decision hooks of the microkernel: shard, communicate, schedule, kernel, and
   what a kind of model is given (`plait_model_inputs`),
4. job and step lifecycle: the rank's replica group (`plait_replica_group`), `plait_job_start`,
   `plait_step_start` / `plait_step_end`, checkpoint state.

Hooks are always *called* with keyword arguments (pluggy enforces it) and implementations take
only the arguments they need, by name. Implementations must not mark them keyword-only with `*`:
pluggy matches arguments to ordinary parameters, and the manager rejects a `*`. Decision hooks
are `firstresult`: the first plugin that returns something other than `None` answers, and
built-in defaults are `trylast`, so a third-party plugin that answers the same request wins
over them. Plugins select themselves by the
*name* the config gives, never by load order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from torch import nn

    from plait.core.comm import Work
    from plait.core.config import PlaitConfig
    from plait.core.document_inputs import ModelInputs
    from plait.core.kernels import KernelChooser
    from plait.core.plugins import Plugins
    from plait.core.records import (
        CommAlgorithmRecord,
        CommRequest,
        ConfigSectionRecord,
        KernelRecord,
        ModelRecord,
        ScheduleRecord,
        StrategyRecord,
    )
    from plait.core.schedule import Action, ScheduleRequest
    from plait.core.sharding import ShardContext, Sharded
    from plait.core.step import JobInfo, StepReport

PROJECT = "plait"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


@hookspec(historic=True)
def plait_configure(config: PlaitConfig) -> None:
    """Called once with the validated config; plugins registered later are called on register.

    Example::

        @hookimpl
        def plait_configure(config):
            if config.telemetry.enabled:
                start_exporter(config.telemetry.daemon)
    """


# --------------------------------------------------------------------------------------------
# registration: what a plugin provides, as frozen records
# --------------------------------------------------------------------------------------------


@hookspec
def plait_register_models() -> Sequence[ModelRecord]:
    """Return the model families this plugin builds.

    Example::

        @hookimpl
        def plait_register_models():
            return [ModelRecord(name="mlp", config_cls=MLPConfig, build=MLP,
                                flops_per_token=lambda cfg, seq_len: 6 * cfg.num_params)]
    """
    raise NotImplementedError


@hookspec
def plait_register_strategies() -> Sequence[StrategyRecord]:
    """Return the strategies (one per shard axis each) this plugin implements in `plait_shard`.

    `plait.core.strategy.Strategies.plait_register_strategies` returns the records of the
    strategies declared with `Strategies.provide`.

    Example::

        @hookimpl
        def plait_register_strategies():
            return [StrategyRecord(name="my_dp", axis="dp", config_cls=MyDPConfig)]
    """
    raise NotImplementedError


@hookspec
def plait_register_schedules() -> Sequence[ScheduleRecord]:
    """Return the step schedules this plugin builds in `plait_schedule`.

    Example::

        @hookimpl
        def plait_register_schedules():
            return [ScheduleRecord(name="gpipe", pipelined=True)]
    """
    raise NotImplementedError


@hookspec
def plait_register_kernels() -> Sequence[KernelRecord]:
    """Return the ops (and device types) this plugin answers in `plait_kernel`.

    Example::

        @hookimpl
        def plait_register_kernels():
            return [KernelRecord(op="rms_norm", provider="mykernels", device_types=("cuda",))]
    """
    raise NotImplementedError


@hookspec
def plait_register_comm_algorithms() -> Sequence[CommAlgorithmRecord]:
    """Return the communication algorithms this plugin implements in `plait_communicate`.

    Example::

        @hookimpl
        def plait_register_comm_algorithms():
            return [CommAlgorithmRecord(name="ring", ops=("all_reduce",))]
    """
    raise NotImplementedError


@hookspec
def plait_register_config_sections() -> Sequence[ConfigSectionRecord]:
    """Return the config tables a feature of this plugin owns (what it reads with
    `config.section(name, config_cls)`), so an unknown field in them is an error naming the
    allowed ones and `plait config show` prints their defaults. A strategy's, schedule's or
    kernel provider's table is declared by its own record instead.

    Example::

        @hookimpl
        def plait_register_config_sections():
            return [ConfigSectionRecord(name="my_guard", config_cls=MyGuardConfig)]
    """
    raise NotImplementedError


# --------------------------------------------------------------------------------------------
# the four decision hooks
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def plait_shard(axis: str, name: str, model: nn.Module, context: ShardContext) -> Sharded | None:
    """Turn `model` into its parallel form for one shard axis, if `name` is yours.

    The core calls this once per configured axis, in the order of `records.SHARD_ORDER`
    (pp, tp, cp, ep, adapter, precision, ac, compile, dp). Return `None` for names you do not own;
    `plait.core.strategy.Strategies` writes that guard (and validates your config section)
    for you. The returned `Sharded.runtime` (a `ParallelRuntime`) receives the step callbacks:

    - `before_forward(position)` / `before_backward(position)` with a `MicrobatchPosition`
      computed from the schedule's action list: `position.last` is the chunk's last backward
      of the step whatever order the schedule runs micro-batches in (reduce gradients then),
      `position.first` its first (start sharded accumulation then), `position.gradients_final`
      whether `.grad` is handed on after this backward. Never infer these from numbering.
    - `sync_gradients()`, `build_optimizer()`, `clip_gradients()`, `skip_step()`,
      `after_optimizer_step()`, `zero_grad()`, `scale_loss()`, `loss_fn()`.
    - `action_handlers(step)` for a runtime that runs the compute itself (a pipeline stage):
      it calls `step.runner.before_forward(action)`, `step.runner.loss(step, mb, output)` and
      `step.runner.before_backward(action)` around its own compute, so every runtime sees the
      same calls as under the engine's handlers, and appends timed spans to `step.extra_spans`.

    What a transform establishes for later ones is a typed field of the context
    (`context.pipeline`, `context.tensor_parallel`, `context.context_parallel`,
    `context.expert_parallel`, `context.precision`, `context.activation_checkpointing`; see
    `plait.core.transforms`): write yours there, read the earlier ones from there.

    Example::

        strategies = Strategies()

        @strategies.provide(name="my_dp", axis="dp", config_cls=MyDPConfig)
        def shard_my_dp(model, *, context, config):
            return Sharded(module=model, runtime=MyDataParallel(model, context, config))

        plait_register_strategies = strategies.plait_register_strategies
        plait_shard = strategies.plait_shard

    or, by hand::

        @hookimpl
        def plait_shard(axis, name, model, context):
            if axis != "dp" or name != "my_dp":
                return None
            return Sharded(module=model, runtime=MyDataParallel(model, context))
    """


@hookspec(firstresult=True)
def plait_communicate(request: CommRequest) -> Work | None:
    """Carry out one collective or point-to-point op and return its `Work` handle.

    `plait.core.comm.Comm` is the only caller. The torch.distributed implementation is `trylast`;
    an algorithm plugin returns a `Work` for the requests it takes over and `None` otherwise.
    Telemetry is a `wrapper=True` implementation that sees every op.

    Being selected: an algorithm registers a `CommAlgorithmRecord` (with its options class as
    `config_cls`) in `plait_register_comm_algorithms`, and learns in `plait_configure` whether
    `config.comm.algorithm` names it; its options are `config.comm.options(name, config_cls)`
    (the `[comm.<name>]` table). An algorithm that is not selected returns `None` for everything.

    What to take over: `request.purpose` says what an op is for; the purposes plait's built-ins
    use are constants in `plait.core.comm_algorithms` (`GRAD_BUCKET` for data-parallel gradient
    buckets, all-reduce under DDP/ZeRO-1 and on Gloo, reduce-scatter under ZeRO-2/3 on GPU;
    `PARAM_GATHER`, `PARAM_SYNC`, `ACTIVATION`, `ACTIVATION_GRAD`, `TP_GRAD`, `METRICS`, …).
    A plugin selected for gradient traffic must handle both the all-reduce and the
    reduce-scatter form, or the engine's config check must refuse the combination.

    Sub-ops: carry the op out through `request.issuer` (the issuing `Comm`; `issuer_of`), with
    `sub_purpose(name, request.purpose)` as purpose, so telemetry sees the real traffic and no
    plugin takes the sub-op over again (`is_sub_op`). `group_of(request)` rebuilds the `Group`.

    Completion rule: when `request.async_op` is true, return at once a `Work` whose `wait()`
    completes the op (the gradient hooks issue buckets during backward and wait at the sync
    boundary: work that is already finished when the hook returns removes that overlap). When
    it is false, the op must be complete when the hook returns. `AlgorithmRunner.run` does both:
    it runs the steps on one worker thread per group, in issue order, over a process group of
    their own that `AlgorithmRunner.dedicate_for(config)` creates in `plait_configure`
    (creating a group is collective: every rank, same order, never lazily in this hook).

    Example::

        @hookimpl
        def plait_configure(config):
            plugin.selected = config.comm.algorithm == "my_ring"
            if plugin.selected:
                plugin.options = config.comm.options("my_ring", MyRingConfig)
                plugin.runner.dedicate_for(config)

        @hookimpl
        def plait_communicate(request):
            if not plugin.selected or request.op != "all_reduce" or is_sub_op(request.purpose):
                return None
            purpose = sub_purpose("my_ring", request.purpose)

            def steps(comm, group):  # sends/recvs via comm.send(..., purpose=purpose)
                my_ring_all_reduce(comm, request.tensors[0], group=group, purpose=purpose)

            return plugin.runner.run(request, steps, issuer_of(request))
    """


@hookspec(firstresult=True)
def plait_schedule(request: ScheduleRequest) -> list[Action] | None:
    """Return the action list one rank runs in one optimizer step, if `request.name` is yours.

    Any order that respects the dependencies is valid (a micro-batch's forward before its
    backward, a receive before the compute that needs it, `SyncGradients` after the last
    backward, `OptimizerStep` last): runtimes learn which backward is a chunk's first and last
    from the list itself (`plait.core.schedule.microbatch_positions`), so running
    micro-batches last-first gives the same gradients as the default order.

    Example::

        @hookimpl
        def plait_schedule(request):
            if request.name != "accumulate":
                return None
            actions = []
            for mb in range(request.num_microbatches):
                actions += [Forward(microbatch=mb), Backward(microbatch=mb)]
            return [*actions, SyncGradients(), OptimizerStep()]
    """


@hookspec(firstresult=True)
def plait_kernel(name: str, device: str, dtype: str, provider: str | None) -> Any | None:
    """Return a callable implementing op `name` on a device type and dtype, or `None`.

    `device` is a device type ("cpu", "cuda"); `dtype` a torch dtype name ("float32").
    `provider`, when not `None`, asks one provider by name (the `KernelRecord.provider` you
    registered): answer only if it is yours. Callers go through `plait.core.kernels.Kernels`,
    which walks `kernels.prefer` and caches the answer.

    Example::

        @hookimpl
        def plait_kernel(name, device, dtype, provider):
            if provider in (None, "mykernels") and name == "rms_norm" and device == "cuda":
                return my_fused_rms_norm
            return None
    """


@hookspec(firstresult=True)
def plait_kernel_chooser(plugins: Plugins) -> KernelChooser | None:
    """Return the `plait.core.kernels.KernelChooser` that picks an op's provider by measurement
    (`kernels.provider = "auto"`, the default on CUDA without `kernels.prefer`), or `None`.

    Asked once per `Kernels` facade, at the first op it measures; `plugins` is the manager to
    ask for each candidate (`plugins.kernel_records()`, `plugins.kernel(..., provider=…)`). The
    built-in `kernels_auto` answers `trylast` with its timer and per-machine cache.

    Example::

        @hookimpl
        def plait_kernel_chooser(plugins):
            return MyChooser(plugins)  # .measured(op, device, dtype, fallback=...) -> callable
    """


# --------------------------------------------------------------------------------------------
# what a kind of model is given
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def plait_model_inputs(model: nn.Module) -> ModelInputs | None:
    """How `model` takes packed rows and which tokens its own loss is a mean over, for a kind
    of model this plugin knows (the huggingface plugin answers for `transformers` models);
    None: not this plugin's kind. Asked once, before the model is sharded. No answer: a model
    whose forward takes `documents=` gets them, any other is refused packed rows by name
    (`plait.core.document_inputs`).

    Example::

        @hookimpl
        def plait_model_inputs(model):
            if isinstance(model, MyModel):
                return MyModelInputs()  # .prepare(inputs), .loss_counting(model)
            return None
    """


# --------------------------------------------------------------------------------------------
# step lifecycle
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def plait_replica_group(config: PlaitConfig) -> int | None:
    """The replica group this rank's job is when it is one of several groups kept as one job
    (`JobInfo.replica_group`, which telemetry and the daemon key the rank by from its start);
    None: not this plugin's to say. Asked by the engine when it builds its `JobInfo`; no answer
    means -1, a job of its own.

    Example::

        @hookimpl
        def plait_replica_group(config):
            section = config.section("my_groups", MyGroupsConfig)
            return section.group if section.enabled else None
    """


@hookspec
def plait_job_start(info: JobInfo) -> None:
    """Called on every rank once the mesh, model and optimizer are built, before the first step.

    Example::

        @hookimpl
        def plait_job_start(info):
            tracer.set_resource(rank=info.rank, host=info.host)
    """


@hookspec
def plait_job_end() -> None:
    """Called on every rank when the engine is closed (flush exporters, stop threads).

    Example::

        @hookimpl
        def plait_job_end():
            exporter.shutdown()
    """


@hookspec
def plait_step_start(step: int) -> None:
    """Called on every rank before an optimizer step's action list runs.

    Example::

        @hookimpl
        def plait_step_start(step):
            profiler.step()
    """


@hookspec
def plait_step_end(report: StepReport) -> None:
    """Called on every rank after an optimizer step, with its loss, timings and token count.

    Example::

        @hookimpl
        def plait_step_end(report):
            print(report.step, report.loss)
    """


@hookspec
def plait_checkpoint_state(rank: int) -> dict[str, Any] | None:
    """Return extra plugin state to save in a checkpoint (keyed by plugin), or `None`.

    Example::

        @hookimpl
        def plait_checkpoint_state(rank):
            return {"loss_scale": scaler.scale}
    """


@hookspec
def plait_load_checkpoint_state(state: dict[str, Any]) -> None:
    """Receive the state saved by `plait_checkpoint_state` when a checkpoint is loaded.

    Example::

        @hookimpl
        def plait_load_checkpoint_state(state):
            scaler.scale = state.get("loss_scale", scaler.scale)
    """

"""Communication of a job that does not use plait's comm facade: DDP's gradient buckets and
FSDP2's all-gathers and reduce-scatters, timed into the same `CommRecord`s as plait's own ops.

Where each op is caught, and why there:

* **DDP**: DDP takes one communication hook (`DistributedDataParallel.register_comm_hook`).
  `install_ddp_hook` registers `TimedBucketHook`, which times each bucket and runs either the
  user's hook (registered through DDP's own method afterwards: the instance's method is
  redirected to the timed hook) or DDP's default (average over the group, one all-reduce —
  what `ddp_comm_hooks.default_hooks.allreduce_hook` does). The bucket's record ends in the
  callback that turns the collective's future into the bucket tensor; DDP's default hook has
  that callback already, so timing it adds no callback of its own. A hook registered *before*
  `plait.observe` cannot be wrapped (DDP refuses a second hook): that is an error that says so.
* **FSDP2**: `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` (torch >= 2.7)
  are the public seam for a module's collectives. `install_fsdp_comms` wraps whatever each
  module's parameter group runs (torch's defaults unless the user set their own) in
  `TimedAllGather` / `TimedReduceScatter`. Chosen over the alternatives torch 2.13 offers:
  c10d's completion hook (`ProcessGroup._register_on_completion_hook`) exists only for NCCL
  (Gloo raises "Only ProcessGroupNCCL supports onCompletion hook"), runs a Python callback on
  the watchdog thread for *every* collective of the group (the GIL once per op, the cost
  plait's own telemetry avoids) and does not say which were parameter gathers; wrapping
  `torch.distributed.all_gather_single` would change the function for every library in the
  process. FSDP2 waits on an async all-gather only when the handle it gets back *is* a c10d
  `Work`, so the handle is returned untouched and an async op ends when a later op, or the
  step's end, finds it completed (as for plait's own async ops). HSDP's replica all-reduce is
  issued by FSDP2 directly and is not seen.
* **GPU**: each op gets CUDA events on the stream it is issued on (`CommRecord.start_cuda`):
  the end event is recorded after a synchronous op returns, or in the future's callback, whose
  current stream waits for the collective — so no synchronisation is added, and the times are
  read after the step, as for plait's ops.

Sequence numbers count the ops this module sees per group, identically on every rank, which
is what the daemon's hang detector matches.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.core.comm_algorithms import GRAD_BUCKET, PARAM_GATHER
from plait.core.errors import PlaitError
from plait.daemon.telemetry_schema import COMM_ALGORITHM_BACKEND
from plait.plugins.telemetry.comm_links import CommLinks
from plait.plugins.telemetry.comm_records import CommRecord, CudaAnchor

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # torch < 2.7: FSDP2 has no custom-collective seam
    AllGather = ReduceScatter = object

GroupKey = tuple[str, tuple[int, ...]]


class CommLedger:
    """The comm records of an observed rank: in flight, finished, and the last seq per group.

    Written by the autograd thread (DDP's hook, FSDP2's collectives) and a backend's callback
    thread (a bucket's end); read by the training thread at each step's end and by the
    heartbeat thread. Every access is a single list or dict operation (atomic under the GIL).
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self.entered: dict[GroupKey, int] = {}
        self.step: int | None = None
        self.active = False  # off until the rank's telemetry is up (and when no daemon is)
        self.cuda_anchor: CudaAnchor | None = None  # set per step on CUDA
        self._seq: dict[GroupKey, int] = {}
        self._groups: dict[Any, GroupKey] = {}
        self._unwaited: list[CommRecord] = []
        # Bytes per link class of each op, under the backend's model (None: not counted).
        self.links: CommLinks | None = None

    def group_key(self, group: Any) -> GroupKey:
        key = self._groups.get(group)
        if key is None:
            key = (group_label(group), tuple(dist.get_process_group_ranks(group)))
            self._groups[group] = key
        return key

    def begin(
        self,
        op: str,
        tensor: torch.Tensor,
        group: Any,
        *,
        purpose: str,
        overlappable: bool,
        whole: torch.Tensor | None = None,
    ) -> CommRecord:
        """A record for an op about to be issued (its start: now, and a CUDA event on GPU).
        `overlappable`: the op does not hold up the compute stream (sent as `plait.comm.async`,
        which tells the bottleneck analysis not to cut it out of compute). `whole`: the tensor
        the link-byte formulas take when it is not `tensor` (an all-gather's output)."""
        if self._unwaited:
            self._stamp_completed()
        key = self.group_key(group)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        self.entered[key] = seq
        record = CommRecord(op, tensor.nbytes, tensor.dtype, key[0], key[1], seq, purpose,
                            None, overlappable, self.step, time.time_ns())  # fmt: skip
        # The user's collectives reach the process group's backend directly.
        record.algorithm = COMM_ALGORITHM_BACKEND
        if self.links is not None:
            counted = tensor if whole is None else whole
            record.links = self.links.bytes_for(
                op, key[1], numel=counted.numel(), itemsize=counted.element_size(),
                algorithm=COMM_ALGORITHM_BACKEND,
            )  # fmt: skip
        if tensor.is_cuda:
            if self.cuda_anchor is None:
                self.cuda_anchor = CudaAnchor.now()
            record.start_cuda(self.cuda_anchor)
        self.records.append(record)
        return record

    def issued(self, record: CommRecord, work: Any, *, async_op: bool) -> None:
        """The op returned `work`: a synchronous op is done, an async one ends when found done
        (on CPU) or in its future's callback (on GPU)."""
        if work is None or not async_op:
            record.finish()
            return
        record.work = work
        if record.cuda_start is None:
            self._unwaited.append(record)
        else:
            # The future's callback runs with a current stream that waits for the op, so the
            # end event recorded there completes with it. (Only async ops the user opted into:
            # FSDP2 issues its collectives synchronously on streams of their own.)
            work.get_future().then(lambda _: record.finish())

    def _stamp_completed(self) -> None:
        """End the unwaited async ops whose work reports completion, at this op's issue (the
        rule of plait's own telemetry: no callback on the backend's thread)."""
        still = []
        for record in self._unwaited:
            work = record.work
            if work is None:
                continue
            if work.is_completed():
                record.finish()
            else:
                still.append(record)
        self._unwaited = still

    def in_flight(self) -> tuple[list[CommRecord], dict[GroupKey, int]]:
        """Collectives issued and not finished, and the last seq per group (heartbeat thread)."""
        records = list(self.records)
        return [r for r in records if r.end_ns == 0], dict(self.entered)

    def take_finished(self, *, final: bool) -> list[CommRecord]:
        """The records that are done (device times read on GPU); the rest wait for a later
        step. With `final`, everything, unfinished ops marked as errors."""
        records, self.records = self.records, []
        finished: list[CommRecord] = []
        keep: list[CommRecord] = []
        for record in records:
            if not (record.resolve_cuda() and record.done):
                if not final:
                    keep.append(record)
                    continue
                record.finish()
                record.error = record.error or "not completed when the job ended"
            finished.append(record)
        if keep:
            self.records[:0] = keep
        return finished


def group_label(group: Any) -> str:
    """The group's name in spans: "world" for the default group, else its description (a
    DeviceMesh names its groups "mesh_<axis>"), else c10d's group name."""
    if group is None or group is dist.group.WORLD:
        return "world"
    description = getattr(group, "group_desc", "")
    if description and description not in ("undefined", "default_pg"):
        return description
    return getattr(group, "group_name", "") or "group"


# --------------------------------------------------------------------------------------------
# DDP
# --------------------------------------------------------------------------------------------


class TimedBucketHook:
    """DDP's comm hook state: times each bucket and runs the user's hook or DDP's default."""

    def __init__(self, ledger: CommLedger, process_group: Any) -> None:
        self.ledger = ledger
        self.process_group = process_group
        self.inner_hook: Any = None  # the user's hook, once registered through DDP's method
        self.inner_state: Any = None
        # DDP's default is issued on the group itself: `dist.all_reduce`'s argument checks and
        # logging wrapper cost more than the rest of the hook, once per bucket.
        self._size = process_group.size()
        self._options = dist.AllreduceOptions()
        self._options.asyncOp = True

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        ledger = self.ledger
        if not ledger.active:
            return self._untimed(bucket)
        buffer = bucket.buffer()
        record = ledger.begin(
            "all_reduce", buffer, self.process_group, purpose=GRAD_BUCKET, overlappable=True
        )
        if self.inner_hook is None:
            return self._average(buffer).then(lambda future: _finish(record, future.value()[0]))
        future = self.inner_hook(self.inner_state, bucket)
        return future.then(lambda done: _finish(record, done.value()))

    def _untimed(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.inner_hook is not None:
            return self.inner_hook(self.inner_state, bucket)
        return self._average(bucket.buffer()).then(lambda future: future.value()[0])

    def _average(self, buffer: torch.Tensor) -> torch.futures.Future[list[torch.Tensor]]:
        """DDP's default: divide by the group's size, then one all-reduce (a sum)."""
        buffer.div_(self._size)
        return self.process_group.allreduce([buffer], self._options).get_future()


def _finish(record: CommRecord, value: Any) -> Any:
    # Runs when the collective completes (on GPU, with a current stream that waits for it, so
    # the end event recorded here completes with the op).
    record.finish()
    return value


# NOTE: DDP checks a hook's annotations by identity (`bucket: dist.GradBucket`), which postponed
# annotations (strings) fail, so this function carries none.
def _timed_bucket_hook(state, bucket):  # type: ignore[no-untyped-def]
    return state.run(bucket)


def install_ddp_hook(model: nn.parallel.DistributedDataParallel, ledger: CommLedger) -> None:
    """Register the timing hook on `model`; a later `model.register_comm_hook(state, hook)` by
    the user is run inside it."""
    if getattr(model, "_comm_hooks", None):
        raise PlaitError(
            "plait.observe(model): this DistributedDataParallel model already has a comm hook, "
            "and DDP takes only one; call plait.observe(...) before model.register_comm_hook"
            "(...) so that plait's timing hook runs yours"
        )
    group = model.process_group
    timed = TimedBucketHook(ledger, group)
    model.register_comm_hook(timed, _timed_bucket_hook)

    def register_comm_hook(state: object, hook: Any) -> None:
        model._check_comm_hook(hook)
        if timed.inner_hook is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        timed.inner_state, timed.inner_hook = state, hook

    # The instance's method, so DDP's class and other DDP models are untouched.
    model.register_comm_hook = register_comm_hook  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------


def install_fsdp_comms(model: nn.Module, ledger: CommLedger) -> int:
    """Wrap the collectives of every FSDP2 module under `model`; the number of modules.

    Call it after any `set_custom_all_gather` of the user's own (it is wrapped, not replaced);
    FSDP2's symmetric-memory and process-group allocation switches refuse a custom collective,
    so they too must be set before."""
    if AllGather is object:
        return 0
    from torch.distributed.fsdp import FSDPModule

    wrapped = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) != 1:  # no parameters of its own (a root over wrapped blocks)
            continue
        (group,) = groups
        module.set_custom_all_gather(TimedAllGather(group._all_gather_comm, ledger))
        module.set_custom_reduce_scatter(TimedReduceScatter(group._reduce_scatter_comm, ledger))
        wrapped += 1
    return wrapped


class TimedAllGather(AllGather):  # type: ignore[misc,valid-type]
    """FSDP2's all-gather of a module's parameters, timed; `inner` does the work."""

    def __init__(self, inner: Any, ledger: CommLedger) -> None:
        self.inner, self.ledger = inner, ledger

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        async_op: bool = False,
    ) -> Any:
        call = {"output_tensor": output_tensor, "input_tensor": input_tensor, "group": group}
        if not self.ledger.active:
            return self.inner(**call, async_op=async_op)
        # On GPU FSDP2 issues it on a stream of its own: it overlaps compute even when
        # synchronous there. On CPU a synchronous op holds the training thread.
        record = self.ledger.begin(
            "all_gather", input_tensor, group, purpose=PARAM_GATHER,
            overlappable=async_op or input_tensor.is_cuda, whole=output_tensor,
        )  # fmt: skip
        work = self.inner(**call, async_op=async_op)
        self.ledger.issued(record, work, async_op=async_op)
        return work


class TimedReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP2's reduce-scatter of a module's gradients, timed; `inner` does the work."""

    def __init__(self, inner: Any, ledger: CommLedger) -> None:
        self.inner, self.ledger = inner, ledger

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        call = {"output_tensor": output_tensor, "input_tensor": input_tensor, "group": group}
        if not self.ledger.active:
            return self.inner(**call, op=op, async_op=async_op)
        # On GPU FSDP2 issues it on a stream of its own: it overlaps compute even when
        # synchronous there. On CPU a synchronous op holds the training thread.
        record = self.ledger.begin(
            "reduce_scatter", input_tensor, group, purpose=GRAD_BUCKET,
            overlappable=async_op or input_tensor.is_cuda,
        )  # fmt: skip
        work = self.inner(**call, op=op, async_op=async_op)
        self.ledger.issued(record, work, async_op=async_op)
        return work

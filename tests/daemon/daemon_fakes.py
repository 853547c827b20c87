"""Test doubles for daemon tests: rank identities and a communicate backend with fake works."""

from __future__ import annotations

import time
from typing import Any

import torch

from plait.core.comm import Comm, CompletedWork, Group
from plait.core.config import load_config
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from plait.core.step import JobInfo, PhaseSpan, StepReport
from plait.plugins.telemetry import make_plugin


def job_info(
    rank: int = 0, world_size: int = 2, job_id: str = "job-a", **overrides: Any
) -> JobInfo:
    fields: dict[str, Any] = dict(
        job_id=job_id,
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        host="testhost",
        degrees={"pp": 1, "dp": world_size, "cp": 1, "tp": 1},
        coordinates={"pp": 0, "dp": rank, "cp": 0, "tp": 0},
        device="cpu",
        device_name="Test CPU",
        compute_dtype="float32",
        model_name="tiny",
        num_params=1000,
        flops_per_token=6000.0,
        tokens_per_step=512,
    )
    fields.update(overrides)
    return JobInfo(**fields)


class FakeFuture:
    """A torch.futures.Future stand-in whose completion the test controls."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def then(self, callback: Any) -> FakeFuture:
        self.callbacks.append(callback)
        return self

    def complete(self) -> None:
        for callback in self.callbacks:
            callback(self)


class FutureWork:
    def __init__(self) -> None:
        self.future = FakeFuture()

    def get_future(self) -> FakeFuture:
        return self.future

    def wait(self) -> bool:
        return True


class FuturelessWork:
    """Like Gloo's send/recv work: no future, completion is only known at `wait()`."""

    def get_future(self) -> Any:
        raise RuntimeError("this work does not support futures")

    def wait(self) -> bool:
        time.sleep(0.02)
        return True


class FakeBackend:
    """A communicate implementation that returns controllable works instead of running ops."""

    def __init__(self) -> None:
        self.requests: list[CommRequest] = []
        self.works: list[Any] = []

    @hookimpl(trylast=True)
    def plait_communicate(self, request: CommRequest) -> Any:
        self.requests.append(request)
        if not request.async_op:
            work: Any = CompletedWork()
        elif request.op in ("send", "recv"):
            work = FuturelessWork()
        else:
            work = FutureWork()
        self.works.append(work)
        return work


STEP_NS = 500_000_000
TOKENS = 512
MODEL_FLOPS = 3.0e9  # below any CPU's calibrated peak, so MFU is a figure
PHASES = ("data", "forward", "backward", "sync_gradients", "optimizer")


def synthetic_report(step: int, base_ns: int) -> StepReport:
    start = base_ns + step * STEP_NS
    bounds = [start + i * STEP_NS // len(PHASES) for i in range(len(PHASES) + 1)]
    spans = tuple(
        PhaseSpan(name=name, start_ns=bounds[i], end_ns=bounds[i + 1], microbatch=0)
        for i, name in enumerate(PHASES)
    )
    return StepReport(
        step=step,
        loss=2.0 - 0.1 * step,
        tokens=TOKENS,
        step_seconds=STEP_NS / 1e9,
        data_wait_seconds=(bounds[1] - bounds[0]) / 1e9,
        model_flops=MODEL_FLOPS,
        lr=1e-3,
        start_ns=start,
        end_ns=start + STEP_NS,
        spans=spans,
    )


def run_fake_rank(
    address: str, rank: int, steps: int, backend: FakeBackend, *, finish: bool = True
) -> None:
    """One rank's job through the real plugin manager, comm facade and telemetry plugin.

    `finish=False` flushes everything but leaves out the end-of-run span, as a rank that is
    still running (or was killed) would: the daemon keeps showing the job.
    """
    plugins = Plugins.create(autoload=False, builtins=(), extra=[("fake_backend", backend)])
    telemetry = make_plugin()
    plugins.register(telemetry, "telemetry")
    plugins.configure(load_config({"telemetry": {"daemon": address}}))
    plugins.job_start(job_info(rank=rank))
    comm = Comm(plugins)
    group = Group(name="dp", ranks=(0, 1))
    base = time.time_ns()
    for step in range(steps):
        plugins.step_start(step)
        comm.all_reduce(torch.zeros(4), group=group, purpose="metrics")
        work = comm.all_reduce(torch.zeros(8), group=group, async_op=True, purpose="grad_bucket")
        comm.send(torch.zeros(2, dtype=torch.bfloat16), dst=1 - rank, group=group).wait()
        work.wait()
        assert isinstance(backend.works[-2], FutureWork)
        backend.works[-2].future.complete()  # the async all-reduce finishes now
        plugins.step_end(synthetic_report(step, base))
    if not finish and telemetry.telemetry is not None:
        telemetry.telemetry.end_job = lambda **_: None  # type: ignore[method-assign]
    plugins.job_end()

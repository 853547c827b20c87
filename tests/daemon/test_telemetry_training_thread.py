"""What telemetry costs the training thread, counted rather than timed.

With the telemetry plugin exporting to a daemon, the training thread issues async and sync
collectives and ends steps; every Python call it makes is recorded with `sys.setprofile`
(which follows the calling thread only). It must never register a completion callback on a
backend's work (the backend would run it on its own thread, taking the GIL once per op), never
touch the OpenTelemetry SDK or protobuf, never encode a span, and make a handful of calls per op.
A MoE model's expert load and the end-of-run record go through the same queue: no SDK span is
ever built, on any thread.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from plait.core.comm import Comm, Group
from plait.core.config import load_config
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from plait.core.step import JobInfo, PhaseSpan, StepReport
from plait.daemon.server import DaemonServer
from plait.plugins.expert_parallel.expert_load import publish_expert_load
from plait.plugins.telemetry import TelemetryPlugin, make_plugin

JOB = JobInfo(
    job_id="thread", rank=0, local_rank=0, world_size=2, host="h", degrees={"dp": 2},
    coordinates={"dp": 0}, device="cpu", device_name="cpu", compute_dtype="float32",
    model_name="m", num_params=1, flops_per_token=1.0, tokens_per_step=1,
)  # fmt: skip
OPS_PER_STEP = 12
# Calls the training thread may make per comm op inside telemetry's own files (the wrapper
# generator's two resumptions, the record, the wait wrapper, finishing, and the link-bytes note,
# a cache hit after an op's first call); measured 131 over 12 ops = 10.9.
MAX_TELEMETRY_CALLS_PER_OP = 11


class CountingFuture:
    def __init__(self, work: FakeWork) -> None:
        self.work = work

    def then(self, callback: Any) -> CountingFuture:
        self.work.callbacks += 1
        return self

    def wait(self) -> None:
        self.work.completed = True


class FakeWork:
    """An async op's handle, like Gloo's: a future, `wait()` and `is_completed()`."""

    def __init__(self) -> None:
        self.completed = False
        self.callbacks = 0
        self.futures = 0

    def get_future(self) -> CountingFuture:
        self.futures += 1
        return CountingFuture(self)

    def wait(self) -> bool:
        self.completed = True
        return True

    def is_completed(self) -> bool:
        return self.completed


class AsyncBackend:
    """Answers every op with a `FakeWork` that completes when waited on (or when told)."""

    def __init__(self) -> None:
        self.works: list[FakeWork] = []

    @hookimpl(trylast=True)
    def plait_communicate(self, request: CommRequest) -> FakeWork:
        work = FakeWork()
        self.works.append(work)
        return work


def report(step: int) -> StepReport:
    end = time.time_ns()
    phases = tuple(
        PhaseSpan(name=name, start_ns=end - 5_000_000 + i, end_ns=end - 1_000_000)
        for i, name in enumerate(("forward", "backward", "optimizer"))
    )
    return StepReport(
        step=step, loss=1.0, tokens=1, step_seconds=0.005, data_wait_seconds=0.0,
        model_flops=1.0, lr=1e-3, start_ns=end - 5_000_000, end_ns=end, spans=phases,
    )  # fmt: skip


@pytest.fixture(scope="module")
def rank() -> Iterator[tuple[Plugins, TelemetryPlugin, AsyncBackend]]:
    backend = AsyncBackend()
    with DaemonServer("127.0.0.1:0", host_interval=60.0) as server:
        plugins = Plugins.create(autoload=False, builtins=(), extra=[("backend", backend)])
        plugin = make_plugin()
        plugins.register(plugin, "telemetry")
        plugins.configure(load_config({"telemetry": {"daemon": server.address}}))
        plugins.job_start(JOB)
        assert plugin.exporter is not None, "the daemon was not reached"
        yield plugins, plugin, backend
        plugins.job_end()


class CallRecorder:
    """Every Python function the calling thread enters, by file and name."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls[(frame.f_code.co_filename, frame.f_code.co_name)] += 1

    def __enter__(self) -> CallRecorder:
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def in_files(self, *fragments: str) -> int:
        return sum(n for (path, _), n in self.calls.items() if any(f in path for f in fragments))


def one_step(plugins: Plugins, step: int) -> list[Any]:
    """A step of async ops (waited, like the DDP buckets) and sync ops; returns the handles."""
    comm = Comm(plugins)
    group = Group(name="dp", ranks=(0, 1))
    tensor = torch.zeros(8)
    plugins.step_start(step)
    handles = [
        comm.all_reduce(tensor, group=group, purpose="grad_bucket", async_op=True)
        for _ in range(OPS_PER_STEP // 2)
    ]
    for _ in range(OPS_PER_STEP // 2):
        comm.all_reduce(tensor, group=group, purpose="metrics")
    for handle in handles:
        handle.wait()
    plugins.step_end(report(step))
    return handles


def test_the_training_thread_registers_no_callbacks_and_builds_no_spans(
    rank: tuple[Plugins, TelemetryPlugin, AsyncBackend],
) -> None:
    plugins, _, backend = rank
    one_step(plugins, 0)  # warm caches (first-call imports) outside the count
    backend.works.clear()
    with CallRecorder() as recorder:
        one_step(plugins, 1)
    assert backend.works, "the backend saw no ops"
    assert sum(w.callbacks for w in backend.works) == 0, "a completion callback per collective"
    assert sum(w.futures for w in backend.works) == 0
    touched = {path for path, _ in recorder.calls}
    for forbidden in ("opentelemetry", "google/protobuf", "otlp_wire", "otlp_spans", "grpc"):
        assert not [p for p in touched if forbidden in p], f"training thread ran {forbidden}"
    assert ("exporter.py", "_drain") not in {(p.rsplit("/", 1)[-1], n) for p, n in recorder.calls}
    per_op = recorder.in_files("plugins/telemetry/") / OPS_PER_STEP
    assert per_op <= MAX_TELEMETRY_CALLS_PER_OP, recorder.calls


def async_bucket(comm: Comm) -> Any:
    """One gradient bucket's async all-reduce on the dp group, as DDP issues it."""
    group = Group(name="dp", ranks=(0, 1))
    return comm.all_reduce(torch.zeros(8), group=group, purpose="grad_bucket", async_op=True)


def test_async_ops_end_when_waited_or_when_found_complete_at_step_end(
    rank: tuple[Plugins, TelemetryPlugin, AsyncBackend],
) -> None:
    plugins, plugin, backend = rank
    comm = Comm(plugins)
    plugins.step_start(5)
    waited = async_bucket(comm)
    # The second op finishes without a wait; the third is still running at step end.
    async_bucket(comm)
    never = async_bucket(comm)
    records = list(plugin.records[-3:])
    assert all(r.end_ns == 0 for r in records), "an op ended before anyone waited"
    time.sleep(0.002)
    waited.wait()
    assert records[0].end_ns > records[0].start_ns and records[1].end_ns == 0
    backend.works[-2].completed = True  # completes without a wait
    plugins.step_end(report(5))
    assert records[1].end_ns > 0, "a completed op nobody waited on stays open"
    assert records[2].end_ns == 0 and plugin.records == [records[2]], "an op still running"
    never.wait()
    assert records[2].end_ns > 0
    plugins.step_start(6)
    plugins.step_end(report(6))
    assert plugin.records == []


def test_an_async_op_that_finished_under_compute_ends_by_the_next_issue_not_its_wait(
    rank: tuple[Plugins, TelemetryPlugin, AsyncBackend],
) -> None:
    # DDP's pattern: a bucket's all-reduce finishes while backward computes, the next bucket
    # is issued, and both are waited on after backward.
    plugins, plugin, backend = rank
    comm = Comm(plugins)
    plugins.step_start(7)
    first = async_bucket(comm)
    record = plugin.records[-1]
    backend.works[-1].completed = True  # done under the compute that follows
    time.sleep(0.02)
    second = async_bucket(comm)
    issued = plugin.records[-1].start_ns
    time.sleep(0.02)  # the rest of backward
    first.wait()
    second.wait()
    assert 0 < record.end_ns <= issued, "the finished op was stretched to its wait"
    assert plugin.records[-1].end_ns > issued
    plugins.step_end(report(7))


def test_expert_load_and_the_end_of_run_are_queued_never_built_as_sdk_spans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry.sdk.trace import Tracer

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an OpenTelemetry SDK span was built")

    monkeypatch.setattr(Tracer, "start_span", refuse)
    job = dataclasses.replace(JOB, job_id="thread-end")
    with DaemonServer("127.0.0.1:0", host_interval=60.0) as server:
        plugins = Plugins.create(autoload=False, builtins=(), extra=[("backend", AsyncBackend())])
        plugins.register(make_plugin(), "telemetry")
        plugins.configure(load_config({"telemetry": {"daemon": server.address}}))
        plugins.job_start(job)
        one_step(plugins, 0)
        publish_expert_load(["moe.0", "moe.1"], torch.tensor([[3.0, 1.0], [0.0, 4.0]]),
                            torch.tensor([2.0, 0.0]))  # fmt: skip
        with CallRecorder() as recorder:
            one_step(plugins, 1)
        touched = {path for path, _ in recorder.calls}
        for forbidden in ("opentelemetry", "google/protobuf", "otlp_wire", "otlp_spans"):
            assert not [p for p in touched if forbidden in p], f"training thread ran {forbidden}"
        called = {(path.rsplit("/", 1)[-1], name) for path, name in recorder.calls}
        assert ("expert_load.py", "resolve") not in called, "counts read on the training thread"
        plugins.job_end()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            windows = server.store.windows("thread-end")
            if windows and windows[0].outcome and 1 in windows[0].expert_loads:
                break
            time.sleep(0.05)
        (window,) = server.store.windows("thread-end")
    assert window.outcome == "finished"
    loads = window.expert_loads[1]
    assert {name: (f.tokens_per_expert, f.dropped) for name, f in loads.items()} == {
        "moe.0": ((3, 1), 2),
        "moe.1": ((0, 4), 0),
    }


def test_the_control_channel_polls_from_the_exporter_thread_and_costs_a_step_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PLAIT_CONTROL_POLL_MS", "20")
    job = dataclasses.replace(JOB, job_id="thread-control")
    with DaemonServer("127.0.0.1:0", host_interval=60.0) as server:
        plugins = Plugins.create(autoload=False, builtins=(), extra=[("backend", AsyncBackend())])
        plugin = make_plugin()
        plugins.register(plugin, "telemetry")
        plugins.configure(load_config({"telemetry": {"daemon": server.address}}))
        plugins.job_start(job)
        assert plugin.telemetry is not None
        control = plugin.telemetry.control
        one_step(plugins, 0)
        deadline = time.monotonic() + 30
        while control.polls < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        with CallRecorder() as recorder:
            for step in range(1, 6):
                one_step(plugins, step)
        polls = control.polls
        deadline = time.monotonic() + 30
        while control.polls < polls + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        (view,) = server.control.endpoints("thread-control", time.time_ns())
        assert view.polling and view.hello.step == 5  # the step the exporter thread reported
        called = {(path.rsplit("/", 1)[-1], name) for path, name in recorder.calls}
        capture_files = (
            "control_client.py",
            "profile_capture.py",
            "memory_capture.py",
            "stacks.py",
        )
        # Nothing asked: a step boundary writes the step and reads one flag, no call at all.
        assert not [(f, n) for f, n in called if f in capture_files]
        for forbidden in ("grpc", "google/protobuf", "torch/profiler", "torch/autograd/profiler"):
            assert not [p for p, _ in recorder.calls if forbidden in p], forbidden
        plugins.job_end()
    (left,) = server.control.endpoints("thread-control", time.time_ns())
    assert left.left  # the rank said goodbye when its telemetry shut down

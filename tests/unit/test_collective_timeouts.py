"""The collective-timeout reporter on one process: a fake backend that times out, a store
holding the peers' published progress."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from plait.core.comm import Comm, CompletedWork, Group, Work
from plait.core.errors import PluginError
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from plait.plugins.resilience import timeouts
from plait.plugins.resilience.timeouts import (
    STORE_PREFIX,
    CollectiveTimeoutError,
    CollectiveTimeoutReporter,
    is_timeout,
)

GROUP = Group(name="dp", ranks=(0, 1, 2))
GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv"


class FailingWork:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self) -> bool:
        raise self.error

    def is_completed(self) -> bool:
        return False


class FakeBackend:
    """Completes the first `ok` ops; then raises `error` (synchronous) or returns a handle whose
    `wait()` raises it (asynchronous)."""

    def __init__(self, ok: int, error: Exception) -> None:
        self.ok, self.error = ok, error

    @hookimpl
    def plait_communicate(self, request: CommRequest) -> Work:
        if self.ok > 0:
            self.ok -= 1
            return CompletedWork()
        if request.async_op:
            return FailingWork(self.error)
        raise self.error


@pytest.fixture
def store() -> Iterator[dist.Store]:
    store = dist.HashStore()
    # Rank 1 entered the first collective on the group; rank 2 the first two.
    store.set(f"{STORE_PREFIX}/rank1", json.dumps({"dp[0,1,2]": [1, 0, "all_reduce", "loss"]}))
    store.set(f"{STORE_PREFIX}/rank2", json.dumps({"dp[0,1,2]": [2, 1, "all_reduce", "loss"]}))
    yield store


def make_comm(store: dist.Store, ok: int, error: Exception) -> tuple[Comm, Plugins]:
    reporter = CollectiveTimeoutReporter(store=store, rank=0, publish_interval=0.05)
    plugins = Plugins.create(
        autoload=False,
        builtins=(),
        extra=[("backend", FakeBackend(ok, error)), ("collective_timeouts", reporter)],
    )
    return Comm(plugins), plugins


def test_synchronous_timeout_names_op_and_late_rank(store: dist.Store) -> None:
    comm, _ = make_comm(store, 1, RuntimeError(GLOO_TIMEOUT))
    comm.all_reduce(torch.ones(2), group=GROUP, purpose="loss")
    with pytest.raises(CollectiveTimeoutError) as caught:
        comm.all_reduce(torch.ones(2), group=GROUP, purpose="grad_norm")
    error = caught.value
    assert (error.op, error.group, error.seq, error.missing_ranks) == ("all_reduce", "dp", 1, (1,))
    assert "rank(s) 1 did not arrive" in str(error)
    assert "rank 1 last entered all_reduce seq 0 (purpose loss)" in str(error)
    assert "Timed out waiting 3000ms" in str(error)
    assert isinstance(error.__cause__, RuntimeError)


def test_asynchronous_timeout_is_reported_from_wait(store: dist.Store) -> None:
    comm, _ = make_comm(store, 0, RuntimeError(GLOO_TIMEOUT))
    work = comm.reduce_scatter(torch.ones(1), torch.ones(3), group=GROUP, async_op=True)
    with pytest.raises(CollectiveTimeoutError) as caught:
        work.wait()
    # Every peer entered the group's first collective: nobody is missing.
    assert caught.value.missing_ranks == ()
    assert "every rank of the group entered it" in str(caught.value)


def test_point_to_point_timeout_names_the_peer(store: dist.Store) -> None:
    comm, _ = make_comm(store, 0, RuntimeError(GLOO_TIMEOUT))
    with pytest.raises(CollectiveTimeoutError) as caught:
        comm.send(torch.ones(1), dst=2, group=GROUP, async_op=False)
    assert caught.value.missing_ranks == (2,)
    assert "peer rank 2 did not complete the matching op" in str(caught.value)


def test_other_errors_pass_through(store: dist.Store) -> None:
    comm, _ = make_comm(store, 0, RuntimeError("Connection closed by peer"))
    with pytest.raises(PluginError, match="Connection closed by peer"):
        comm.all_reduce(torch.ones(2), group=GROUP)
    assert not is_timeout(ValueError("timed out"))


def test_progress_is_published_to_the_store(store: dist.Store) -> None:
    comm, plugins = make_comm(store, 5, RuntimeError(GLOO_TIMEOUT))
    for _ in range(3):
        comm.all_reduce(torch.ones(2), group=GROUP, purpose="grad_bucket")
    comm.send(torch.ones(1), dst=1, group=GROUP)  # point-to-point: not counted
    plugins.job_end()
    published = json.loads(store.get(f"{STORE_PREFIX}/rank0"))
    assert published == {"dp[0,1,2]": [3, 2, "all_reduce", "grad_bucket"]}


def test_a_publisher_left_running_is_stopped_at_interpreter_exit(store: dist.Store) -> None:
    # An engine never closed (the docs' scripts): the daemon thread must not be inside a
    # store call when Python finalizes, so the exit handler stops it and waits for it.
    comm, plugins = make_comm(store, 5, RuntimeError(GLOO_TIMEOUT))
    comm.all_reduce(torch.ones(2), group=GROUP, purpose="grad_bucket")
    publisher = plugins.manager.get_plugin("collective_timeouts")._thread
    assert publisher is not None and publisher.name == "plait-collective-progress"
    assert publisher.is_alive()
    timeouts._stop_publishers()  # what atexit runs
    assert not publisher.is_alive()
    assert json.loads(store.get(f"{STORE_PREFIX}/rank0"))["dp[0,1,2]"][0] == 1

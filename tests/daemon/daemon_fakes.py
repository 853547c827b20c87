"""Test doubles for daemon tests: rank identities and a communicate backend with fake works."""

from __future__ import annotations

import time
from typing import Any

from plait.core.comm import CompletedWork
from plait.core.hookspecs import hookimpl
from plait.core.records import CommRequest
from plait.core.step import JobInfo


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

"""Carry data-parallel gradient reductions in the policy's `reduce_dtype`.

Data-parallel runtimes reduce gradient buckets in the gradients' own dtype. With bf16 parameters
and `reduce_dtype = "fp32"` the sum over many ranks keeps fp32's mantissa (FSDP's
`MixedPrecision(reduce_dtype=torch.float32)`); with fp32 parameters under autocast and
`reduce_dtype = "bf16"` the wire carries half the bytes. The cast is a `plait_communicate`
implementation registered for the job: it takes over only `grad_bucket` / `grad_shard`
all-reduces and reduce-scatters whose dtype differs, re-issues them in `reduce_dtype` through
the same `Comm` (so telemetry and other algorithms see the real wire op) and copies the result
back when the caller waits, keeping the reduction asynchronous.
"""

from __future__ import annotations

import torch

from plait.core.comm import ChainedWork, Comm, Group, Work
from plait.core.comm_algorithms import GRADIENT_PURPOSES
from plait.core.hookspecs import hookimpl
from plait.core.records import CommRequest


class ReduceDtypeCast:
    """A plugin object (registered per engine) that casts gradient reductions to one dtype."""

    def __init__(self, comm: Comm, reduce_dtype: torch.dtype) -> None:
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.casts = 0  # reductions carried in `reduce_dtype`, for tests and reports

    @hookimpl
    def plait_communicate(self, request: CommRequest) -> Work | None:
        if request.purpose not in GRADIENT_PURPOSES:
            return None
        group = Group(
            name=request.group_name, ranks=request.group_ranks, process_group=request.group
        )
        if request.op == "all_reduce":
            (tensor,) = request.tensors
            if tensor.dtype == self.reduce_dtype:
                return None
            wire = tensor.to(self.reduce_dtype)
            inner = self.comm.all_reduce(
                wire,
                group=group,
                op=request.reduce_op,
                async_op=True,
                purpose=request.purpose,
                attributes={**request.attributes, "cast_from": str(tensor.dtype)},
            )
        elif request.op == "reduce_scatter":
            tensor, source = request.tensors
            if source.dtype == self.reduce_dtype:
                return None
            wire = torch.empty_like(tensor, dtype=self.reduce_dtype)
            inner = self.comm.reduce_scatter(
                wire,
                source.to(self.reduce_dtype),
                group=group,
                op=request.reduce_op,
                async_op=True,
                purpose=request.purpose,
            )
        else:
            return None
        self.casts += 1

        def copy_back() -> None:
            tensor.copy_(wire)

        work = ChainedWork(inner, copy_back)
        if not request.async_op:
            work.wait()
        return work

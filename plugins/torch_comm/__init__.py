"""The default `plait_communicate` implementation: torch.distributed (NCCL on GPU, Gloo on CPU).

It answers `trylast`, so an algorithm plugin that takes an op over is asked first.
"""

from __future__ import annotations

import torch.distributed as dist

from plait.core.comm import (
    INPUT_SPLIT_SIZES,
    OUTPUT_SPLIT_SIZES,
    CompletedWork,
    Work,
    reached_default,
)
from plait.core.hookspecs import hookimpl
from plait.core.records import CommRequest

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


# torch 2.13 renamed the single-tensor collectives (the old names warn on every call); older
# releases have only the old names.
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def run_torch_distributed(request: CommRequest) -> Work:
    """Issue `request` with torch.distributed and return its work handle."""
    group, async_op = request.group, request.async_op
    match request.op:
        case "all_reduce":
            (tensor,) = request.tensors
            work = dist.all_reduce(
                tensor, op=REDUCE_OPS[request.reduce_op], group=group, async_op=async_op
            )
        case "reduce_scatter":
            output, input = request.tensors
            work = REDUCE_SCATTER_SINGLE(
                output, input, op=REDUCE_OPS[request.reduce_op], group=group, async_op=async_op
            )
        case "all_gather":
            output, input = request.tensors
            work = ALL_GATHER_SINGLE(output, input, group=group, async_op=async_op)
        case "all_to_all":
            output, input = request.tensors
            work = dist.all_to_all_single(
                output,
                input,
                output_split_sizes=request.attributes.get(OUTPUT_SPLIT_SIZES),
                input_split_sizes=request.attributes.get(INPUT_SPLIT_SIZES),
                group=group,
                async_op=async_op,
            )
        case "broadcast":
            (tensor,) = request.tensors
            work = dist.broadcast(tensor, src=request.peer, group=group, async_op=async_op)
        case "send":
            (tensor,) = request.tensors
            work = (dist.isend if async_op else dist.send)(tensor, dst=request.peer, group=group)
        case "recv":
            (tensor,) = request.tensors
            work = (dist.irecv if async_op else dist.recv)(tensor, src=request.peer, group=group)
        case "barrier":
            work = dist.barrier(group=group, async_op=async_op)
        case _:
            raise ValueError(f"unknown communication op {request.op!r}")
    if async_op and work is not None and not isinstance(work, int):
        return work
    return CompletedWork()


@hookimpl(trylast=True)
def plait_communicate(request: CommRequest) -> Work:
    reached_default(request)  # no algorithm took it over (what a selected one is checked by)
    return run_torch_distributed(request)

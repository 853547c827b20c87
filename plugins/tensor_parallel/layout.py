"""How Megatron tensor parallelism holds parameters, for `ParallelRuntime.state_layout`.

The layers of `layers` keep this rank's contiguous 1/tp of a weight along one dim and tag it
with `TP_DIM_ATTR`: a column-parallel weight (and its bias) and a vocab-parallel embedding split
dim 0, a row-parallel weight dim 1, loose `param_plan` parameters dim 0. Each such slice is the
block at offset `tp_rank · local_size` along that dim (`layers.even_slice`) of a tensor `tp` times
as long, sharded over `tp`; its optimizer state is sliced the same way. Everything else stays
whole and replicated over `tp`: norms, the row-parallel bias, and grouped-query KV projections
replicated because tp exceeds the KV head count (`ReplicatedHeadsLinear` holds the full weight).
"""

from __future__ import annotations

from plait.core.state_layout import ParameterLayout, StateLayout
from plait.plugins.tensor_parallel.layers import TP_DIM_ATTR

TP_AXIS = "tp"


def tensor_parallel_layout(previous: StateLayout, *, size: int, rank: int) -> StateLayout:
    """`previous` with every tp slice placed in its global tensor."""

    def refine(entry: ParameterLayout) -> ParameterLayout:
        dim = getattr(entry.param, TP_DIM_ATTR, None)
        if dim is None:
            return entry
        local = entry.value.global_shape
        global_shape = list(local)
        global_shape[dim] = local[dim] * size
        offsets = [0] * len(local)
        offsets[dim] = rank * local[dim]
        return entry.map_tensors(
            lambda t: t.sharded_along(TP_AXIS, global_shape=global_shape, offsets=offsets)
        )

    return previous.map(refine)

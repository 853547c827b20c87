"""Where tensor-parallel slices sit in the original tensors, read from the `megatron` runtime.

Megatron's layers (`plait.plugins.tensor_parallel.layers`) keep this rank's contiguous 1/tp of a
weight along one dim, tagged `TP_DIM_ATTR`: a column-parallel weight (and its bias) and a
vocab-parallel embedding split dim 0, a row-parallel weight dim 1, loose `param_plan` parameters
dim 0. A slice is therefore the rectangular block at offset `tp_rank · local_size` along that
dim of a tensor `tp` times as long. Everything else is replicated over tp and whole: norms, the
row-parallel bias, and grouped-query KV projections replicated because tp exceeds the KV head
count (`ReplicatedHeadsLinear` holds the full weight and reads its heads' rows), which all tp
ranks hold identically and a checkpoint stores once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def tensor_parallel_blocks(
    runtime: Any, module: nn.Module
) -> dict[int, tuple[torch.Size, tuple[int, ...]]]:
    """id(parameter) -> (global shape, offsets) of every tp slice of `module`, if `runtime` is
    the tensor-parallel runtime (else empty)."""
    try:
        from plait.plugins.tensor_parallel import TensorParallelRuntime
        from plait.plugins.tensor_parallel.layers import TP_DIM_ATTR, VocabParallelEmbedding
    except ImportError:  # the plugin is not installed: nothing of this job is tp-sharded
        return {}
    if not isinstance(runtime, TensorParallelRuntime):
        return {}
    size, rank = runtime.tp.size, runtime.tp.rank
    blocks: dict[int, tuple[torch.Size, tuple[int, ...]]] = {}
    for param in module.parameters():
        dim = getattr(param, TP_DIM_ATTR, None)
        if dim is None:
            continue
        local = param.shape[dim]
        global_shape = list(param.shape)
        global_shape[dim] = local * size
        offsets = [0] * param.dim()
        offsets[dim] = rank * local
        blocks[id(param)] = (torch.Size(global_shape), tuple(offsets))
    # The slicing rule above is the layers' own (`even_slice`); the embedding states its range.
    for layer in module.modules():
        if isinstance(layer, VocabParallelEmbedding):
            _, offsets = blocks[id(layer.weight)]
            if offsets[0] != layer.vocab_start:
                raise RuntimeError(
                    f"vocab-parallel embedding starts at row {layer.vocab_start}, not at "
                    f"{offsets[0]} as an even split over tp = {size} would"
                )
    return blocks

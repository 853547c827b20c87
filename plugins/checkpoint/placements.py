"""Where the built-in model-parallel runtimes put parameters: original names and global blocks.

Tensor parallelism (the `megatron` runtime): the layers of `plait.plugins.tensor_parallel.layers`
keep this rank's contiguous 1/tp of a weight along one dim, tagged `TP_DIM_ATTR`: a
column-parallel weight (and its bias) and a vocab-parallel embedding split dim 0, a row-parallel
weight dim 1, loose `param_plan` parameters dim 0. A slice is therefore the rectangular block at
offset `tp_rank · local_size` along that dim of a tensor `tp` times as long. Everything else is
replicated over tp and whole: norms, the row-parallel bias, and grouped-query KV projections
replicated because tp exceeds the KV head count (`ReplicatedHeadsLinear` holds the full weight
and reads its heads' rows), which all tp ranks hold identically and a checkpoint stores once.

Pipeline parallelism (the `pipeline` runtime): each chunk is a copy of the full model with the
other stages' blocks removed (`plait.plugins.pipeline.split.build_chunk`), so its parameter names
are the full model's (`layers.5.attention.wq.weight`) and a checkpoint of a pipeline run is the
replicated layout over the union of the stages. Only a rank holding several chunks (virtual
stages) wraps them in `PipelineChunks`, whose names gain a `chunks.stage<k>.` prefix: naming
each parameter from its own chunk removes it.

Both read only the runtimes' public attributes (`TensorParallelRuntime.tp`,
`PipelineRuntime.chunks`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.plugins.models.init import normalised_name


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


def pipeline_names(runtime: Any) -> dict[int, str]:
    """id(parameter) -> original FQN for the chunks of `runtime` if it is the pipeline runtime
    (else empty)."""
    try:
        from plait.plugins.pipeline.runtime import PipelineRuntime
    except ImportError:  # the plugin is not installed: no job of this process is pipelined
        return {}
    if not isinstance(runtime, PipelineRuntime):
        return {}
    names: dict[int, str] = {}
    for chunk in runtime.chunks:
        for name, param in chunk.named_parameters():
            names.setdefault(id(param), normalised_name(name))
    return names

"""Original parameter names of a pipeline rank's chunks, read from the `pipeline` runtime.

Each chunk is a copy of the full model with the other stages' blocks removed
(`plait.plugins.pipeline.split.build_chunk`), so its parameter names are the full model's
(`layers.5.attention.wq.weight`) and a checkpoint of a pipeline run is the replicated layout
over the union of the stages. Only a rank holding several chunks (virtual stages) wraps them in
`PipelineChunks`, whose names gain a `chunks.stage<k>.` prefix: naming each parameter from its
own chunk removes it.
"""

from __future__ import annotations

from typing import Any

from plait.plugins.models.init import normalised_name


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

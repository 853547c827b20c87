"""How the pipeline holds parameters, for `ParallelRuntime.state_layout`: original names.

Each chunk is a copy of the full model with the other stages' blocks removed
(`split.build_chunk`), so its parameter names are the full model's (`layers.5.attention.wq.weight`)
and a pipeline rank holds a subset of the model's tensors, whole. Only a rank holding several
chunks (virtual stages) wraps them in `PipelineChunks`, whose names gain a `chunks.stage<k>.`
prefix: naming each parameter from its own chunk removes it. A stage's tensors are held by that
stage alone, so they are not replicated over `pp`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from plait.core.names import normalised_name
from plait.core.state_layout import ParameterLayout, StateLayout

PP_AXIS = "pp"


def pipeline_layout(previous: StateLayout, chunks: Sequence[nn.Module]) -> StateLayout:
    """`previous` with every parameter of `chunks` under its name in the full model."""
    names: dict[int, str] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            names.setdefault(id(param), normalised_name(name))

    def refine(entry: ParameterLayout) -> ParameterLayout:
        renamed = replace(entry, name=names.get(id(entry.param), entry.name))
        return renamed.map_tensors(lambda t: t.not_replicated_over(PP_AXIS))

    return previous.map(refine)

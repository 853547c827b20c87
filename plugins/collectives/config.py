"""Options of the ring, tree and hierarchical algorithms: the `[comm.ring]`, `[comm.tree]` and
`[comm.hierarchical]` tables.

Each is the `config_cls` of its `CommAlgorithmRecord`, so the engine validates the table (unknown
keys are errors) and the plugin reads it with `config.comm.options(name, cls)`::

    [comm]
    algorithm = "tree"

    [comm.tree]
    small_message_bytes = 65536
"""

from __future__ import annotations

from pydantic import Field

from plait.core.config import Section

PURPOSES_HELP = (
    "take over ops with these purposes only; empty = every all-reduce and every gradient "
    "reduce-scatter"
)


class RingConfig(Section):
    """Ring all-reduce: reduce-scatter then all-gather around the group, n-1 steps each."""

    purposes: list[str] = Field(default_factory=list, description=PURPOSES_HELP)
    piece_bytes: int = Field(
        1 << 20,
        gt=0,
        description="chunks travel in pieces of this size, pipelined from step to step",
    )


class TreeConfig(Section):
    """Recursive halving-doubling (Rabenseifner) all-reduce, recursive doubling when small."""

    purposes: list[str] = Field(default_factory=list, description=PURPOSES_HELP)
    small_message_bytes: int = Field(
        16 * 1024,
        ge=0,
        description="below this size exchange whole vectors (log2 p steps, latency-bound)",
    )


class HierarchicalConfig(Section):
    """Reduce-scatter inside the node, the op across nodes, all-gather inside (all-reduce); the
    same split for reduce-scatter and all-gather of groups that span nodes."""

    purposes: list[str] = Field(
        default_factory=list,
        description="take over ops with these purposes only; empty = every all-reduce, "
        "reduce-scatter and all-gather of a group that spans nodes with several ranks each",
    )

"""What a replica group sends a peer that heals from it, and how the peer takes it in.

The state is this rank's own: weights, optimizer state (a sharded optimizer's own shard, as
`optimizer.state_dict()` holds it), learning-rate schedule, the optimizer step count and the data
position. Nothing here runs a collective: torchft reads it from its quorum thread. A peer rank
with the same group rank and the same inner layout holds the same slice of it, which is what
torchft's checkpoint transport pairs (group rank i of the source sends to group rank i of the
healing group).
"""

from __future__ import annotations

from typing import Any

from plait.core.errors import PlaitError

HEAL_FORMAT = 1


class HealingError(PlaitError):
    """A peer's state cannot be taken in by this group (another inner layout)."""


def inner_layout(engine: Any) -> dict[str, Any]:
    """What must match between two groups for one rank's state to fit the other's."""
    return {
        "degrees": dict(engine.mesh.degrees),
        "dp_strategy": engine.config.parallel.dp_strategy,
        "dp_shard": engine.config.parallel.dp_shard,
        "rank": engine.mesh.rank,
    }


def heal_state(engine: Any, batches: Any) -> dict[str, Any]:
    """This rank's training state, as a live peer sends it to a healing group."""
    return {
        "format": HEAL_FORMAT,
        "layout": inner_layout(engine),
        "model": engine.module.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "lr_scheduler": (
            engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        ),
        "sampler": dict(batches.state_dict()),
        "step": int(engine.global_step),
    }


def load_heal_state(engine: Any, batches: Any, state: dict[str, Any]) -> None:
    """Take in a live peer's state: from here on this rank continues the peer's run."""
    mine = inner_layout(engine)
    if state.get("layout") != mine:
        # NOTE: torchft's transport pairs equal group ranks and sends them whole; taking in a
        # peer with another layout needs the state-layout resharding that checkpoints use.
        raise HealingError(
            f"cannot heal from a peer whose inner layout is {state.get('layout')}: this group's "
            f"is {mine}; start the replacement with the same parallel degrees and dp_strategy"
        )
    engine.module.load_state_dict(state["model"])
    engine.optimizer.load_state_dict(state["optimizer"])
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    batches.load_state_dict(state["sampler"])
    engine.global_step = int(state["step"])

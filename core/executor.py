"""Runs the action list `plait_schedule` returned, timing every action.

The executor knows nothing about strategies: each action type maps to a handler. The engine
supplies handlers for a single stage (forward, backward, gradient sync, optimizer step); a
runtime may replace or add handlers (a pipeline runtime adds send/recv and stage-aware
forward/backward) through `ParallelRuntime.action_handlers`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from plait.core.schedule import (
    Action,
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    SyncGradients,
)
from plait.core.step import PhaseSpan

Handler = Callable[[Any], None]

PHASE_NAMES: dict[type, str] = {
    Forward: "forward",
    SendActivation: "send",
    RecvActivation: "recv",
    SendGrad: "send",
    RecvGrad: "recv",
    SyncGradients: "sync_gradients",
    OptimizerStep: "optimizer",
}


def phase_name(action: Action) -> str:
    if isinstance(action, Backward):
        return {"full": "backward", "input": "backward_input", "weight": "backward_weight"}[
            action.kind
        ]
    return PHASE_NAMES[type(action)]


class Executor:
    """Dispatches actions to handlers and records a `PhaseSpan` for each."""

    def __init__(self, handlers: dict[type, Handler]) -> None:
        self.handlers = dict(handlers)

    def run(self, actions: Sequence[Action]) -> list[PhaseSpan]:
        spans: list[PhaseSpan] = []
        for action in actions:
            handler = self.handlers.get(type(action))
            if handler is None:
                raise TypeError(
                    f"no handler for schedule action {action!r}; the schedule needs a runtime "
                    "that supports it (e.g. a pipeline strategy for send/recv actions)"
                )
            start = time.time_ns()
            handler(action)
            spans.append(
                PhaseSpan(
                    name=phase_name(action),
                    start_ns=start,
                    end_ns=time.time_ns(),
                    microbatch=getattr(action, "microbatch", None),
                    chunk=getattr(action, "chunk", None),
                )
            )
        return spans

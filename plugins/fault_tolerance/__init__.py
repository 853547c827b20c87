"""Fault-tolerant data parallelism across replica groups, on torchft's quorum and commit protocol.

A job is several replica groups, each one `plait train` with its own inner layout (DDP, ZeRO, …).
torchft's lighthouse (hosted by `plait daemon --lighthouse`) forms a quorum of the live groups
every step; this plugin drives torchft's `Manager` from the engine's own step: the gradients the
optimizer steps on are averaged across the quorum after the group's own reduction, the step
commits only when every rank of the group succeeded, a step that did not commit is retried from
the same data position, and a group that joins late heals from a live peer::

    steps = FaultTolerantSteps.attach(engine, batches, fault_tolerance_config(config))
    while engine.global_step < config.train.steps:
        outcome = steps.step()          # committed, or rolled back to be retried
    steps.close()

Configured by `[fault_tolerance]` (`config.py`, a section this plugin declares). Requires the
`plait[ft]` extra (torchft).
"""

from __future__ import annotations

from plait.plugins.fault_tolerance.config import FaultToleranceConfig, fault_tolerance_config
from plait.plugins.fault_tolerance.data_share import replica_data_coordinates
from plait.plugins.fault_tolerance.steps import FaultTolerantSteps, StepOutcome

__all__ = [
    "FaultToleranceConfig",
    "FaultTolerantSteps",
    "StepOutcome",
    "fault_tolerance_config",
    "replica_data_coordinates",
]

"""Fault handling: what keeps a job going, or makes it fail clearly, when something goes wrong.

    from plait.plugins.resilience import attach_resilience
    attach_resilience(engine, resilience_config(config))   # NaN/Inf guard, fault injection

called by the training loop beside its `Checkpointer` (`plait train` does).

- `nonfinite_guard`: skip optimizer steps whose gradients hold NaN or Inf, on every rank
  together, and stop after `resilience.max_consecutive_nonfinite` of them in a row.
- `fault_injection`: a rank SIGKILLs itself (or its node) after a given step, for restart tests
  (`[resilience.fault_injection]`).
- `timeouts`: the built-in `collective_timeouts` plugin, a `plait_communicate` wrapper that turns
  a collective timeout into an error naming the op, its sequence number and the ranks that did
  not arrive.

The guard and the fault injector are configured in `[resilience]` (`config.py`, a section this
plugin declares; the keys were `[checkpoint_io]`'s and still load from there) and attached by
the training loop beside its `Checkpointer`; the checkpoint plugin itself does not know them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.plugins.resilience.config import ResilienceConfig, resilience_config

if TYPE_CHECKING:
    from plait.plugins.resilience.fault_injection import FaultInjector
    from plait.plugins.resilience.nonfinite_guard import NonFiniteGuard

__all__ = ["AttachedResilience", "ResilienceConfig", "attach_resilience", "resilience_config"]


@dataclass(frozen=True, slots=True)
class AttachedResilience:
    """What `attach_resilience` added to an engine (None: not configured)."""

    guard: NonFiniteGuard | None
    fault_injector: FaultInjector | None


def attach_resilience(engine: Any, config: ResilienceConfig) -> AttachedResilience:
    """Add to `engine` what `[resilience]` asks for: the NaN/Inf guard as its last runtime
    (when `max_consecutive_nonfinite > 0`, the default) and the fault injector as a plugin
    named `fault_injection` (when `fault_injection.kill_after_step >= 0`). Call once per
    engine, before its first step; neither makes a collective call here."""
    guard = injector = None
    if config.max_consecutive_nonfinite > 0:
        from plait.plugins.resilience.nonfinite_guard import NonFiniteGuard

        guard = NonFiniteGuard(engine, max_consecutive=config.max_consecutive_nonfinite)
        engine.append_runtime(guard)
    if config.fault_injection.kill_after_step >= 0:
        from plait.plugins.resilience.fault_injection import FaultInjector

        injector = FaultInjector(config.fault_injection)
        engine.plugins.register(injector, "fault_injection")
    return AttachedResilience(guard, injector)

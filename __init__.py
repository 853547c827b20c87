"""plait: a distributed training runtime for transformer models, built as a pluggy microkernel.

The public API for users with their own model and loop::

    engine = plait.initialize(model, config="configs/tiny.toml", optimizer=...)
    loss = engine.train_step(batch)

and for a loop plait did not launch (plain, DDP or FSDP2), the node daemon's view of it::

    observer = plait.observe(model, optimizer=optimizer)
    with observer.step():
        ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.core.version import __version__

if TYPE_CHECKING:
    from plait.core.engine import Engine, initialize
    from plait.core.hookspecs import hookimpl
    from plait.plugins.telemetry.observe import observe

__all__ = ["Engine", "__version__", "hookimpl", "initialize", "observe"]


def __getattr__(name: str) -> Any:
    # Imported lazily so `plait --help` and plugin imports do not pay for the engine.
    if name in ("Engine", "initialize"):
        from plait.core import engine

        return getattr(engine, name)
    if name == "observe":
        from plait.plugins.telemetry.observe import observe

        return observe
    if name == "hookimpl":
        from plait.core.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(f"module 'plait' has no attribute {name!r}")

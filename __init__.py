"""plait: a distributed training runtime for transformer models, built as a pluggy microkernel.

The public API for users with their own model and loop::

    engine = plait.initialize(model, config="configs/tiny.toml", optimizer=...)
    loss = engine.train_step(batch)
"""

from plait.core.engine import Engine, initialize
from plait.core.hookspecs import hookimpl

__all__ = ["Engine", "hookimpl", "initialize"]
__version__ = "0.1.0"

"""A torchrun worker for the fault-tolerance test: the trainer's loop with a `Checkpointer`.

`python -m tests.e2e.fault_tolerance_worker CKPT_DIR STEPS EVERY KILL_AFTER` trains the tiny
Llama on the bundled corpus; rank 0 prints `step N loss L` (full precision) for every step.
"""

from __future__ import annotations

import sys

from plait.core.engine import Engine
from plait.plugins.checkpoint.checkpointer import Checkpointer
from plait.plugins.checkpoint.config import CheckpointIOConfig
from plait.plugins.resilience import ResilienceConfig, attach_resilience
from plait.plugins.resilience.config import FaultInjectionConfig
from tests.dist.checkpoint_workers import engine_batches, engine_config


def main(ckpt_dir: str, steps: int, every: int, kill_after: int) -> None:
    config = engine_config()
    config["train"]["steps"] = steps
    engine = Engine(config=config)
    batches = engine_batches(engine)
    # The kill comes a step after a save, which must be on disk by then: a synchronous save (an
    # asynchronous one, the default, may still be writing when the rank dies).
    settings = CheckpointIOConfig(dir=ckpt_dir, every=every, async_save=False)
    checkpointer = Checkpointer(engine, batches, settings)
    attach_resilience(
        engine,
        ResilienceConfig(fault_injection=FaultInjectionConfig(kill_after_step=kill_after, rank=1)),
    )
    start = checkpointer.maybe_resume()
    if engine.mesh.rank == 0:
        print(f"start {start}", flush=True)
    for step in range(start, steps):
        loss = engine.train_step(batches.next_batch())
        if engine.mesh.rank == 0:
            print(f"step {step + 1} loss {loss!r}", flush=True)
        checkpointer.maybe_save(step + 1)
    checkpointer.close()
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))

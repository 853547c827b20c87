"""Replica-group ranks for the keep-the-global-batch test, and the one-process replays.

Three groups of one rank train together until group C dies (SIGKILL) inside the forward of step
`DEATH_STEP`: A and B do not commit that try, roll it back (data position included) and retry it
without C, then train the remaining steps without it. With `keep_global_batch` on, A also reads
C's share (the first missing share goes to the first live group), so A trains on two shares and
B on one, and the cross-group average must weigh them 2 : 1. On a corpus of documents one per
row (`write_padded_corpus`), rows score different numbers of tokens, so the weights must be the
groups' scored tokens, not their rows.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.core.config import load_config
from plait.core.engine import Engine
from plait.daemon.lighthouse import read_lighthouse
from plait.plugins.data import build_batches
from plait.plugins.data.documents_file import starts_from_lengths
from plait.plugins.data.token_files import TokenDirectoryWriter
from plait.plugins.data.tokenizer import token_dtype
from plait.plugins.fault_tolerance import (
    FaultTolerantSteps,
    fault_tolerance_config,
    replica_data_coordinates,
)
from plait.plugins.fault_tolerance.batch_share import concatenate_rows
from plait.testing.distributed import merged_config

STEPS = 4
DEATH_STEP = 2  # C dies in its forward; A and B retry it without C
GROUPS = 3
GLOBAL_BATCH = 6  # 2 rows per group
SHARE_ROWS = GLOBAL_BATCH // GROUPS
MARKER_WAIT_SECONDS = 60.0


def write_padded_corpus(directory: Path) -> str:
    """Documents of 2 to 17 tokens (byte ids of the tiny model), read one per row of 16 padded
    (`packing = "none"`): every row scores a different number of tokens."""
    lengths = np.random.default_rng(11).integers(2, 18, size=400)
    tokens = np.random.default_rng(12).integers(1, 255, size=int(lengths.sum()))
    with TokenDirectoryWriter(directory, dtype=token_dtype(256), documents=True) as writer:
        writer.write(tokens, document_starts=starts_from_lengths(lengths))
        writer.commit(vocab_size=256, tokenizer="bytes", sources=(), eos_id=0)
    return str(directory)


def job_config(*, group: int, lighthouse: str, keep: bool, corpus: str = "") -> dict[str, Any]:
    return merged_config(
        {
            "data": {
                "seq_len": 16,
                "path": corpus,
                "packing": "none" if corpus else "concat_split",
            },
            # A share is one micro-batch: a survivor with two shares must run two, not one of 4.
            "train": {
                "global_batch_size": GLOBAL_BATCH,
                "micro_batch_size": None,
                "steps": STEPS,
                "collective_timeout_seconds": 30.0,
            },
            "parallel": {"dp_strategy": "ddp"},
            # AdamW divides by √v + eps: with the default eps a gradient near zero turns fp32
            # rounding (groups add what one process accumulates) into visible weight changes.
            "optimizer": {"warmup_steps": 0, "eps": 1e-4},
            "fault_tolerance": {
                "replica_group": group,
                "replica_groups": GROUPS,
                "lighthouse": lighthouse,
                "keep_global_batch": keep,
                "step_timeout_seconds": 30.0,
                "quorum_timeout_seconds": 60.0,
            },
        }
    )


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + MARKER_WAIT_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited in vain for {what}")
        time.sleep(0.02)


def write_marker(path: Path, text: str) -> None:
    """Written whole or not at all: a reader that sees the file reads all of `text`."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def replica_group_rank(
    rank: int, world_size: int, group: int, lighthouse: str, markers: str, keep: bool, corpus: str
) -> dict[str, Any]:
    """Group `group`'s only rank: every try of every step, the final weights and data step."""
    del rank, world_size
    marker_dir = Path(markers)
    config = load_config(job_config(group=group, lighthouse=lighthouse, keep=keep, corpus=corpus))
    engine = Engine(config=config)
    dp_rank, dp_size = replica_data_coordinates(
        dp_rank=engine.mesh.coordinate("dp"),
        dp_size=engine.mesh.size("dp"),
        settings=fault_tolerance_config(config),
    )
    batches = build_batches(
        config.data,
        seq_len=config.data.seq_len,
        global_batch_size=config.train.global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=config.train.seed,
    )
    steps = FaultTolerantSteps.attach(
        engine, batches, fault_tolerance_config(config), job_id="ftb-job"
    )
    write_marker(marker_dir / f"manager-{group}", steps.replica_id)
    # Every group's manager heartbeats before any asks for the first quorum: step 0 has all.
    wait_for(
        lambda: all((marker_dir / f"manager-{g}").exists() for g in range(GROUPS)),
        "every group's manager",
    )
    ids = {(marker_dir / f"manager-{g}").read_text() for g in range(GROUPS)}
    wait_for(lambda: ids <= set(read_lighthouse(lighthouse).heartbeats), "the lighthouse")
    tries: list[dict[str, Any]] = []
    while engine.global_step < STEPS:
        if group == GROUPS - 1 and engine.global_step == DEATH_STEP:
            # After this step's quorum and share exchange: A and B fail in the step itself.
            engine.module.register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        outcome = steps.step()
        tries.append(
            {
                "step": outcome.step,
                "committed": outcome.committed,
                "participants": outcome.participants,
                "shares": outcome.shares,
                "forwards": sum(1 for s in engine.last_report.spans if s.name == "forward"),
            }
        )
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    data_step = batches.step
    steps.close()
    engine.close()
    return {"tries": tries, "weights": weights, "data_step": data_step}


def groups_of(step: int) -> tuple[int, ...]:
    """The groups in step `step`'s quorum."""
    return tuple(range(GROUPS)) if step < DEATH_STEP else tuple(range(GROUPS - 1))


def replays(rank: int, world_size: int, corpus: str) -> dict[str, dict[str, torch.Tensor]]:
    """One process, no replica groups, the run twice: `full`, every step on the whole global
    batch; `shrunk`, every step on the shares of the groups in the step's quorum only (what the
    job trains on with `keep_global_batch` off). Micro-batches of one share each."""
    del rank, world_size
    overrides = job_config(group=0, lighthouse="127.0.0.1:1", keep=False, corpus=corpus)
    overrides["train"]["micro_batch_size"] = SHARE_ROWS
    del overrides["fault_tolerance"]
    config = load_config(overrides)

    def sampler(dp_rank: int, dp_size: int) -> Any:
        return build_batches(
            config.data,
            seq_len=config.data.seq_len,
            global_batch_size=GLOBAL_BATCH,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=config.train.seed,
        )

    whole, shares = sampler(0, 1), [sampler(group, GROUPS) for group in range(GROUPS)]
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for name in ("full", "shrunk"):
        engine = Engine(config=config)
        for step in range(STEPS):
            if name == "full":
                batch = whole.batch_at(step)
            else:
                batch = concatenate_rows([shares[g].batch_at(step) for g in groups_of(step)])
            engine.train_step(batch)
        weights[name] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        engine.close()
    return weights

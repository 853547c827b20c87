"""What a replica group sends a peer that heals from it, and how the peer takes it in, whatever
either group's inner layout (DDP, ZeRO-1/2/3, tensor or pipeline parallel).

torchft's checkpoint transport pairs group rank i of the source with group rank i of the healing
group, and sends what `heal_state` returned there. So each source rank sends its state in the
layout-independent form checkpoints use (`plait.core.state_chunks`): every tensor under its
original name and global shape, as the chunks this rank holds with their offsets — a replicated
tensor by the first rank along its replication axes only, so the group's chunks cover every
element once. `heal_state` runs on torchft's quorum thread while the source group's main thread
waits for the quorum: it reads the state and makes no collective call.

The healing group's ranks then hold the source's chunks in the source's split, not their own.
`load_heal_state` runs on the main thread (torchft applies a received state inside
`start_quorum` when the quorum is synchronous, and every rank of a group that is behind heals in
the same quorum), so it may be collective over the group's own process group: the ranks exchange
what they received (`chunk_exchange.exchange_chunks`), each takes the overlaps its layout needs,
and the strategies' after-load steps (a ZeRO all-gather, a unit regather) run as after a
checkpoint load. Both groups must have the same number of ranks: a healing rank receives only
from its own group rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.core.comm import world_group
from plait.core.comm_algorithms import HEAL
from plait.core.errors import PlaitError
from plait.core.state_chunks import (
    Staging,
    TensorChunk,
    first_replica,
    layout_for,
    tensor_pieces,
)
from plait.core.training_state import (
    apply_schedule,
    ensure_optimizer_state,
    group_hyperparameters,
)
from plait.plugins.fault_tolerance.chunk_exchange import exchange_chunks

HEAL_FORMAT = 2


class HealingError(PlaitError):
    """A peer's state cannot be taken in by this group."""


def _value_key(name: str) -> str:
    return f"model.{name}"


def _optimizer_key(name: str, entry: str) -> str:
    return f"optim.{name}.{entry}"


def _plain(value: Any) -> float | int:
    return float(value.item()) if isinstance(value, torch.Tensor) else value


def heal_state(engine: Any, batches: Any) -> dict[str, Any]:
    """This rank's training state, as a live peer sends it to a healing group: the chunks of the
    global tensors it holds (copies on the CPU: a view would serialise its whole storage), step
    counts, schedule and data position."""
    sends = first_replica(engine)
    tensors: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    optimizer_steps: dict[str, float | int] = {}

    def add(key: str, layout: Any) -> None:
        pieces = tensor_pieces(layout, is_writer=sends)
        pieces.check(key)
        tensors[key] = [
            (tuple(c.offsets), c.tensor.detach().to("cpu", copy=True)) for c in pieces.chunks
        ]

    for name, entry in layout_for(engine).by_name().items():
        add(_value_key(name), entry.value)
        for state_key, layout in entry.optimizer_state.items():
            add(_optimizer_key(name, state_key), layout)
        if entry.step is not None:
            optimizer_steps[name] = _plain(entry.step.get())
    return {
        "format": HEAL_FORMAT,
        "group_size": engine.mesh.world_size,
        "tensors": tensors,
        "optimizer_steps": optimizer_steps,
        "param_groups": group_hyperparameters(engine.optimizer),
        "lr_scheduler": (
            engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        ),
        "sampler": dict(batches.state_dict()),
        "step": int(engine.global_step),
    }


def load_heal_state(engine: Any, batches: Any, state: dict[str, Any]) -> int:
    """Take in a live peer's state, resharded to this group's layout: from here on this rank
    continues the peer's run. Collective over the group (every rank of a healing group calls
    it in the same quorum). Returns the bytes this rank received from the others of its group."""
    if state.get("format") != HEAL_FORMAT:
        raise HealingError(
            f"a peer sent heal state of format {state.get('format')!r}; this version of plait "
            f"takes format {HEAL_FORMAT}: run every replica group on the same plait"
        )
    if state["group_size"] != engine.mesh.world_size:
        raise HealingError(
            f"cannot heal from a peer group of {state['group_size']} ranks: this group has "
            f"{engine.mesh.world_size}, and a rank receives only from its own group rank; start "
            "the replacement with as many ranks as the live groups (its layout may differ)"
        )
    # A group that has not stepped yet holds no optimizer state: make some to load into.
    ensure_optimizer_state(engine.optimizer)
    layout = layout_for(engine)
    staging = Staging()
    wanted: dict[str, list[TensorChunk]] = {}
    for name, entry in layout.by_name().items():
        wanted[_value_key(name)] = tensor_pieces(entry.value, staging=staging).chunks
        for state_key, tensor in entry.optimizer_state.items():
            wanted[_optimizer_key(name, state_key)] = tensor_pieces(tensor, staging=staging).chunks
    held = {
        key: [TensorChunk(offsets, tensor) for offsets, tensor in chunks]
        for key, chunks in state["tensors"].items()
    }
    group = world_group()
    received = exchange_chunks(
        held, wanted, comm=engine.comm, group=group, device=engine.device, purpose=HEAL
    )
    staging.write_back()
    # A rank's peer may hold no piece of a parameter (a ZeRO shard elsewhere): the group's
    # step counts together name every parameter.
    step_counts: list[dict[str, Any] | None] = [None] * group.size
    dist.all_gather_object(step_counts, state["optimizer_steps"], group=group.process_group)
    merged: dict[str, Any] = {}
    for counts in step_counts:
        merged.update(counts or {})
    for name, entry in layout.by_name().items():
        if entry.step is not None and name in merged:
            entry.step.set(merged[name])
    layout.finish_load()
    apply_schedule(engine, param_groups=state["param_groups"], lr_scheduler=state["lr_scheduler"])
    batches.load_state_dict(state["sampler"])
    engine.global_step = int(state["step"])
    return received

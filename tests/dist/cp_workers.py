"""Rank functions for the context-parallel tests: train the tiny built-in models under several
layouts in one spawn and record each step's loss and every gradient, placed in its global
tensor by the declared state layout (so tensor-parallel shards compare with whole tensors)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from plait.core.hookspecs import hookimpl
from plait.testing.distributed import VOCAB_SIZE, merged_config

Slices = tuple[tuple[int, int], ...]  # (offset, size) per dim of a piece in its global tensor


def _gradient_pieces(engine: Any) -> dict[str, list[tuple[Slices, torch.Tensor]]]:
    from plait.core.state_layout import describe_state

    layout = describe_state(engine.module, engine.optimizer, engine.runtimes, engine.mesh)
    pieces: dict[str, list[tuple[Slices, torch.Tensor]]] = {}
    for entry in layout.parameters:
        grad = entry.param.grad
        # ZeRO keeps flat gradient shards, not `.grad`: those runs compare norms only.
        if grad is None or len(entry.value.pieces) != 1:
            continue
        region = entry.value.pieces[0].region
        if region.numel != grad.numel():
            continue
        slices = tuple(zip(region.offsets, region.sizes, strict=True))
        pieces[entry.name] = [(slices, grad.detach().reshape(region.sizes).clone())]
    return pieces


def _record_gradients_at_each_step(
    engine: Any,
) -> list[dict[str, list[tuple[Slices, torch.Tensor]]]]:
    """Wrap the optimizer's step so every step first records the final gradients."""
    recorded: list[dict[str, list[tuple[Slices, torch.Tensor]]]] = []
    step_optimizer = engine.optimizer.step

    def record_then_step(*args: Any, **kwargs: Any) -> Any:
        recorded.append(_gradient_pieces(engine))
        return step_optimizer(*args, **kwargs)

    engine.optimizer.step = record_then_step
    return recorded


class PurposeRecorder:
    """A comm wrapper, as telemetry is: counts every op by (op, purpose)."""

    def __init__(self) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: Any) -> Any:
        self.seen[(request.op, request.purpose)] += 1
        return (yield)


def train_and_record(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]], steps: int
) -> dict[str, dict[str, Any]]:
    """Each case: losses per step and, per step, every gradient piece this rank holds."""
    del rank, world_size
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins

    results: dict[str, dict[str, Any]] = {}
    for name, overrides in cases.items():
        config = merged_config(overrides)
        train, seq_len = config["train"], config["data"]["seq_len"]
        tokens = torch.randint(
            0,
            VOCAB_SIZE,
            (steps, train["global_batch_size"], seq_len + 1),
            generator=torch.Generator().manual_seed(train["seed"]),
        )
        recorder = PurposeRecorder()
        engine = Engine(
            config=config,
            plugins=Plugins.create(autoload=False, extra=[("purposes", recorder)]),
        )
        recorded = _record_gradients_at_each_step(engine)
        dp, dp_size = engine.mesh.coordinate("dp"), engine.mesh.size("dp")
        share = train["global_batch_size"] // dp_size
        losses, grad_norms = [], []
        for step in range(steps):
            batch = tokens[step, dp * share : (dp + 1) * share]
            losses.append(engine.train_step((batch[:, :-1], batch[:, 1:])))
            grad_norms.append(engine.last_report.grad_norm if engine.last_report else None)
        work = _attention_flops(engine.module)
        engine.close()
        results[name] = {
            "losses": losses,
            "grad_norms": grad_norms,
            "grads": recorded,
            "attention_flops": work,
            "comm": dict(recorder.seen),
        }
    return results


def _attention_flops(module: torch.nn.Module) -> int | None:
    from plait.plugins.context_parallel import attention_work

    work = attention_work(module)
    return None if work is None else work.flops


def checkpoint_round_trip(
    rank: int, world_size: int, ckpt_dir: str, steps: int, save_at: int | None, resume: bool
) -> dict[str, Any]:
    """Train on `world_size` ranks, all of them one cp group (cp = world size), resuming from
    `ckpt_dir` if asked and saving after step `save_at`; return the losses by step."""
    from tests.dist.checkpoint_workers import engine_config
    from tests.dist.resharding_workers import train_with_checkpoints

    config = engine_config(parallel={"cp": world_size})
    config["train"] = {**config["train"], "steps": steps}
    saves = () if save_at is None else (save_at,)
    engine, start, losses = train_with_checkpoints(config, ckpt_dir, steps, saves, resume)
    return {"rank": rank, "start": start, "losses": losses, "cp": engine.mesh.size("cp")}

"""Rank functions for the mixed-precision tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch

from plait.core.engine import Engine
from plait.core.plugins import Plugins
from plait.core.sharding import ParallelRuntime
from plait.plugins import activation_checkpointing, precision

SEQ = 16
GLOBAL_BATCH = 8
VOCAB = 256


def global_batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable sequences: each continues an arithmetic progression modulo the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=gen)
        stride = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=gen)
        tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def make_engine(
    amp: dict[str, Any] | None,
    checkpoint: dict[str, Any] | None,
    micro_batch: int,
    steps: int,
    *,
    dp_strategy: str = "ddp",
) -> Engine:
    transforms = {}
    config: dict[str, Any] = {
        "model": {"name": "llama", "size": "tiny", "overrides": {"max_seq_len": SEQ}},
        "data": {"seq_len": SEQ},
        "train": {
            "steps": steps,
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": micro_batch,
            "max_grad_norm": 1.0,
            "seed": 0,
            "device": "cpu",
        },
        "optimizer": {"lr": 1e-2, "warmup_steps": 2, "weight_decay": 0.0},
        "telemetry": {"enabled": False},
    }
    if amp is not None:
        transforms["precision"] = precision.NAME
        config["amp"] = amp
    if checkpoint is not None:
        transforms["ac"] = activation_checkpointing.NAME
        config["checkpoint"] = checkpoint
    config["parallel"] = {"transforms": transforms, "dp_strategy": dp_strategy}
    plugins = Plugins.create(
        autoload=False,
        extra=[("precision", precision), ("checkpointing", activation_checkpointing)],
    )
    return Engine(config=config, plugins=plugins)


def amp_runtime(engine: Engine) -> precision.MixedPrecisionRuntime:
    return next(rt for rt in engine.runtimes if isinstance(rt, precision.MixedPrecisionRuntime))


def local_share(
    batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    share = GLOBAL_BATCH // world_size
    inputs, targets = batch
    return inputs[rank * share : (rank + 1) * share], targets[rank * share : (rank + 1) * share]


def train_losses(
    rank: int, world_size: int, runs: dict[str, dict[str, Any] | None], steps: int
) -> dict[str, Any]:
    """Train one tiny Llama per named precision config on the same data; return loss curves."""
    results: dict[str, Any] = {}
    for name, amp in runs.items():
        checkpoint = {"mode": "selective"} if name.endswith("+ac") else None
        engine = make_engine(amp, checkpoint, GLOBAL_BATCH // world_size, steps)
        losses = [
            engine.train_step(local_share(batch, rank, world_size))
            for batch in global_batches(steps)
        ]
        param = next(engine.module.parameters())
        results[name] = {
            "losses": losses,
            "param_dtype": str(param.dtype),
            "grad_dtype": str(param.grad.dtype) if param.grad is not None else None,
            "memory": engine.memory_report(),
            "checkpointed": (
                list(engine.context.activation_checkpointing.wrapped)
                if engine.context.activation_checkpointing is not None
                else None
            ),
            "reduce_casts": getattr(
                engine.plugins.manager.get_plugin("amp.reduce_dtype"), "casts", None
            ),
        }
        engine.close()
    return results


class InjectInf(ParallelRuntime):
    """Writes inf into one gradient on one rank, after data-parallel sync, on chosen steps."""

    name = "inject-inf"

    def __init__(self, engine: Engine, *, rank: int, steps: set[int]) -> None:
        self.engine = engine
        self.rank = rank
        self.steps = steps

    def sync_gradients(self) -> None:
        if self.engine.mesh.rank == self.rank and self.engine.global_step in self.steps:
            param = next(p for p in self.engine.module.parameters() if p.grad is not None)
            param.grad.view(-1)[0] = float("inf")


def overflow_recovery(
    rank: int, world_size: int, amp: dict[str, Any], inject_steps: list[int], steps: int
) -> dict[str, Any]:
    """Train fp16 with an inf injected on rank 1 only; record what every rank decided."""
    engine = make_engine(amp, None, 2, steps)
    runtime = amp_runtime(engine)
    # Appended last, so its sync runs after DDP's: the inf exists on one rank only.
    engine.runtimes.append(InjectInf(engine, rank=1, steps=set(inject_steps)))
    record: dict[str, list[Any]] = {"losses": [], "skipped": [], "scales": [], "changed": []}
    for batch in global_batches(steps):
        before = [p.detach().clone() for p in engine.module.parameters()]
        record["losses"].append(engine.train_step(local_share(batch, rank, world_size)))
        after = list(engine.module.parameters())
        record["changed"].append(
            any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
        )
        record["skipped"].append(engine.last_report.skipped)
        record["scales"].append(runtime.loss_scale)
    flat = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    return {
        **record,
        "skipped_steps": runtime.skipped_steps,
        "state": runtime.state_dict()["loss_scale"],
        "params": flat,
    }


def resume_with_master_weights(
    rank: int, world_size: int, ckpt_dir: str, layouts: list[tuple[str, str]], param_dtype: str
) -> dict[str, dict[str, Any]]:
    """For each (saving strategy, resuming strategy): 4 steps straight, and 2 steps saved then
    resumed for 2 more, with bf16 parameters over fp32 master weights (or `param_dtype`)."""
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig

    del world_size
    batches = global_batches(4)

    def run(strategy: str, stop: int, save_at: int | None, directory: str) -> list[float]:
        amp = {"dtype": "bf16", "param_dtype": param_dtype}
        engine = make_engine(amp, None, 2, 4, dp_strategy=strategy)
        checkpointer = Checkpointer(engine, None, CheckpointIOConfig(dir=directory, keep=0))
        start = checkpointer.maybe_resume()
        losses = []
        for step in range(start, stop):
            losses.append(engine.train_step(local_share(batches[step], rank, 2)))
            if save_at == step + 1:
                checkpointer.save(step + 1)
        checkpointer.close()
        engine.close()
        return losses

    results = {}
    for saving, resuming in layouts:
        name = f"{saving}->{resuming}"
        straight = run(saving, 4, None, f"{ckpt_dir}/{name}/straight")
        run(saving, 2, 2, f"{ckpt_dir}/{name}/split")
        resumed = run(resuming, 4, None, f"{ckpt_dir}/{name}/split")
        results[name] = {"straight": straight, "resumed": resumed}
    return results

"""Peak activation memory and step-time overhead of activation checkpointing: none / full /
every-2 / selective, on one built-in model in one run.

    python tools/bench/memory.py [--family llama] [--dim 256] [--layers 4] [--seq 256] [--batch 4]

Memory is measured, not estimated: a `TorchDispatchMode` sees every tensor an aten op creates
during forward and backward, adds its storage's bytes when it appears and subtracts them when
the storage is freed (a weak-reference callback). Parameters' storages (and views of them) are
not counted. Two figures per mode:

- **saved for backward**: bytes still alive when forward has returned the loss — what autograd
  (and the checkpoint wrappers) keep for backward. This is the activation memory checkpointing
  trades for recomputation.
- **step peak**: the highest live total during forward + backward (activations, recomputed
  activations, gradients and temporaries), above the parameters.

Time is the median of `--repeats` forward+backward passes without the meter (it slows every op),
the modes taking turns pass by pass after one warm-up round; overhead is relative to no
checkpointing in the same run. Two clocks: the CPU time of this process (`time.process_time`,
with one torch thread by default), which counts the work done and is what the overhead column
uses, because on a shared machine wall-clock time mostly measures the other processes; and the
wall-clock time, for reference. The gradients
of every mode are compared with no checkpointing's (they must be identical).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MODES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "full": {"mode": "full"},
    "every-2": {"mode": "every", "every": 2},
    "selective": {"mode": "selective"},
}


class LiveTensorMeter(TorchDispatchMode):
    """Live bytes of tensor storages created by aten ops while active, and their peak."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._excluded = {t.untyped_storage()._cdata for t in exclude}
        self._tracked: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def _on_free(self, key: int, nbytes: int) -> Callable[[Any], None]:
        def free(_: Any) -> None:
            self.live -= nbytes
            self._tracked.pop(key, None)

        return free

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._tracked or key in self._excluded:
                continue
            nbytes = storage.nbytes()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self._tracked[key] = weakref.ref(storage, self._on_free(key, nbytes))
        return out


def build_model(args: argparse.Namespace, checkpoint: dict[str, Any] | None) -> nn.Module:
    from plait.core.kernels import Kernels
    from plait.core.plugins import Plugins
    from plait.plugins.activation_checkpointing import apply_activation_checkpointing
    from plait.plugins.models import resolve_model_config

    plugins = Plugins.create(autoload=False)
    overrides = {"dim": args.dim, "n_layers": args.layers, "max_seq_len": args.seq}
    if args.heads:
        overrides["n_heads"] = args.heads
    config = resolve_model_config(args.family, "tiny", overrides)
    model = plugins.model(args.family).build(config, Kernels(plugins))
    model.init_weights(seed=0)
    model.to(getattr(torch, args.dtype))
    if checkpoint is not None:
        apply_activation_checkpointing(model, **checkpoint)
    return model


def step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def measure_memory(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    params = list(model.parameters())
    gc.collect()
    with LiveTensorMeter(exclude=params) as meter:
        loss = step(model, inputs, targets)
        gc.collect()
        saved = meter.live - loss.untyped_storage().nbytes()
        loss.backward()
    grads = [p.grad.detach().clone() for p in params]
    return {"saved": saved, "peak": meter.peak, "grads": grads}


def measure_times(
    models: dict[str, nn.Module], inputs: torch.Tensor, targets: torch.Tensor, repeats: int
) -> dict[str, tuple[float, float]]:
    """Median fwd+bwd (CPU seconds, wall seconds) per mode. Modes take turns pass by pass, so
    load from other processes falls on all of them alike; the first round warms up."""
    cpu: dict[str, list[float]] = {mode: [] for mode in models}
    wall: dict[str, list[float]] = {mode: [] for mode in models}
    for round_index in range(repeats + 1):
        for mode, model in models.items():
            model.zero_grad(set_to_none=True)
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            step(model, inputs, targets).backward()
            if round_index:
                cpu[mode].append(time.process_time() - cpu_start)
                wall[mode].append(time.perf_counter() - wall_start)
    return {mode: (statistics.median(cpu[mode]), statistics.median(wall[mode])) for mode in models}


def render(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    base = rows[0]
    table = Table(title=title)
    for column in (
        "mode",
        "saved MiB",
        "× none",
        "peak MiB",
        "× none",
        "fwd+bwd CPU ms",
        "overhead",
        "wall ms",
        "max |Δgrad|",
    ):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in rows:
        table.add_row(
            row["mode"],
            f"{row['saved'] / 2**20:.2f}",
            f"{row['saved'] / base['saved']:.2f}",
            f"{row['peak'] / 2**20:.2f}",
            f"{row['peak'] / base['peak']:.2f}",
            f"{row['cpu_seconds'] * 1e3:.1f}",
            f"{(row['cpu_seconds'] / base['cpu_seconds'] - 1) * 100:+.0f}%",
            f"{row['wall_seconds'] * 1e3:.1f}",
            f"{row['grad_diff']:.1e}",
        )
    Console(width=120).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="llama", choices=["llama", "gpt2"])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=0, help="attention heads (default: preset)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per mode")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator())
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    models = {mode: build_model(args, checkpoint) for mode, checkpoint in MODES.items()}
    rows = []
    for mode, model in models.items():
        result = measure_memory(model, inputs, targets)
        if not rows:
            base_grads = result["grads"]
        result["grad_diff"] = max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(result.pop("grads"), base_grads, strict=True)
        )
        rows.append({"mode": mode, **result})
    seconds = measure_times(models, inputs, targets, args.repeats)
    for row in rows:
        row["cpu_seconds"], row["wall_seconds"] = seconds[row["mode"]]
    title = (
        f"activation checkpointing: {args.family} dim {args.dim}, {args.layers} layers, "
        f"batch {args.batch} × seq {args.seq}, {args.dtype}, "
        f"CPU ({torch.get_num_threads()} threads)"
    )
    render(rows, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())

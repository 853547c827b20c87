"""fp8 training on one GPU: plait's fp8 linear layers against torchao's float8 training, and both
against bf16, on the same Llama, tokens and seed.

    python tools/bench/fp8.py [--size 1b] [--seq 2048] [--batch 4] [--steps 200] [--chunk 20]
                              [--no-compile] [--json PATH]
    python tools/bench/fp8.py --smoke     # a tiny model on CPU: checks the script runs

Three plain training loops (bf16 autocast, fused AdamW, cross-entropy in fp32), each on its own
copy of one initial model:

- `bf16`: `nn.Linear` everywhere;
- `plait fp8`: `plait.plugins.precision.fp8.convert_to_float8` (what `amp.fp8 = true` swaps in:
  e4m3 forward, e5m2 gradients, dynamic per-tensor scales);
- `torchao fp8`: `torchao.float8.convert_to_float8_training` with its default recipe
  (tensorwise dynamic scaling), the anchor.

The output head stays in bf16 in both fp8 variants. With compile on (the default, as torchao
recommends for float8), each model is `torch.compile`d. The variants take turns in chunks of
`--chunk` steps until each has run `--steps`, so clock and thermal drift hit all of them alike;
the first chunk (compilation, warm-up) is not timed. Printed: tokens/s and its ratio to
torchao fp8, the mean loss of the last 10 steps and its relative difference to bf16.
Nothing is asserted: the figures are for the notes (goal: plait fp8 ≥ torchao fp8 in tokens/s,
loss within 1 % of bf16 after 200 steps).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.plugins.models import resolve_model_config
from plait.plugins.models.llama import build_llama
from plait.plugins.precision.fp8 import ALIGNMENT, convert_to_float8

HEAD = "output"


@dataclass(slots=True)
class Loop:
    name: str
    model: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # per timed chunk, per step


def _torchao_float8(model: nn.Module) -> nn.Module:
    from torchao.float8 import convert_to_float8_training

    def fits(module: nn.Module, name: str) -> bool:
        # The same layers plait converts: not the head, both dims multiples of 16.
        return name != HEAD and not (
            module.in_features % ALIGNMENT or module.out_features % ALIGNMENT
        )

    return convert_to_float8_training(model, module_filter_fn=fits)


CONVERSIONS: dict[str, Callable[[nn.Module], object]] = {
    "bf16": lambda model: None,
    "plait fp8": lambda model: convert_to_float8(model, skip=[HEAD]),
    "torchao fp8": _torchao_float8,
}


def build_loops(
    size: str, overrides: dict, device: str, *, compiled: bool, names: list[str]
) -> list[Loop]:
    torch.manual_seed(0)
    config = resolve_model_config("llama", size, overrides)
    initial = build_llama(config, Kernels(Plugins.create(autoload=False), prefer=["torch"]))
    loops = []
    for name in names:
        model = copy.deepcopy(initial).to(device)
        CONVERSIONS[name](model)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=3e-4, weight_decay=0.1, fused=device == "cuda"
        )
        forward = torch.compile(model) if compiled else model
        loops.append(Loop(name, model, forward, optimizer))
    return loops


def train_chunk(loop: Loop, batches: list[torch.Tensor], device: str) -> None:
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = loop.forward(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        loop.optimizer.step()
        loop.optimizer.zero_grad(set_to_none=True)
        loop.losses.append(loss.detach())


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(
    loops: list[Loop],
    batches: list[torch.Tensor],
    *,
    chunk: int,
    device: str,
    after_round: Callable[[], None] = lambda: None,
) -> None:
    """Each loop trains `chunk` steps in turn until all batches are used; `after_round` is called
    after every round (to save figures a run cut off part-way keeps)."""
    for start in range(0, len(batches), chunk):
        part = batches[start : start + chunk]
        for loop in loops:
            _synchronize(device)
            began = time.perf_counter()
            train_chunk(loop, part, device)
            _synchronize(device)
            if start > 0:  # the first chunk compiles and warms up
                loop.seconds.append((time.perf_counter() - began) / len(part))
        after_round()


def figures(loops: list[Loop], tokens_per_step: int) -> dict[str, dict[str, float]]:
    by_name = {loop.name: loop for loop in loops}
    bf16_tail = statistics.fmean(by_name["bf16"].losses[-10:]) if "bf16" in by_name else None
    out = {}
    for loop in loops:
        loop.losses = [float(loss) for loss in loop.losses]
    for loop in loops:
        tail = statistics.fmean(loop.losses[-10:])
        rate = tokens_per_step / statistics.median(loop.seconds) if loop.seconds else 0.0
        out[loop.name] = {
            "tokens_per_second": rate,
            "final_loss": tail,
            "loss_vs_bf16": (tail / bf16_tail - 1) if bf16_tail else 0.0,
            "losses": loop.losses,
        }
    peer = out.get("torchao fp8", {}).get("tokens_per_second", 0.0)
    for row in out.values():
        row["vs_torchao_fp8"] = row["tokens_per_second"] / peer if peer else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU, eager")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.smoke:
        device, size, seq, batch, steps, chunk, compiled = "cpu", "tiny", 32, 2, 2, 1, False
        overrides = {"dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}
    elif not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures one GPU (try --smoke to check it runs)")
        return 0
    else:
        device, size, seq, batch = "cuda", args.size, args.seq, args.batch
        steps, chunk, compiled = args.steps, args.chunk, not args.no_compile
        overrides = {"max_seq_len": seq}
    names = list(CONVERSIONS)
    if importlib.util.find_spec("torchao") is None:
        names.remove("torchao fp8")
        print("torchao is not installed (pip install 'plait[fp8]'): no torchao fp8 figures")
    loops = build_loops(size, overrides, device, compiled=compiled, names=names)
    vocab = loops[0].model.output.out_features
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=generator) for _ in range(steps)]
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    header = {"size": size, "seq": seq, "batch": batch, "steps": steps, "device": where}

    def save() -> None:
        if args.json:
            document = {**header, "compiled": compiled, "variants": figures(loops, batch * seq)}
            args.json.write_text(json.dumps(document))

    run(loops, batches, chunk=chunk, device=device, after_round=save)
    results = figures(loops, batch * seq)
    print(f"llama {size} · T={seq} · batch {batch} · {steps} steps · {where} · compiled {compiled}")
    columns = ("tokens/s", "vs torchao fp8", "loss (last 10)", "vs bf16")
    print(f"{'variant':12} {columns[0]:>10} {columns[1]:>15} {columns[2]:>15} {columns[3]:>8}")
    for name, row in results.items():
        print(
            f"{name:12} {row['tokens_per_second']:10,.0f} {row['vs_torchao_fp8']:15.3f} "
            f"{row['final_loss']:15.4f} {row['loss_vs_bf16']:+8.2%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

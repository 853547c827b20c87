"""One GPU, one model: plait against a plain PyTorch loop on the same Llama, in one run.

    python tools/bench/gpu.py [--size 1b] [--seq 2048] [--batch 4] [--steps 10] [--rounds 3]
    python tools/bench/gpu.py --smoke      # a tiny model on CPU: checks the script runs

Variants, trained on the same random tokens, taking turns round by round (so clock and thermal
drift hit all of them alike), each round `--steps` timed steps after warm-up:

- `plain eager`: the built-in Llama (`nn.Module` with the torch reference ops) in a hand-written
  loop — bf16 autocast, fused AdamW, no plait engine;
- `plain compiled`: the same loop on `torch.compile(model)`;
- `plait torch`: `plait.core.engine.Engine`, one rank (NCCL), AMP bf16, torch kernels;
- `plait torch compiled`: the same with every block compiled (`transforms.compile`);
- `plait triton`: `plait torch` with `kernels.prefer = ["triton"]`.

Printed per variant: tokens/s, MFU against the GPU's bf16 dense peak (plait's peak table; the
model's FLOPs per token from plait's formula, the same for every variant), peak memory
(`torch.cuda.max_memory_allocated`) and the ratio to `plain compiled`. Nothing is asserted.
Then each Triton kernel against torch eager and `torch.compile` of its reference:
`tools/bench/kernels.py` (run it directly for the per-kernel table).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.core.engine import Engine
from plait.core.kernels import Kernels
from plait.core.peak_flops import peak_flops_for
from plait.core.plugins import Plugins
from plait.plugins.models import resolve_model_config
from plait.plugins.models.common import flops_per_token as flops_per_token_of
from plait.plugins.models.llama import build_llama


@dataclass(frozen=True, slots=True)
class Setting:
    size: str
    seq: int
    batch: int
    device: str
    dtype: torch.dtype
    overrides: dict


@dataclass(slots=True)
class Variant:
    name: str
    step: Callable[[torch.Tensor], float]
    close: Callable[[], None]
    seconds: list[float]
    peak_bytes: int = 0


def _tokens(setting: Setting, vocab: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (setting.batch, setting.seq + 1)
    return [torch.randint(0, vocab, shape, generator=generator) for _ in range(steps)]


def plain_variant(setting: Setting, *, compiled: bool) -> Variant:
    model_config = resolve_model_config("llama", setting.size, setting.overrides)
    kernels = Kernels(Plugins.create(autoload=False), prefer=["torch"])
    model = build_llama(model_config, kernels).to(setting.device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=setting.device == "cuda", weight_decay=0.1
    )
    forward = torch.compile(model) if compiled else model

    def step(batch: torch.Tensor) -> float:
        batch = batch.to(setting.device, non_blocking=True)
        with torch.autocast(setting.device, dtype=setting.dtype):
            logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    name = "plain compiled" if compiled else "plain eager"
    return Variant(name, step, lambda: None, [])


def plait_variant(setting: Setting, *, kernels: str, compiled: bool = False) -> Variant:
    dtype = "bf16" if setting.dtype == torch.bfloat16 else "fp16"
    transforms = {"precision": "amp", **({"compile": "compile"} if compiled else {})}
    engine = Engine(
        config={
            "model": {"name": "llama", "size": setting.size, "overrides": setting.overrides},
            "data": {"seq_len": setting.seq},
            "train": {"global_batch_size": setting.batch, "device": setting.device},
            "optimizer": {"lr": 1e-4, "warmup_steps": 0, "weight_decay": 0.1},
            "parallel": {"dp_strategy": "ddp", "transforms": transforms},
            "amp": {"dtype": dtype},
            "kernels": {"prefer": [kernels]},
            "telemetry": {"enabled": False},
        }
    )

    def step(batch: torch.Tensor) -> float:
        return engine.train_step((batch[:, :-1], batch[:, 1:]))

    name = f"plait {kernels}" + (" compiled" if compiled else "")
    return Variant(name, step, engine.close, [])


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(setting: Setting, *, steps: int, warmup: int, rounds: int) -> None:
    model_config = resolve_model_config("llama", setting.size, setting.overrides)
    flops_per_token = flops_per_token_of(model_config, setting.seq)
    device_name = torch.cuda.get_device_name() if setting.device == "cuda" else "cpu"
    peak = peak_flops_for(setting.device, device_name, "bf16")
    builders: list[Callable[[], Variant]] = [
        lambda: plain_variant(setting, compiled=False),
        lambda: plain_variant(setting, compiled=setting.device == "cuda"),
        lambda: plait_variant(setting, kernels="torch"),
    ]
    if setting.device == "cuda":
        builders.append(lambda: plait_variant(setting, kernels="torch", compiled=True))
        builders.append(lambda: plait_variant(setting, kernels="triton"))
    else:
        builders.pop(1)  # torch.compile on CPU measures the compiler, not the model
    batches = _tokens(setting, model_config.vocab_size, warmup + steps)
    results: dict[str, Variant] = {}
    for _ in range(rounds):
        for build in builders:
            # One variant on the device at a time: the model, its optimizer and its graphs.
            variant = build()
            for batch in batches[:warmup]:
                variant.step(batch)
            if setting.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _synchronize(setting.device)
            start = time.perf_counter()
            for batch in batches[warmup:]:
                variant.step(batch)
            _synchronize(setting.device)
            seconds = (time.perf_counter() - start) / steps
            record = results.setdefault(
                variant.name, Variant(variant.name, variant.step, variant.close, [])
            )
            record.seconds.append(seconds)
            if setting.device == "cuda":
                record.peak_bytes = max(record.peak_bytes, torch.cuda.max_memory_allocated())
            variant.close()
            del variant
            gc.collect()
            if setting.device == "cuda":
                torch.cuda.empty_cache()
    tokens = setting.batch * setting.seq
    print(
        f"llama {setting.size} · T={setting.seq} · batch {setting.batch} · {device_name} · "
        f"bf16 peak {peak.flops / 1e12:.1f} TFLOP/s ({peak.source}) · "
        f"{flops_per_token / 1e9:.2f} GFLOP/token"
    )
    baseline_name = "plain compiled" if "plain compiled" in results else "plain eager"
    baseline = statistics.median(results[baseline_name].seconds)
    header = f"vs {baseline_name}"
    print(f"{'variant':16} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {header:>18}  spread")
    for name, record in results.items():
        median = statistics.median(record.seconds)
        rate = tokens / median
        mfu = rate * flops_per_token / peak.flops
        spread = f"{min(record.seconds) * 1e3:.1f}–{max(record.seconds) * 1e3:.1f} ms"
        print(
            f"{name:16} {rate:10,.0f} {mfu:7.1%} {record.peak_bytes / 2**30:9.2f} "
            f"{baseline / median:18.3f}  {spread}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        overrides = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}
        setting = Setting("tiny", 64, 2, "cpu", torch.bfloat16, overrides)
        run(setting, steps=2, warmup=1, rounds=1)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures one GPU (try --smoke to check it runs)")
        return 0
    os.environ.setdefault("TRITON_INTERPRET", "0")
    setting = Setting(
        args.size, args.seq, args.batch, "cuda", torch.bfloat16, {"max_seq_len": args.seq}
    )
    run(setting, steps=args.steps, warmup=args.warmup, rounds=args.rounds)
    print("\nper-kernel figures: python tools/bench/kernels.py --dtype bfloat16")
    return 0


if __name__ == "__main__":
    sys.exit(main())

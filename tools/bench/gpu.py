"""One GPU, one model: plait against a plain PyTorch loop on the same Llama, in one run.

    python tools/bench/gpu.py [--size 1b] [--seq 2048] [--batch 4] [--steps 10] [--rounds 3]
    python tools/bench/gpu.py --quick      # one round, cheapest variants first (tools/gpu_check.py)
    python tools/bench/gpu.py --smoke      # a tiny model on CPU: checks the script runs

`--json PATH` rewrites PATH after every variant's round, so a run cut off part-way still leaves
the figures of the variants it finished.

Variants, trained on the same random tokens, taking turns round by round (so clock and thermal
drift hit all of them alike), each round `--steps` timed steps after warm-up:

- `plain eager`: the built-in Llama (`nn.Module` with the torch reference ops) in a hand-written
  loop — bf16 autocast, fused AdamW, no plait engine;
- `plain compiled`: the same loop on `torch.compile(model)`;
- `plait torch`: `plait.core.engine.Engine`, one rank (NCCL), AMP bf16, torch kernels;
- `plait torch compiled`: the same with every block compiled (`transforms.compile`);
- `plait triton compiled`: blocks compiled around plait's Triton kernels, which the compiler
  sees as custom ops (`plait.plugins.kernels_triton.custom_ops`; attention still breaks the
  graph);
- `plait triton`: `plait torch` with `kernels.prefer = ["triton"]`;
- `plait auto`: `plait torch` with `kernels.provider = "auto"`: each op's provider (torch,
  triton, or `torch.compile` of the reference) timed at its first call, the fastest kept.

Printed per variant: tokens/s, MFU against the GPU's bf16 dense peak (plait's peak table; the
model's FLOPs per token from plait's formula, the same for every variant), peak memory
(`torch.cuda.max_memory_allocated`) and the ratio to `plain compiled`. Nothing is asserted.
Then each Triton kernel against torch eager and `torch.compile` of its reference:
`tools/bench/kernels.py` (run it directly for the per-kernel table).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from plait.core.engine import Engine
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.daemon.peak_flops import peak_flops_for
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
    # Which provider ran each op (op/device/dtype -> provider), read after the timed steps.
    providers: Callable[[], dict[str, str]] = dict
    chosen: dict[str, str] = field(default_factory=dict)


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
            # "auto": each op's provider timed at its first call (torch, triton, compiled).
            "kernels": {"provider": "auto"} if kernels == "auto" else {"prefer": [kernels]},
            "telemetry": {"enabled": False},
        }
    )

    def step(batch: torch.Tensor) -> float:
        return engine.train_step((batch[:, :-1], batch[:, 1:]))

    def providers() -> dict[str, str]:
        chosen = engine.kernels.chosen_providers()
        return {"/".join(key): provider for key, provider in sorted(chosen.items())}

    name = f"plait {kernels}" + (" compiled" if compiled else "")
    return Variant(name, step, engine.close, [], providers=providers)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _builders(setting: Setting) -> dict[str, Callable[[], Variant]]:
    """The variants by name, those that compile last: a run cut off at its time cap still has
    the eager figures, and the compiled ones follow the eager ones they are compared with."""
    builders: dict[str, Callable[[], Variant]] = {
        "plain eager": lambda: plain_variant(setting, compiled=False),
        "plait torch": lambda: plait_variant(setting, kernels="torch"),
    }
    if setting.device == "cuda":
        builders["plait triton"] = lambda: plait_variant(setting, kernels="triton")
        builders["plain compiled"] = lambda: plain_variant(setting, compiled=True)
        builders["plait torch compiled"] = lambda: plait_variant(
            setting, kernels="torch", compiled=True
        )
        builders["plait triton compiled"] = lambda: plait_variant(
            setting, kernels="triton", compiled=True
        )
        builders["plait auto"] = lambda: plait_variant(setting, kernels="auto")
    # On CPU torch.compile measures the compiler, not the model, and Triton cannot compile.
    return builders


def _figures(
    results: dict[str, Variant], *, tokens: int, flops_per_token: float, peak_flops: float
) -> dict[str, dict[str, float]]:
    """Per variant: the median step's tokens/s and MFU, peak memory and its steps' times."""
    figures = {}
    for name, record in results.items():
        median = statistics.median(record.seconds)
        rate = tokens / median
        figures[name] = {
            "tokens_per_second": rate,
            "mfu": rate * flops_per_token / peak_flops if peak_flops > 0 else 0.0,
            "peak_memory_gib": record.peak_bytes / 2**30,
            "step_seconds": list(record.seconds),
            "providers": dict(record.chosen),
        }
    return figures


def run(
    setting: Setting, *, steps: int, warmup: int, rounds: int, json_path: Path | None = None
) -> None:
    model_config = resolve_model_config("llama", setting.size, setting.overrides)
    flops_per_token = flops_per_token_of(model_config, setting.seq)
    device_name = torch.cuda.get_device_name() if setting.device == "cuda" else "cpu"
    peak = peak_flops_for(setting.device, device_name, "bf16")
    tokens = setting.batch * setting.seq
    header = {
        "model": f"llama {setting.size}",
        "seq": setting.seq,
        "batch": setting.batch,
        "device": device_name,
        "peak_tflops": peak.flops / 1e12,
        "peak_source": peak.source,
        "gflops_per_token": flops_per_token / 1e9,
        "steps": steps,
        "rounds": rounds,
    }
    builders = _builders(setting)
    batches = _tokens(setting, model_config.vocab_size, warmup + steps)
    results: dict[str, Variant] = {}
    failures: dict[str, str] = {}

    def save() -> None:
        if json_path is None:
            return
        figures = _figures(
            results, tokens=tokens, flops_per_token=flops_per_token, peak_flops=peak.flops
        )
        document = {**header, "variants": figures, "failed": failures}
        json_path.write_text(json.dumps(document, indent=2))

    save()
    for _ in range(rounds):
        for name, build in builders.items():
            try:
                seconds, peak_bytes, chosen = _time_variant(setting, build, batches, warmup=warmup)
            except Exception as exc:  # one variant failing must not lose the others' figures
                failures[name] = f"{type(exc).__name__}: {exc}"
                print(f"{name} failed: {failures[name]}", flush=True)
                continue
            record = results.setdefault(name, Variant(name, lambda _: 0.0, lambda: None, []))
            record.seconds.append(seconds)
            record.peak_bytes = max(record.peak_bytes, peak_bytes)
            record.chosen = chosen
            save()
            print(f"{name}: {tokens / seconds:,.0f} tokens/s this round", flush=True)
    print(
        f"llama {setting.size} · T={setting.seq} · batch {setting.batch} · {device_name} · "
        f"bf16 peak {peak.flops / 1e12:.1f} TFLOP/s ({peak.source}) · "
        f"{flops_per_token / 1e9:.2f} GFLOP/token"
    )
    if not results:
        print("no variant finished")
        return
    baseline_name = "plain compiled" if "plain compiled" in results else "plain eager"
    baseline = statistics.median(results.get(baseline_name, next(iter(results.values()))).seconds)
    ratio_header = f"vs {baseline_name}"
    print(f"{'variant':20} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {ratio_header:>18}  spread")
    for name, record in results.items():
        median = statistics.median(record.seconds)
        rate = tokens / median
        mfu = rate * flops_per_token / peak.flops if peak.flops > 0 else 0.0
        spread = f"{min(record.seconds) * 1e3:.1f}–{max(record.seconds) * 1e3:.1f} ms"
        print(
            f"{name:20} {rate:10,.0f} {mfu:7.1%} {record.peak_bytes / 2**30:9.2f} "
            f"{baseline / median:18.3f}  {spread}"
        )
    for name, record in results.items():
        if name == "plait auto" and record.chosen:
            picks = ", ".join(f"{op.split('/')[0]} {p}" for op, p in record.chosen.items())
            print(f"plait auto chose: {picks}")


def _time_variant(
    setting: Setting,
    build: Callable[[], Variant],
    batches: list[torch.Tensor],
    *,
    warmup: int,
) -> tuple[float, int, dict[str, str]]:
    """Seconds per timed step, peak device memory and the providers that ran of one fresh
    variant; it is closed and freed before the next is built, so one variant is on the device
    at a time."""
    variant = build()
    try:
        for batch in batches[:warmup]:
            variant.step(batch)
        if setting.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _synchronize(setting.device)
        start = time.perf_counter()
        for batch in batches[warmup:]:
            variant.step(batch)
        _synchronize(setting.device)
        seconds = (time.perf_counter() - start) / (len(batches) - warmup)
        peak_bytes = torch.cuda.max_memory_allocated() if setting.device == "cuda" else 0
        chosen = variant.providers()
    finally:
        variant.close()
        del variant
        gc.collect()
        if setting.device == "cuda":
            torch.cuda.empty_cache()
    return seconds, peak_bytes, chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU")
    parser.add_argument(
        "--quick", action="store_true", help="one round of 4 steps after 2 of warm-up"
    )
    parser.add_argument("--json", type=Path, help="write the figures here after every variant")
    args = parser.parse_args(argv)
    if args.smoke:
        overrides = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}
        setting = Setting("tiny", 64, 2, "cpu", torch.bfloat16, overrides)
        run(setting, steps=2, warmup=1, rounds=1, json_path=args.json)
        return 0
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 4, 2
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures one GPU (try --smoke to check it runs)")
        return 0
    os.environ.setdefault("TRITON_INTERPRET", "0")
    setting = Setting(
        args.size, args.seq, args.batch, "cuda", torch.bfloat16, {"max_seq_len": args.seq}
    )
    run(setting, steps=args.steps, warmup=args.warmup, rounds=args.rounds, json_path=args.json)
    print("\nper-kernel figures: python tools/bench/kernels.py --dtype bfloat16")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: LoRA adapters vs the full fine-tune of the same `transformers` Llama, same run.

    python tools/bench/lora.py [--rounds 3] [--steps 5] [--warmup 2] [--dp-strategy zero3]
                               [--rank 8] [--dim 384] [--layers 6] [--vocab 4096]
                               [--seq-len 128] [--global-batch 8]

Both contenders train one `transformers` `LlamaForCausalLM` (built from a config, identically
initialised on every rank, nothing downloaded) through `plait.initialize` on Gloo ranks spawned
by this script, each run in fresh processes: the full fine-tune (every weight trained), and the
`lora` transform (`[peft]` r = `--rank`, alpha = 2r, on the attention projections: the base
frozen). They alternate in each round (the order reverses every round) so a burst of load on a
shared machine does not always hit the same one; the table shows the median over rounds.

Printed per contender: tokens/s and CPU seconds per step (all threads of a rank); the bytes of
optimizer state, summed over the ranks, against 8 per trained parameter (fp32 AdamW's two
moments); and, from one checkpoint each run writes at its end, the checkpoint's size on disk
against the trained parameters' bytes × 4 + 1 MB (the adapters, their two moments and what
describes them). Then the LoRA / full ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from plait.testing.distributed import run_distributed

CONTENDERS = ("full", "lora")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MIB = 1 << 20


def _model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.dim * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.dim // 64,
        num_key_value_heads=max(1, args.dim // 128),
        max_position_embeddings=args.seq_len,
    )
    return transformers.LlamaForCausalLM(config)


def _config(args: argparse.Namespace, contender: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "parallel": {"dp_strategy": args.dp_strategy, "transforms": {}},
        "train": {"micro_batch_size": args.global_batch // args.world_size, "seed": 0},
        "telemetry": {"enabled": False},
    }
    if contender == "lora":
        config["parallel"]["transforms"]["adapter"] = "lora"
        config["peft"] = {"r": args.rank, "alpha": 2 * args.rank, "target_modules": TARGETS}
    return config


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def run(
    rank: int, world: int, args: argparse.Namespace, contender: str, folder: str
) -> dict[str, Any]:
    import plait
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig

    engine = plait.initialize(
        _model(args),
        config=_config(args, contender),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0),
    )
    gen = torch.Generator().manual_seed(1)
    local = args.global_batch // world
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.global_batch, args.seq_len), generator=gen)
        mine = tokens[rank * local : (rank + 1) * local]
        batches.append({"input_ids": mine, "labels": mine})
    for batch in batches[: args.warmup]:
        engine.train_step(batch)
    torch.distributed.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches[args.warmup :]:
        engine.train_step(batch)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    optimizer_state = engine.memory_report()["optimizer_state"]
    saver = Checkpointer(engine, None, CheckpointIOConfig(dir=folder, async_save=False, keep=0))
    saver.save(args.warmup + args.steps)
    saver.close()
    engine.close()
    checkpoint = max(Path(folder).glob("step-*"))
    return {
        "tokens_per_second": args.steps * args.global_batch * args.seq_len / elapsed,
        "cpu_seconds_per_step": cpu / args.steps,
        "optimizer_state_bytes": optimizer_state,
        "checkpoint_bytes": _folder_bytes(checkpoint) if rank == 0 else 0,
    }


def _trained_whole(args: argparse.Namespace, contender: str) -> int:
    """Trained parameters of the whole model: every weight, or the adapters peft adds."""
    model = _model(args)
    if contender == "full":
        return sum(p.numel() for p in model.parameters())
    import peft

    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)
    with warnings.catch_warnings():  # peft asks a deprecated transformers property
        warnings.simplefilter("ignore", FutureWarning)
        adapted = peft.get_peft_model(model, config)
    return sum(p.numel() for p in adapted.parameters() if p.requires_grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dp-strategy", default="zero3")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()

    results: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="plait-bench-lora-") as tmp:
        for round_index in range(args.rounds):
            order = CONTENDERS if round_index % 2 == 0 else tuple(reversed(CONTENDERS))
            for contender in order:
                folder = Path(tmp) / f"{contender}-{round_index}"
                per_rank = run_distributed(
                    run, args.world_size, args, contender, str(folder), timeout=3600
                )
                results[contender].append(
                    {
                        "tokens_per_second": statistics.mean(
                            r["tokens_per_second"] for r in per_rank
                        ),
                        "cpu_seconds_per_step": statistics.mean(
                            r["cpu_seconds_per_step"] for r in per_rank
                        ),
                        "optimizer_state_bytes": sum(r["optimizer_state_bytes"] for r in per_rank),
                        "checkpoint_bytes": per_rank[0]["checkpoint_bytes"],
                    }
                )
    print(
        f"LoRA benchmark: transformers Llama dim={args.dim} layers={args.layers} "
        f"vocab={args.vocab} seq={args.seq_len} global batch={args.global_batch}, "
        f"{args.world_size} Gloo ranks, {args.dp_strategy}, LoRA r={args.rank} on {TARGETS}, "
        f"{args.warmup} warm-up + {args.steps} timed steps, median of {args.rounds} rounds"
    )
    summary = {}
    for contender, runs in results.items():
        trained = _trained_whole(args, contender)
        summary[contender] = {
            key: statistics.median(r[key] for r in runs)
            for key in ("tokens_per_second", "cpu_seconds_per_step")
        }
        state = runs[-1]["optimizer_state_bytes"]
        checkpoint = runs[-1]["checkpoint_bytes"]
        bound = trained * 4 * 4 + MIB
        print(
            f"  {contender:5s} {summary[contender]['tokens_per_second']:9.1f} tokens/s  "
            f"{summary[contender]['cpu_seconds_per_step']:.3f} CPU s/step  trained "
            f"{trained:,} parameters  optimizer state {state:,} B = "
            f"{state / trained:.3f} per trained parameter  checkpoint {checkpoint:,} B "
            f"(bound {bound:,} B: {'within' if checkpoint <= bound else 'OVER'})"
        )
    full, lora = summary["full"], summary["lora"]
    print(
        f"  lora / full: tokens/s {lora['tokens_per_second'] / full['tokens_per_second']:.3f}x, "
        f"CPU per step {lora['cpu_seconds_per_step'] / full['cpu_seconds_per_step']:.3f}x"
    )


if __name__ == "__main__":
    main()

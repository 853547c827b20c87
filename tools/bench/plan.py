"""Benchmark: the planner's predictions against measured runs, ≥ 10 layouts on 4 Gloo ranks.

    python tools/bench/plan.py [--rounds 2] [--steps 4] [--dim 256] [--layers 4]

One spawn of 4 Gloo ranks (one host) first calibrates what the planner needs to know about
this machine, all ranks at once so that they share the cores as they will in training:

* GEMM rate at several sizes → peak and efficiency curve (`devices.efficiency_from_gemm_rates`);
* the attention kernel's rate (SDPA forward + backward) and memory bandwidth (tensor copies);
* the fixed cost of a block's forward pass (the model's step at 1 and 4 sequences);
* Gloo collectives (all-reduce, all-gather, reduce-scatter, send/recv) at several sizes on
  groups of 2 and 4 → α and β of the link (`comm_model.fit_links`, the code
  `plait plan calibrate` runs on the daemon's spans).

Then it trains a tiny Llama under every layout of `LAYOUTS` (dp / ZeRO 1-3 / recomputation /
tp with and without sp / pp with 1F1B and interleaving / tp × pp), rounds alternating the
order, and measures per layout the step time (the slowest rank's; the fastest such step of
all rounds, since load from other processes only ever slows a step down; `--steps` timed steps
after `--warmup`)
and each rank's peak memory: what it holds between steps (parameters, gradients, optimizer
state from tensor storage, `Engine.memory_report`) plus the highest live total of the tensor
storages that aten ops create during one more step (`tools/bench/memory.py`'s
`LiveTensorMeter`; buffers a collective library allocates itself are not seen; ZeRO-3's gathered
units, resized in place, are added from its runtime's report). CPU seconds per
step are recorded too: on a shared machine they are disturbed much less than wall time. The
planner predicts step time and memory for the same job; the table prints them side by side with
the errors, the Spearman correlation of the two rankings and how far the predicted best is from
the measured best.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from plait.core.testing import run_distributed
from plait.planner.comm_model import CommSample, fit_links
from plait.planner.devices import DeviceSpec, Link, efficiency_from_gemm_rates
from plait.planner.layouts import PRECISIONS, Job, Layout
from plait.planner.memory_model import formula_saved_bytes
from plait.planner.search import price

WORLD = 4
LAYOUTS: dict[str, Layout] = {
    layout.describe(): layout
    for layout in (
        Layout(dp=4, micro_batch=4),
        Layout(dp=4, micro_batch=1),
        Layout(dp=4, zero=1, micro_batch=4),
        Layout(dp=4, zero=2, micro_batch=4),
        Layout(dp=4, zero=3, micro_batch=4),
        Layout(dp=4, micro_batch=4, recompute="full"),
        Layout(dp=4, micro_batch=2, recompute="selective"),
        Layout(dp=2, tp=2, micro_batch=4),
        Layout(dp=2, tp=2, micro_batch=8, sequence_parallel=True),
        Layout(dp=1, tp=4, micro_batch=8),
        Layout(dp=2, pp=2, micro_batch=2, schedule="1f1b"),
        Layout(dp=2, pp=2, micro_batch=2, schedule="interleaved_1f1b", virtual_stages=2),
        Layout(dp=1, pp=4, micro_batch=4, schedule="1f1b"),
        Layout(dp=1, tp=2, pp=2, micro_batch=4, schedule="1f1b"),
    )
}


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dim": args.dim,
        "n_layers": args.layers,
        "n_heads": 8,
        "n_kv_heads": 4,
        "vocab_size": 256,
        "multiple_of": 32,
        "max_seq_len": args.seq_len,
    }


def engine_config(args: argparse.Namespace, layout: Layout) -> dict[str, Any]:
    from plait.planner.auto import layout_config, merge_sections

    base = {
        "model": {"name": "llama", "size": "tiny", "overrides": model_overrides(args)},
        "data": {"seq_len": args.seq_len},
        "train": {"global_batch_size": args.global_batch, "seed": 0, "device": "cpu"},
        "optimizer": {"weight_decay": 0.0},
        "telemetry": {"enabled": False},
    }
    return merge_sections(base, layout_config(layout))


# ---------------------------------------------------------------------------------------------
# calibration (every rank at once)
# ---------------------------------------------------------------------------------------------


def _rate(fn: Any, flops: float, seconds: float) -> float:
    fn()
    count, start = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count * flops / elapsed


def calibrate_compute(args: argparse.Namespace) -> dict[str, Any]:
    torch.distributed.barrier()
    gemms = []
    for m, k, n in ((64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 256, 704),
                    (512, 512, 512), (1024, 256, 704)):  # fmt: skip
        a, b = torch.randn(m, k), torch.randn(k, n)
        flops = 2.0 * m * k * n
        gemms.append((flops, _rate(lambda a=a, b=b: torch.mm(a, b), flops, 0.25)))
    heads, head_dim = 8, args.dim // 8
    q = torch.randn(4, heads, args.seq_len, head_dim, requires_grad=True)
    k = torch.randn(4, heads, args.seq_len, head_dim, requires_grad=True)
    v = torch.randn(4, heads, args.seq_len, head_dim, requires_grad=True)

    def attention() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    # causal forward (2 matmuls of half the square) + backward (2.5× the forward)
    attention_flops = 3.5 * 2.0 * 4 * heads * args.seq_len**2 * head_dim
    attention_rate = _rate(attention, attention_flops, 0.5)
    big = torch.empty(8 * 2**20 // 4)
    other = torch.empty_like(big)
    bandwidth = _rate(lambda: other.copy_(big), 2.0 * big.numel() * 4, 0.3)
    return {"gemms": gemms, "attention_rate": attention_rate, "bandwidth": bandwidth}


def calibrate_comm() -> list[dict[str, Any]]:
    """Time Gloo collectives like the daemon's comm spans record them: one sample per op."""
    dist = torch.distributed
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    samples = []
    for nbytes in (4096, 65536, 2**20, 4 * 2**20):
        numel = nbytes // 4
        for group, size in ((None, WORLD), (pair, 2)):
            buffer = torch.randn(numel)
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                for _ in range(3):
                    dist.barrier()
                    start = time.perf_counter()
                    if op == "all_reduce":
                        dist.all_reduce(buffer, group=group)
                    elif op == "all_gather":
                        shard = buffer[: numel // size].clone()
                        out = [torch.empty_like(shard) for _ in range(size)]
                        dist.all_gather(out, shard, group=group)
                    else:
                        out_shard = torch.empty(numel // size)
                        dist.reduce_scatter(out_shard, list(buffer.chunk(size)), group=group)
                    samples.append({"op": op, "nbytes": nbytes, "group": size,
                                    "seconds": time.perf_counter() - start})  # fmt: skip
            peer = rank ^ 1
            for _ in range(3):
                dist.barrier()
                start = time.perf_counter()
                if rank % 2 == 0:
                    dist.send(buffer, peer)
                else:
                    dist.recv(buffer, peer)
                samples.append({"op": "send", "nbytes": nbytes, "group": 2,
                                "seconds": time.perf_counter() - start})  # fmt: skip
    return samples


# ---------------------------------------------------------------------------------------------
# measured runs
# ---------------------------------------------------------------------------------------------


def _local_batches(args: argparse.Namespace, dp: int, dp_rank: int, count: int) -> list[Any]:
    generator = torch.Generator().manual_seed(0)
    share = args.global_batch // dp
    out = []
    for _ in range(count):
        tokens = torch.randint(0, 256, (args.global_batch, args.seq_len + 1), generator=generator)
        mine = tokens[dp_rank * share : (dp_rank + 1) * share]
        out.append((mine[:, :-1], mine[:, 1:]))
    return out


def measure_layout(args: argparse.Namespace, layout: Layout) -> dict[str, float]:
    from plait.core.engine import Engine
    from plait.core.memory import optimizer_state_tensors
    from plait.tools.bench.memory import LiveTensorMeter

    engine = Engine(config=engine_config(args, layout))
    dp, dp_rank = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
    batches = _local_batches(args, dp, dp_rank, args.warmup + args.steps + 1)
    for batch in batches[: args.warmup]:
        engine.train_step(batch)
    times, cpu = [], []
    for batch in batches[args.warmup : args.warmup + args.steps]:
        torch.distributed.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        engine.train_step(batch)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    torch.distributed.barrier()
    report = engine.memory_report()
    held = report.get("resident_total", report["total"])
    # Storages held between steps are in `held`; the meter counts only what the step creates.
    params = list(engine.module.parameters())
    state = [*params, *(p.grad for p in params if p.grad is not None)]
    state += optimizer_state_tensors(engine.optimizer)
    gc.collect()
    with LiveTensorMeter(exclude=state) as meter:
        engine.train_step(batches[-1])
    # ZeRO-3 gathers units into storage it resizes in place, which the meter does not see as
    # new tensors: add the runtime's own peak of gathered parameters.
    gathered = engine.memory_report().get("peak_gathered_parameters", 0)
    engine.close()
    return {
        "step_times": times,
        "step_seconds": statistics.median(times),
        "cpu_seconds": statistics.median(cpu),
        "peak_bytes": float(held + meter.peak + gathered),
    }


def _local_model(args: argparse.Namespace) -> torch.nn.Module:
    from plait.core.kernels import Kernels
    from plait.core.plugins import Plugins
    from plait.plugins.models import resolve_model_config

    plugins = Plugins.create(autoload=False)
    config = resolve_model_config("llama", "tiny", model_overrides(args))
    model = plugins.model("llama").build(config, Kernels(plugins))
    model.init_weights(seed=0)
    return model


def block_overhead(args: argparse.Namespace) -> float:
    """Fixed seconds per block and forward pass: forward + backward of the whole model at 1
    and 4 sequences, every rank at once; `t(b) = F + b·V` gives the fixed part `F`, spread
    over (blocks + head) × (forward + 2 × backward)."""
    model = _local_model(args)
    seconds = {}
    for batch in (1, 4):
        tokens = torch.randint(0, 256, (batch, args.seq_len + 1))

        def step(tokens: torch.Tensor = tokens) -> None:
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), tokens[:, 1:].flatten()
            ).backward()

        step()
        torch.distributed.barrier()
        trials = []
        for _ in range(5):
            start = time.perf_counter()
            step()
            trials.append(time.perf_counter() - start)
        seconds[batch] = min(trials)
    fixed = max((4 * seconds[1] - seconds[4]) / 3, 0.0)
    return fixed / (3 * (args.layers + 1))


def saved_activation_bytes(args: argparse.Namespace, micro_batch: int = 1) -> float:
    """Bytes autograd keeps after one forward + loss of the model in one process (no ranks)."""
    from plait.tools.bench.memory import LiveTensorMeter

    model = _local_model(args)
    tokens = torch.randint(0, 256, (micro_batch, args.seq_len + 1))
    gc.collect()
    with LiveTensorMeter(exclude=list(model.parameters())) as meter:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        gc.collect()
        saved = meter.live - loss.untyped_storage().nbytes()
    return float(saved)


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    del world
    torch.manual_seed(rank)
    saved = saved_activation_bytes(args)
    compute = calibrate_compute(args)
    compute["block_overhead"] = block_overhead(args)
    comm = calibrate_comm()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    names = list(LAYOUTS)
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            runs[name].append(measure_layout(args, LAYOUTS[name]))
    return {"compute": compute, "comm": comm, "runs": runs, "saved_activation_bytes": saved}


# ---------------------------------------------------------------------------------------------
# prediction and comparison
# ---------------------------------------------------------------------------------------------


def cpu_device(per_rank: list[dict[str, Any]]) -> DeviceSpec:
    """The planner's device for one rank of this host, from the ranks' calibrations."""
    gemms: dict[float, list[float]] = {}
    for result in per_rank:
        for flops, rate in result["compute"]["gemms"]:
            gemms.setdefault(flops, []).append(rate)
    rates = [(flops, statistics.median(values)) for flops, values in sorted(gemms.items())]
    peak = max(rate for _, rate in rates)
    e_max, g_half = efficiency_from_gemm_rates(rates, peak)
    attention = statistics.median(r["compute"]["attention_rate"] for r in per_rank)
    bandwidth = statistics.median(r["compute"]["bandwidth"] for r in per_rank)
    samples = [
        CommSample(intra_node=True, **{**s, "nbytes": float(s["nbytes"])})
        for result in per_rank
        for s in result["comm"]
    ]
    fit = fit_links(samples, source="bench gloo").intra
    link = fit.link() if fit is not None else Link(alpha=1e-4, beta=1e9)
    return DeviceSpec(
        name="cpu (measured)",
        memory_bytes=float("inf"),
        peak_flops=peak,
        memory_bandwidth=bandwidth,
        gemm_efficiency=e_max,
        gemm_half_flops=g_half,
        attention_efficiency=attention / peak,
        intra_node=link,
        inter_node=link,
        usable_memory_fraction=1.0,
        block_overhead=statistics.median(r["compute"].get("block_overhead", 0.0) for r in per_rank),
        oversubscription=max(WORLD / (os.cpu_count() or WORLD), 1.0),
    )


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for position, index in enumerate(order):
            out[index] = float(position)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mean = (n - 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry, strict=True))
    var = sum((a - mean) ** 2 for a in rx)
    return cov / var


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--save", default="", help="write the ranks' raw measurements (JSON)")
    parser.add_argument("--load", default="", help="compare saved measurements, run nothing")
    args = parser.parse_args()

    started = time.perf_counter()
    if args.load:
        saved = json.loads(Path(args.load).read_text())
        per_rank = saved["ranks"]
        for key, value in saved["args"].items():
            if key not in ("load", "save"):
                setattr(args, key, value)
    else:
        per_rank = run_distributed(rank_main, WORLD, args, timeout=3000)
        if args.save:
            Path(args.save).write_text(json.dumps({"args": vars(args), "ranks": per_rank}))
    device = cpu_device(per_rank)

    from plait.planner.model_shape import shape_from_config
    from plait.plugins.models import resolve_model_config

    model = shape_from_config(
        "llama", resolve_model_config("llama", "tiny", model_overrides(args)), name="llama"
    )
    job = Job(
        model=model,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        world=WORLD,
        per_node=WORLD,
        device=device,
        precision=PRECISIONS["fp32"],
    )
    # One forward in one process calibrates the activation count for this implementation.
    saved = statistics.median(r.get("saved_activation_bytes", 0.0) for r in per_rank)
    if saved > 0:
        ratio = saved / formula_saved_bytes(job, micro_batch=1)
        job = dataclasses.replace(job, activation_ratio=ratio)
    rows = []
    for name, layout in LAYOUTS.items():
        runs = [r["runs"][name] for r in per_rank]  # per rank, per round
        rounds = len(runs[0])
        # A step lasts as long as its slowest rank; load from other processes only ever slows
        # a step down, so the fastest such step over all rounds is the least disturbed figure.
        step = min(
            max(times)
            for i in range(rounds)
            for times in zip(
                *(rank[i].get("step_times", [rank[i]["step_seconds"]]) for rank in runs),
                strict=True,
            )
        )
        memory = max(statistics.median(m["peak_bytes"] for m in rank) for rank in runs)
        predicted = price(job, layout)
        cpu = statistics.median(
            max(rank[i].get("cpu_seconds", 0.0) for rank in runs) for i in range(rounds)
        )
        rows.append((name, step, memory, predicted, cpu))

    print(
        f"planner vs measured: llama dim={args.dim} layers={args.layers} seq={args.seq_len} "
        f"global batch={args.global_batch}, {WORLD} Gloo ranks on one host, fp32, "
        f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} alternating rounds "
        f"({time.perf_counter() - started:.0f} s)"
    )
    print(
        f"calibrated: peak {device.peak_flops / 1e9:.1f} GFLOP/s/rank, GEMM e_max "
        f"{device.gemm_efficiency:.2f} g_half {device.gemm_half_flops:.2e}, attention "
        f"{device.attention_efficiency:.2f}, memory {device.memory_bandwidth / 1e9:.1f} GB/s, "
        f"link α {device.intra_node.alpha * 1e6:.0f} µs β {device.intra_node.beta / 1e9:.2f} GB/s"
        f", activations ×{job.activation_ratio:.2f} of the per-token formula, "
        f"{device.block_overhead * 1e3:.2f} ms fixed per block pass"
    )
    print(
        f"{'layout':44} {'step ms':>8} {'pred ms':>8} {'ratio':>6} {'peak MiB':>9} "
        f"{'pred MiB':>9} {'mem err':>8}"
    )
    for name, step, memory, predicted, _ in rows:
        predicted_memory = predicted.memory.total
        print(
            f"{name:44} {step * 1e3:8.1f} {predicted.time.total * 1e3:8.1f} "
            f"{predicted.time.total / step:6.2f} {memory / 2**20:9.2f} "
            f"{predicted_memory / 2**20:9.2f} {(predicted_memory / memory - 1) * 100:+7.1f}%"
        )
    measured = [r[1] for r in rows]
    predicted_times = [r[3].time.total for r in rows]
    memory_errors = [abs(r[3].memory.total / r[2] - 1) for r in rows]
    best_measured = min(measured)
    predicted_best = min(range(len(rows)), key=predicted_times.__getitem__)
    cpu_measured = [r[4] for r in rows]
    print(
        f"Spearman(predicted, measured step time) = {spearman(predicted_times, measured):.3f}; "
        f"against measured CPU seconds per step: {spearman(predicted_times, cpu_measured):.3f}"
    )
    print(
        f"memory error: max {max(memory_errors) * 100:.1f} %, mean "
        f"{statistics.mean(memory_errors) * 100:.1f} %"
    )
    print(
        f"predicted best: {rows[predicted_best][0]}, measured {measured[predicted_best] * 1e3:.1f} "
        f"ms = {measured[predicted_best] / best_measured:.3f}× the measured best "
        f"({rows[measured.index(best_measured)][0]}, {best_measured * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()

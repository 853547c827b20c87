"""Benchmark: the planner's predictions against measured runs, ≥ 10 layouts on 4 Gloo ranks.

    python tools/bench/plan.py [--rounds 2] [--steps 4] [--dim 256] [--layers 4]

One spawn of 4 Gloo ranks (one host) first calibrates what the planner needs to know about
this machine. The rates are measured by one rank at a time (the others wait in a barrier), as
a rank with a core to itself, and then scaled by how much slower the same GEMM runs on every
rank at once (the ranks share the host's cores in training: `DeviceSpec.oversubscription`):

* GEMM rate at several sizes → peak and efficiency curve (`devices.efficiency_from_gemm_rates`);
* the attention kernel's rate (SDPA forward + backward) and memory bandwidth (tensor copies);
* the fixed cost of a block's forward pass (the model's step at 1 and 4 sequences);
* the slow-down of a GEMM when all ranks run it at once (measured, not the ranks ÷ cores);
* the fixed host costs of the strategies (`DeviceSpec.microbatch_overhead`, `tp_block_overhead`,
  `zero3_unit_overhead`, `selective_block_overhead`): engine steps of one-sequence micro-batches
  under DDP with one and two micro-batches, ZeRO-3 and selective recomputation, and of one
  two-sequence micro-batch under tp 2, none of them a layout that is ranked; each overhead is what
  its measured difference to the DDP step leaves once the model's own difference is taken out;
* Gloo collectives (all-reduce, all-gather, reduce-scatter, send/recv) at several sizes on
  groups of 2 and 4 → α and β of the link and of each collective (`comm_model.fit_links`, the
  code `plait plan calibrate` runs on the daemon's spans), each ring collective timed after a
  GEMM on every rank, as training issues it;
* the bytes autograd keeps for the blocks after one forward, without tp and under tp 2 → how
  much more than the per-token formula the implementation keeps of the width-h tensors tp
  replicates and of those it shards (`memory_model.activation_ratios`).

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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from plait.planner.comm_model import CommSample, fit_links
from plait.planner.devices import DeviceSpec, Link, efficiency_from_gemm_rates
from plait.planner.layouts import PRECISIONS, Job, Layout
from plait.planner.memory_model import activation_ratios, formula_saved_bytes
from plait.planner.search import price
from plait.planner.time_model import estimate_step_time
from plait.testing.distributed import run_distributed

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


def _rate(fn: Any, flops: float, seconds: float, batch_seconds: float = 0.05) -> float:
    """The best rate over batches of `batch_seconds` for `seconds` in all: like the steps'
    fastest figure, the batch least slowed by other processes (each still spans several
    scheduler slices, so the cores' sharing among the ranks is in it)."""
    fn()
    best, end = 0.0, time.perf_counter() + seconds
    while True:
        count, start = 0, time.perf_counter()
        while True:
            fn()
            count += 1
            elapsed = time.perf_counter() - start
            if elapsed >= batch_seconds:
                break
        best = max(best, count * flops / elapsed)
        if time.perf_counter() >= end:
            return best


SHARING_GEMM = (512, 512, 512)


def _gemm_rate(m: int, k: int, n: int, seconds: float) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    return _rate(lambda: torch.mm(a, b), 2.0 * m * k * n, seconds)


def calibrate_compute(args: argparse.Namespace) -> dict[str, Any]:
    """Rates of this rank alone (call it while the other ranks wait)."""
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


COMM_SIZES = (65536, 2**20, 4 * 2**20)
COMM_ITERATIONS = 8


def calibrate_comm() -> list[dict[str, Any]]:
    """Time Gloo collectives as training issues them, one sample per op and rank.

    A ring collective follows a GEMM on every rank, so the ranks reach it as the sharing of the
    cores leaves them (timed right after a barrier it finds its peers already there and costs
    2–4× less than between a block's matmuls): its time is a loop of GEMM + op less the same
    loop of GEMMs alone. A send is timed as a ping-pong with nothing between: in a pipeline the
    schedule's simulator already prices the wait for the peer, the link only the transfer.
    The ops are the single-tensor ones plait's torch communicator issues.
    """
    from plait.plugins.torch_comm import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE

    dist = torch.distributed
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    left, right = torch.randn(*SHARING_GEMM[:2]), torch.randn(*SHARING_GEMM[1:])

    def loop(op: Callable[[], Any], *, work: bool = True) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(COMM_ITERATIONS):
            if work:
                torch.mm(left, right)
            op()
        dist.barrier()
        return (time.perf_counter() - start) / COMM_ITERATIONS

    base = min(loop(lambda: None) for _ in range(2))
    samples = []

    def record(op_name: str, nbytes: int, size: int, seconds: float) -> None:
        samples.append({"op": op_name, "nbytes": nbytes, "group": size, "seconds": seconds})

    for nbytes in COMM_SIZES:
        numel = nbytes // 4
        buffer = torch.randn(numel)
        for group, size in ((None, WORLD), (pair, 2)):
            shard = buffer[: numel // size].clone()
            ops = {
                "all_reduce": partial(dist.all_reduce, buffer, group=group),
                "all_gather": partial(ALL_GATHER_SINGLE, buffer, shard, group=group),
                "reduce_scatter": partial(REDUCE_SCATTER_SINGLE, shard, buffer, group=group),
            }
            for name, op in ops.items():
                record(name, nbytes, size, loop(op) - base)
        received = torch.empty_like(buffer)

        def ping_pong(sent: torch.Tensor = buffer, received: torch.Tensor = received) -> None:
            peer = rank ^ 1
            if rank % 2 == 0:
                dist.send(sent, peer)
                dist.recv(received, peer)
            else:
                dist.recv(received, peer)
                dist.send(sent, peer)

        record("send", nbytes, 2, loop(ping_pong, work=False) / 2)
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


def measure_layout(
    args: argparse.Namespace, layout: Layout, *, memory: bool = True
) -> dict[str, Any]:
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
    if not memory:
        engine.close()
        return {"step_times": times}
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
        trials = []
        for _ in range(7):
            start = time.perf_counter()
            step()
            trials.append(time.perf_counter() - start)
        seconds[batch] = min(trials)
    fixed = max((4 * seconds[1] - seconds[4]) / 3, 0.0)
    return fixed / (3 * (args.layers + 1))


def calibrate_alone_then_shared(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Each rank's rates alone, in turn, then the sharing GEMM on every rank at once."""
    compute: dict[str, Any] = {}
    for turn in range(WORLD):
        torch.distributed.barrier()
        if rank == turn:
            compute = calibrate_compute(args)
            compute["block_overhead"] = block_overhead(args)
            compute["sharing_alone"] = _gemm_rate(*SHARING_GEMM, 0.5)
    compute["sharing_together"] = _shared_gemm_rate(compute["sharing_alone"], 0.5)
    return compute


def _shared_gemm_rate(alone_rate: float, seconds: float) -> float:
    """The sharing GEMM's rate with every rank running the same count of it at once: the
    count's FLOPs over the time from a barrier to the last rank's end, a rank's average share
    of the cores. (A best-of-batches figure catches the moments a rank held more than its
    share, and put the slow-down of 4 ranks on 2 cores at 1.5.)"""
    m, k, n = SHARING_GEMM
    flops = 2.0 * m * k * n
    count = torch.tensor([max(int(alone_rate * seconds / flops), 1)])
    torch.distributed.broadcast(count, src=0)  # the same work on every rank
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(int(count)):
        torch.mm(a, b)
    torch.distributed.barrier()
    return int(count) * flops / (time.perf_counter() - start)


# Engine steps that calibrate the strategies' fixed host costs: one- or two-sequence
# micro-batches, a global batch of one or two micro-batches per replica (the ranked layouts run
# 16 sequences). tp's step has two sequences: its collectives' waits on peers sharing the cores
# grow with the work between them, and a one-sequence step is too short to show them.
CALIBRATION_LAYOUTS: dict[str, tuple[Layout, int]] = {  # name: (layout, global batch)
    "ddp": (Layout(dp=4, micro_batch=1), 4),
    "ddp_2mb": (Layout(dp=4, micro_batch=1), 8),
    "tp": (Layout(dp=2, tp=2, micro_batch=2), 4),
    "zero3": (Layout(dp=4, zero=3, micro_batch=1), 4),
    "selective": (Layout(dp=4, micro_batch=1, recompute="selective"), 4),
}


def calibrate_strategies(args: argparse.Namespace) -> dict[str, list[float]]:
    """Step times of `CALIBRATION_LAYOUTS`, every rank at once."""
    out = {}
    for name, (layout, global_batch) in CALIBRATION_LAYOUTS.items():
        small = argparse.Namespace(**{**vars(args), "global_batch": global_batch, "warmup": 1,
                                      "steps": max(args.steps, 8)})  # fmt: skip
        out[name] = measure_layout(small, layout, memory=False)["step_times"]
    return out


# tp shards some activations and replicates others: the saved bytes under it and without it
# calibrate each class (`memory_model.activation_ratios`); not a ranked layout.
MEMORY_TP_LAYOUT = Layout(dp=2, tp=2, micro_batch=2)


def saved_activation_bytes(args: argparse.Namespace, layout: Layout | None = None) -> float:
    """Bytes autograd keeps for the blocks after one forward of one micro-batch: of the model
    in one process, or of `layout`'s engine on every rank at once (tp shards the model). The
    logits are not counted: the loss's share is priced on its own."""
    from plait.core.engine import Engine
    from plait.tools.bench.memory import LiveTensorMeter

    engine = Engine(config=engine_config(args, layout)) if layout is not None else None
    model = engine.module if engine is not None else _local_model(args)
    micro_batch = layout.micro_batch if layout is not None else 1
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (micro_batch, args.seq_len), generator=generator)
    gc.collect()
    with LiveTensorMeter(exclude=list(model.parameters())) as meter:
        logits = model(tokens)
        gc.collect()
        saved = meter.live - logits.untyped_storage().nbytes()
    if engine is not None:
        engine.close()
    return float(saved)


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    del world
    torch.manual_seed(rank)
    saved = {
        "saved_activation_bytes": saved_activation_bytes(args),
        "saved_activation_bytes_tp": saved_activation_bytes(args, MEMORY_TP_LAYOUT),
    }
    compute = calibrate_alone_then_shared(rank, args)
    comm = calibrate_comm()
    compute["strategies"] = calibrate_strategies(args)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    names = list(LAYOUTS)
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            runs[name].append(measure_layout(args, LAYOUTS[name]))
    return {"compute": compute, "comm": comm, "runs": runs, **saved}


# ---------------------------------------------------------------------------------------------
# prediction and comparison
# ---------------------------------------------------------------------------------------------


def cpu_device(per_rank: list[dict[str, Any]]) -> DeviceSpec:
    """The planner's device for one rank of this host, from the ranks' calibrations."""
    gemms: dict[float, list[float]] = {}
    for result in per_rank:
        for flops, rate in result["compute"]["gemms"]:
            gemms.setdefault(flops, []).append(rate)
    # Rates of a rank alone, scaled to every rank busy at once by the measured slow-down
    # (older saved measurements were taken with every rank busy already: no scaling).
    if all("sharing_alone" in r["compute"] for r in per_rank):
        slowdown = max(
            statistics.median(
                r["compute"]["sharing_alone"] / r["compute"]["sharing_together"] for r in per_rank
            ),
            1.0,
        )
    else:
        slowdown = 1.0
    rates = [
        (flops, statistics.median(values) / slowdown) for flops, values in sorted(gemms.items())
    ]
    peak = max(rate for _, rate in rates)
    e_max, g_half = efficiency_from_gemm_rates(rates, peak)
    attention = statistics.median(r["compute"]["attention_rate"] for r in per_rank) / slowdown
    bandwidth = statistics.median(r["compute"]["bandwidth"] for r in per_rank) / slowdown
    block = statistics.median(r["compute"].get("block_overhead", 0.0) for r in per_rank)
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
        grads_reduce_by_all_reduce=True,  # Gloo
        block_overhead=block * slowdown,
        oversubscription=slowdown if slowdown > 1.0 else max(WORLD / (os.cpu_count() or 1), 1.0),
    )


# Each overhead, and the calibration step that differs from the one-micro-batch DDP step by it.
OVERHEADS = (
    ("microbatch_overhead", "ddp_2mb"),
    ("tp_block_overhead", "tp"),
    ("zero3_unit_overhead", "zero3"),
    ("selective_block_overhead", "selective"),
)


def _fastest_step(per_rank: list[dict[str, Any]], name: str) -> float:
    """A step lasts as long as its slowest rank; the fastest such step is the least disturbed."""
    times = [result["compute"]["strategies"][name] for result in per_rank]
    return min(max(step) for step in zip(*times, strict=True))


def _predicted_difference(job: Job, field: str, value: float, name: str) -> float:
    """Predicted step of calibration layout `name` minus the DDP one's, `field` set to `value`."""
    trial = dataclasses.replace(job, device=dataclasses.replace(job.device, **{field: value}))
    total = {}
    for key in ("ddp", name):
        layout, batch = CALIBRATION_LAYOUTS[key]
        total[key] = estimate_step_time(dataclasses.replace(trial, global_batch=batch), layout)
    return total[name].total - total["ddp"].total


def calibrate_overheads(job: Job, per_rank: list[dict[str, Any]]) -> Job:
    """`job` with the strategies' fixed host costs fitted to the calibration steps: the
    prediction is linear in each, so one evaluation at 0 and one at 1 s give the value that
    makes the predicted difference to the DDP step the measured one."""
    if not all("strategies" in result["compute"] for result in per_rank):
        return job
    measured_base = _fastest_step(per_rank, "ddp")
    for field, name in OVERHEADS:
        if not all(name in result["compute"]["strategies"] for result in per_rank):
            continue  # measured before this calibration existed
        at_zero = _predicted_difference(job, field, 0.0, name)
        slope = _predicted_difference(job, field, 1.0, name) - at_zero
        if slope <= 0:
            continue  # the model has no such term: nothing to fit
        residual = _fastest_step(per_rank, name) - measured_base - at_zero
        device = dataclasses.replace(job.device, **{field: max(residual / slope, 0.0)})
        job = dataclasses.replace(job, device=device)
    return job


def calibrate_activations(job: Job, per_rank: list[dict[str, Any]]) -> Job:
    """`job` with the activation ratios of this implementation: the blocks' saved bytes after
    one forward without tp and under `MEMORY_TP_LAYOUT` over what the formula says."""
    alone = statistics.median(r.get("saved_activation_bytes", 0.0) for r in per_rank)
    if alone <= 0:
        return job
    under_tp = statistics.median(r.get("saved_activation_bytes_tp", 0.0) for r in per_rank)
    ratios = None
    if under_tp > 0:
        measured = [(Layout(dp=1), alone), (MEMORY_TP_LAYOUT, under_tp)]
        ratios = activation_ratios(measured, job)
    if ratios is None:  # one ratio for both classes
        ratio = alone / formula_saved_bytes(job, Layout(dp=1)).total
        return dataclasses.replace(job, activation_ratio=ratio)
    hidden, sharded = ratios
    return dataclasses.replace(job, hidden_activation_ratio=hidden, activation_ratio=sharded)


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
    parser.add_argument("--terms", action="store_true", help="print every predicted term")
    args = parser.parse_args()

    started = time.perf_counter()
    if args.load:
        saved = json.loads(Path(args.load).read_text())
        per_rank = saved["ranks"]
        for key, value in saved["args"].items():
            if key not in ("load", "save", "terms"):
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
    job = calibrate_activations(job, per_rank)
    job = calibrate_overheads(job, per_rank)
    device = job.device
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

    per_op = ", ".join(
        f"{own.op} {own.alpha * 1e6:.0f} µs {own.beta / 1e9:.2f} GB/s"
        for own in device.intra_node.by_op
    )
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
        f"ranks sharing the cores: ×{device.oversubscription:.2f} slower, "
        f"link α {device.intra_node.alpha * 1e6:.0f} µs β {device.intra_node.beta / 1e9:.2f} GB/s"
        f" ({per_op}), "
        f"activations ×{job.hidden_ratio:.2f} (width h) / ×{job.activation_ratio:.2f} (tp-sharded)"
        " of the per-token formula, "
        f"{device.block_overhead * 1e3:.2f} ms fixed per block pass; host overheads: "
        f"{device.microbatch_overhead * 1e3:.2f} ms per micro-batch, "
        f"{device.tp_block_overhead * 1e3:.2f} ms per tp block pass, "
        f"{device.zero3_unit_overhead * 1e3:.2f} ms per ZeRO-3 unit and micro-batch, "
        f"{device.selective_block_overhead * 1e3:.2f} ms per selectively recomputed block"
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
    if args.terms:
        print("predicted terms, ms (measured: the step, the slowest rank's CPU seconds)")
        for name, step, _, predicted, cpu in rows:
            terms = " ".join(
                f"{term}={value * 1e3:.0f}"
                for term, value in predicted.time.terms().items()
                if value
            )
            print(f"  {name:44} step {step * 1e3:.0f} cpu {cpu * 1e3:.0f}: {terms}")
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

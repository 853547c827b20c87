"""Benchmark: plait against the peers in the same run, on plait's models and on a user's model.

    python tools/bench/peers.py [--models llama,gpt2,user] [--pairs ddp,zero3,pp,tp,ds1,ds2,ds3]
                                [--rounds 3] [--steps 8] [--dim 256] [--layers 4] [--vocab 2048]
                                [--ceiling] [--prefetch 1]

Every pair trains one model on 2 Gloo ranks spawned by this script, plait on one side and the
peer on the other, with the same hyper-parameters (AdamW lr 3e-3, betas (0.9, 0.95), eps 1e-8,
no weight decay, constant LR, global-norm clipping at 1.0 on both sides except `tp`, where
neither clips because torch's `clip_grad_norm_` cannot mix DTensor and plain parameters), the
same micro-batch and the same global batch:

| pair  | plait                 | peer                                            |
|-------|-----------------------|-------------------------------------------------|
| ddp   | `ddp`                 | torch `DistributedDataParallel` (bucket views)  |
| zero3 | `zero3`               | torch FSDP2 (`fully_shard` per block, then root)|
| pp    | pp=2, `1f1b`          | `torch.distributed.pipelining.Schedule1F1B`     |
| tp    | tp=2, `megatron`      | DTensor `parallelize_module` (llama only)       |
| dsN   | `zeroN` (N = 1, 2, 3) | DeepSpeed ZeRO-N on its CPU accelerator (Gloo)  |

The `ds*` pairs run when `deepspeed` is importable (`pip install plait[deepspeed]`); `pp` and
`tp` need plait's stage split and tensor-parallel plan, so they run on the built-in models only.

The models: the built-in `llama` and `gpt2` (plait kernels, name-keyed init), and `user`, a
GPT written below with plain torch modules, the way a user brings a model plait has never seen.

Every contender runs in fresh processes (so peak memory is its own) and each round runs plait
and its peer back to back, alternating which goes first, so a burst of load on the shared
machine hits both sides of a ratio. Per contender: tokens/s (global tokens over wall time),
CPU seconds per step (all threads of a rank: Gloo's work counts; a busy machine disturbs it much
less than wall time), peak RSS, and the RSS growth from just before the model is built to the
peak (what the training state and the step cost, without the imported libraries). Ratios are
plait/peer per round, printed as the median with the lowest and highest round.

`--ceiling` adds, for the data-parallel pairs (ddp, ds1, ds2), a third contender per round: the
same loop with no gradient all-reduce. Both sides are quoted as a fraction of it: how much of
the step synchronising still costs, i.e. how much any implementation could still win.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.testing.distributed import run_distributed

WORLD = 2
LR, BETAS, EPS, CLIP = 3e-3, (0.9, 0.95), 1e-8, 1.0
BUILTIN = ("llama", "gpt2")


# -- a model plait has never seen ------------------------------------------------------------


class UserBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class UserGPT(nn.Module):
    """A GPT as a user writes one: torch modules only, nothing from plait."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(UserBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# -- what one run is -------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One contender's run: the model, the pair and the side, and the shared shape."""

    model: str
    pair: str
    side: str  # "plait", "peer" or "ceiling" (no gradient sync; data-parallel pairs)
    dim: int
    layers: int
    vocab: int
    seq_len: int
    global_batch: int
    micro_batch: int
    steps: int
    warmup: int
    prefetch: int = 1  # plait zero3: units all-gathered ahead

    @property
    def clip(self) -> float:
        return 0.0 if self.pair == "tp" else CLIP

    @property
    def ranks_share_batch(self) -> bool:
        """Pipeline and tensor parallelism: both ranks see the whole batch (one replica)."""
        return self.pair in ("pp", "tp")

    @property
    def heads(self) -> int:
        return 8 if self.dim % 8 == 0 else 4


def _overrides(spec: Spec) -> dict[str, Any]:
    shape: dict[str, Any] = {
        "dim": spec.dim,
        "n_layers": spec.layers,
        "n_heads": spec.heads,
        "vocab_size": spec.vocab,
        "max_seq_len": spec.seq_len,
    }
    if spec.model == "llama":
        shape["n_kv_heads"] = spec.heads // 2
    return shape


def _build_model(spec: Spec) -> nn.Module:
    """The model both sides train, with identical initial weights on every rank."""
    torch.manual_seed(0)
    if spec.model == "user":
        return UserGPT(spec.vocab, spec.dim, spec.layers, spec.heads, spec.seq_len)
    from plait.core.kernels import Kernels
    from plait.core.plugins import Plugins

    plugins = Plugins.create(autoload=False)
    record = plugins.model(spec.model)
    assert record.make_config is not None
    with torch.device("meta"):
        model = record.build(record.make_config("tiny", _overrides(spec)), Kernels(plugins))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=0)  # type: ignore[operator]
    return model


def _batches(spec: Spec, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(spec.warmup + spec.steps):
        tokens = torch.randint(0, spec.vocab, (spec.global_batch, spec.seq_len + 1), generator=gen)
        if not spec.ranks_share_batch:
            local = spec.global_batch // WORLD
            tokens = tokens[rank * local : (rank + 1) * local]
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, foreach=True)


def _mean_loss(loss: torch.Tensor) -> float:
    """What plait's `train_step` returns: the loss averaged over the data-parallel ranks."""
    reported = loss.detach().float().clone()
    torch.distributed.all_reduce(reported)
    return float(reported) / WORLD


# -- plait -----------------------------------------------------------------------------------

PLAIT_PARALLEL: dict[str, dict[str, Any]] = {
    "ddp": {"dp_strategy": "ddp"},
    "zero3": {"dp_strategy": "zero3"},
    "ds1": {"dp_strategy": "zero1"},
    "ds2": {"dp_strategy": "zero2"},
    "ds3": {"dp_strategy": "zero3"},
    "pp": {"pp": WORLD},
    "tp": {"tp": WORLD, "dp": 1},
}


def _plait_step(spec: Spec) -> Callable[[Any], float]:
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins
    from plait.plugins import tensor_parallel, zero

    config: dict[str, Any] = {
        "data": {"seq_len": spec.seq_len},
        "train": {
            "global_batch_size": spec.global_batch,
            "micro_batch_size": spec.micro_batch,
            "max_grad_norm": spec.clip,
            "seed": 0,
        },
        "optimizer": {
            "lr": LR,
            "betas": list(BETAS),
            "eps": EPS,
            "weight_decay": 0.0,
            "warmup_steps": 0,
            "min_lr_ratio": 1.0,
        },
        "parallel": PLAIT_PARALLEL[spec.pair],
        "schedule": {"name": "1f1b"},
        "telemetry": {"enabled": False},
    }
    if PLAIT_PARALLEL[spec.pair].get("dp_strategy") == "zero3":
        config["zero"] = {"prefetch": spec.prefetch}
    model = None
    if spec.model in BUILTIN:
        config["model"] = {"name": spec.model, "size": "tiny", "overrides": _overrides(spec)}
    else:
        model = _build_model(spec)
    extra = [("zero", zero), ("tensor_parallel", tensor_parallel)]
    engine = Engine(config=config, model=model, plugins=Plugins.create(autoload=False, extra=extra))
    return engine.train_step


# -- the peers -------------------------------------------------------------------------------


def _chunks(spec: Spec, batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[Any, Any]]:
    inputs, targets = batch
    return list(zip(inputs.split(spec.micro_batch), targets.split(spec.micro_batch), strict=True))


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _torch_ddp(spec: Spec) -> Callable[[Any], float]:
    from torch.nn.parallel import DistributedDataParallel

    model = _build_model(spec)
    ddp = DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    optimizer = _adamw(model.parameters())

    def step(batch: Any) -> float:
        chunks = _chunks(spec, batch)
        total = torch.zeros(())
        for i, (x, y) in enumerate(chunks):
            with ddp.no_sync() if i < len(chunks) - 1 else _Nothing():
                loss = _ce(ddp(x), y) / len(chunks)
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return _mean_loss(total)

    return step


def _accumulating_step(spec: Spec, model: nn.Module) -> Callable[[Any], float]:
    """A step of `model` (whatever wraps it does the syncing): every micro-batch's backward,
    clipping, AdamW."""
    optimizer = _adamw(model.parameters())

    def step(batch: Any) -> float:
        chunks = _chunks(spec, batch)
        total = torch.zeros(())
        for x, y in chunks:
            loss = _ce(model(x), y) / len(chunks)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return _mean_loss(total)

    return step


def _no_gradient_sync(spec: Spec) -> Callable[[Any], float]:
    """The data-parallel ceiling: the same loop with no gradient all-reduce (each rank steps on
    its own gradients). No data-parallel implementation can beat it on these ranks; what the
    pair gets below it is what synchronising costs them."""
    return _accumulating_step(spec, _build_model(spec))


def _torch_fsdp2(spec: Spec) -> Callable[[Any], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.core.blocks import find_block_container

    model = _build_model(spec)
    mesh = init_device_mesh("cpu", (WORLD,))
    _, blocks = find_block_container(model)
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _accumulating_step(spec, model)


def _torch_pipelining(spec: Spec) -> Callable[[Any], float]:
    import torch.distributed as dist
    from torch.distributed import pipelining

    from plait.core.kernels import Kernels
    from plait.core.plugins import Plugins
    from plait.plugins.pipeline.split import build_chunk, plan_stages

    rank = dist.get_rank()
    plugins = Plugins.create(autoload=False)
    record = plugins.model(spec.model)
    assert record.make_config is not None
    with torch.device("meta"):
        full = record.build(record.make_config("tiny", _overrides(spec)), Kernels(plugins))
    # The stage plait builds for this rank: same cost-balanced split, same weights.
    plan = plan_stages(
        full, num_stages=WORLD, virtual_stages=1, balance="flops", seq_len=spec.seq_len
    )
    stage_module = build_chunk(full, plan.for_rank(rank)[0])
    stage_module.to_empty(device="cpu")
    with torch.no_grad():
        stage_module.init_weights(seed=0)  # type: ignore[operator]
    stage = pipelining.PipelineStage(stage_module, rank, WORLD, torch.device("cpu"))
    microbatches = spec.global_batch // spec.micro_batch
    runner = pipelining.Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=_ce)
    params = list(stage_module.parameters())
    optimizer = _adamw(params)

    def step(batch: Any) -> float:
        inputs, targets = batch
        losses: list[torch.Tensor] = []
        if rank == 0:
            runner.step(inputs)
        else:
            runner.step(target=targets, losses=losses)
        # The global norm over both stages: one all-reduce of the squared norms, as plait.
        squares = torch.stack(torch._foreach_norm([p.grad for p in params])).pow(2).sum()
        dist.all_reduce(squares)
        torch.nn.utils.clip_grads_with_norm_(params, spec.clip, squares.sqrt(), foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = torch.stack(losses).detach().mean() if losses else torch.zeros(())
        dist.all_reduce(mean)
        return float(mean)

    return step


def _torch_dtensor_tp(spec: Spec) -> Callable[[Any], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        loss_parallel,
        parallelize_module,
    )

    from plait.tools.bench.tp import dtensor_llama_plan

    model = _build_model(spec)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, dtensor_llama_plan(spec.layers))
    # foreach kernels cannot mix DTensor and plain tensors: one parameter group of each.
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    optimizer = _adamw([{"params": sharded}, {"params": plain}])

    def step(batch: Any) -> float:
        chunks = _chunks(spec, batch)
        total = torch.zeros(())
        for x, y in chunks:
            with loss_parallel():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(chunks)
                loss.backward()
            total += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total)  # every tp rank holds the whole loss

    return step


def _deepspeed(spec: Spec) -> Callable[[Any], float]:
    import deepspeed

    stage = int(spec.pair[-1])
    model = _build_model(spec)
    local = spec.global_batch // WORLD
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": local // spec.micro_batch,
        "gradient_clipping": spec.clip,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=_adamw(model.parameters()), config=config
    )

    def step(batch: Any) -> float:
        total = torch.zeros(())
        chunks = _chunks(spec, batch)
        for x, y in chunks:
            loss = _ce(engine(x), y)
            engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
            engine.step()  # an optimizer step only at the accumulation boundary
            total += loss.detach() / len(chunks)
        return _mean_loss(total)

    return step


PEERS: dict[str, tuple[str, Callable[[Spec], Callable[[Any], float]]]] = {
    "ddp": ("torch DDP", _torch_ddp),
    "zero3": ("torch FSDP2", _torch_fsdp2),
    "pp": ("torch pipelining 1F1B", _torch_pipelining),
    "tp": ("DTensor TP", _torch_dtensor_tp),
    "ds1": ("DeepSpeed ZeRO-1", _deepspeed),
    "ds2": ("DeepSpeed ZeRO-2", _deepspeed),
    "ds3": ("DeepSpeed ZeRO-3", _deepspeed),
}
DATA_PARALLEL_PAIRS = ("ddp", "ds1", "ds2")  # the ones whose only difference is the sync
PLAIT_NAMES = {
    "ddp": "plait ddp",
    "zero3": "plait zero3",
    "pp": "plait 1f1b",
    "tp": "plait megatron",
    "ds1": "plait zero1",
    "ds2": "plait zero2",
    "ds3": "plait zero3",
}


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- one contender on its ranks --------------------------------------------------------------


def run_contender(rank: int, world: int, spec: Spec) -> dict[str, float]:
    del world
    if spec.pair.startswith("ds"):
        import deepspeed  # noqa: F401  (its import is library footprint, not training state)
    baseline = _rss_mib()
    if spec.side == "plait":
        step = _plait_step(spec)
    elif spec.side == "ceiling":
        step = _no_gradient_sync(spec)
    else:
        step = PEERS[spec.pair][1](spec)
    batches = _batches(spec, rank)
    first_loss = step(batches[0])
    for batch in batches[1 : spec.warmup]:
        step(batch)
    torch.distributed.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches[spec.warmup :]:
        last_loss = step(batch)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "tokens_per_second": spec.steps * spec.global_batch * spec.seq_len / elapsed,
        "cpu_seconds_per_step": cpu / spec.steps,
        "peak_rss_mib": peak,
        "rss_growth_mib": peak - baseline,
        "first_loss": first_loss,
        "last_loss": last_loss,
    }


def _combine(per_rank: list[dict[str, float]]) -> dict[str, float]:
    return {
        "tokens_per_second": statistics.mean(r["tokens_per_second"] for r in per_rank),
        "cpu_seconds_per_step": statistics.mean(r["cpu_seconds_per_step"] for r in per_rank),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in per_rank),
        "rss_growth_mib": max(r["rss_growth_mib"] for r in per_rank),
        "first_loss": per_rank[-1]["first_loss"],
        "last_loss": per_rank[-1]["last_loss"],
    }


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}× ({min(values):.3f}–{max(values):.3f})"


def _deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,user", help="comma-separated: llama,gpt2,user")
    parser.add_argument(
        "--pairs", default="ddp,zero3,pp,tp,ds1,ds2,ds3", help="comma-separated: " + ",".join(PEERS)
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument(
        "--prefetch", type=int, default=1, help="plait zero3: units all-gathered ahead"
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="data-parallel pairs: also run the loop with no gradient sync in each round",
    )
    args = parser.parse_args()

    models = [m for m in args.models.split(",") if m]
    pairs = [p for p in args.pairs.split(",") if p]
    for name in models:
        if name not in (*BUILTIN, "user"):
            parser.error(f"--models: unknown model {name!r}; choose from llama, gpt2, user")
    for name in pairs:
        if name not in PEERS:
            parser.error(f"--pairs: unknown pair {name!r}; choose from {', '.join(PEERS)}")
    if args.global_batch % (WORLD * args.micro_batch):
        parser.error(
            f"--global-batch {args.global_batch} must be a multiple of {WORLD} ranks × "
            f"--micro-batch {args.micro_batch}"
        )
    has_deepspeed = _deepspeed_available()
    print(
        f"peers benchmark: dim={args.dim} layers={args.layers} vocab={args.vocab} "
        f"seq={args.seq_len} global batch={args.global_batch} micro={args.micro_batch}, "
        f"{WORLD} Gloo ranks, {args.warmup} warm-up + {args.steps} timed steps, "
        f"{args.rounds} alternating rounds; load {os.getloadavg()[0]:.2f}"
    )
    for model in models:
        for pair in pairs:
            peer_name = PEERS[pair][0]
            if pair.startswith("ds") and not has_deepspeed:
                print(f"{model:6} {pair:6} skipped: deepspeed is not installed")
                continue
            if pair in ("pp", "tp") and model not in BUILTIN:
                print(f"{model:6} {pair:6} skipped: plait's {pair} splits built-in models only")
                continue
            if pair == "tp" and model != "llama":
                print(f"{model:6} {pair:6} skipped: the DTensor plan here is llama's")
                continue
            _run_pair(args, model, pair, peer_name)


def _run_pair(args: argparse.Namespace, model: str, pair: str, peer_name: str) -> None:
    def spec(side: str) -> Spec:
        return Spec(
            model=model,
            pair=pair,
            side=side,
            dim=args.dim,
            layers=args.layers,
            vocab=args.vocab,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            steps=args.steps,
            warmup=args.warmup,
            prefetch=args.prefetch,
        )

    ceiling = args.ceiling and pair in DATA_PARALLEL_PAIRS
    runs: dict[str, list[dict[str, float]]] = {"plait": [], "peer": [], "ceiling": []}
    for round_index in range(args.rounds):
        order = ("plait", "peer") if round_index % 2 == 0 else ("peer", "plait")
        for side in (*order, "ceiling") if ceiling else order:
            per_rank = run_distributed(run_contender, WORLD, spec(side), timeout=1800)
            runs[side].append(_combine(per_rank))
    names = {"plait": PLAIT_NAMES[pair], "peer": peer_name, "ceiling": "no gradient sync"}
    print(f"\n{model} · {pair}: {names['plait']} vs {names['peer']}")
    print(
        f"  {'':22} {'tokens/s':>9} {'CPU s/step':>11} {'peak RSS MiB':>13} "
        f"{'RSS growth MiB':>15} {'loss 1st→last':>16}"
    )
    for side in ("plait", "peer", "ceiling") if ceiling else ("plait", "peer"):
        rows = runs[side]

        def med(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        print(
            f"  {names[side]:22} {med('tokens_per_second'):9,.0f} "
            f"{med('cpu_seconds_per_step'):11.3f} {med('peak_rss_mib'):13,.1f} "
            f"{med('rss_growth_mib'):15,.1f} "
            f"{rows[0]['first_loss']:7.4f}→{rows[0]['last_loss']:.4f}"
        )

    def ratios(key: str, over: str = "peer", side: str = "plait") -> list[float]:
        return [
            a[key] / b[key] if b[key] else math.nan
            for a, b in zip(runs[side], runs[over], strict=True)
        ]

    print(
        f"  plait/peer: tokens/s {_spread(ratios('tokens_per_second'))}, "
        f"CPU/step {_spread(ratios('cpu_seconds_per_step'))}, "
        f"RSS growth {_spread(ratios('rss_growth_mib'))}; load {os.getloadavg()[0]:.2f}"
    )
    if ceiling:
        print(
            f"  of the no-sync ceiling (tokens/s): plait "
            f"{_spread(ratios('tokens_per_second', 'ceiling'))}, peer "
            f"{_spread(ratios('tokens_per_second', 'ceiling', 'peer'))}"
        )


if __name__ == "__main__":
    main()

"""The stage split: cut a model into `pp × virtual_stages` chunks of balanced cost.

`plan_stages` plans a built-in model and `build_chunk` cuts it; `plan_blocks` plans any run of
blocks from their costs (other models' stages are built by `adapters`). Stages begin where the
cost balance below puts them, at `pipeline.layers_per_stage` counts, or at the blocks named by
`pipeline.split_points`.

The model is a sequence of *units* — the input embeddings, each transformer block, the output
head (final norm + vocabulary projection + loss) — and every chunk takes a contiguous run of
blocks; the embeddings go with the first chunk and the head with the last. A unit's cost is
computed from its parameter shapes, per token of training:

- `flops` (default): `6·N` for its matrix weights (forward 2, backward 4), the causal attention
  term of a block (`6·H·d_head·T`, as in `plait.core.flops`), `8·V` for the softmax
  cross-entropy over the vocabulary in the head, and `6·d` for an embedding lookup (the gather
  forward and the scatter-add of its gradient do no multiply, but they move `d` values);
- `params`: parameter count, which balances memory instead of time.

The partition minimises the most expensive chunk (the pipeline runs at the pace of its slowest
stage) and, among the partitions reaching that, the sum of squared chunk costs, so leftover
slack is spread instead of piled onto one stage. An uneven split is reported, never hidden:
`StagePlan.describe()` lists every chunk's layers and cost share, and every block lands in
exactly one chunk.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from plait.core.errors import ConfigError
from plait.core.flops import attention_flops_per_token
from plait.plugins.pipeline.topology import Layout

Balance = Literal["flops", "params"]
HEAD_MODULES: tuple[str, ...] = ("norm", "output")
# Softmax cross-entropy per vocabulary entry and token: max, subtract, exp, sum and log forward,
# softmax minus one-hot backward — a handful of elementwise FLOPs each.
CROSS_ENTROPY_FLOPS_PER_LOGIT = 8.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """One model chunk: global stage `stage`, held by pipeline rank `rank` as local `chunk`."""

    stage: int
    rank: int
    chunk: int
    layers: tuple[str, ...]  # keys of `model.layers`, in model order
    has_embeddings: bool
    has_head: bool
    cost: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """The whole split, identical on every rank."""

    chunks: tuple[Chunk, ...]  # in global stage order
    balance: Balance
    num_stages: int
    virtual_stages: int

    def for_rank(self, rank: int) -> list[Chunk]:
        """The chunks pipeline rank `rank` holds, by local chunk index."""
        return sorted((c for c in self.chunks if c.rank == rank), key=lambda c: c.chunk)

    @property
    def imbalance(self) -> float:
        """Slowest chunk over the mean chunk cost (1.0 is a perfect split)."""
        costs = [c.cost for c in self.chunks]
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0

    def describe(self) -> str:
        total = sum(c.cost for c in self.chunks) or 1.0
        lines = [
            f"pipeline split by {self.balance}: {len(self.chunks)} chunks over pp="
            f"{self.num_stages} × virtual={self.virtual_stages}, slowest chunk "
            f"{self.imbalance:.2f}× the mean"
        ]
        for c in self.chunks:
            parts = (
                (["embeddings"] if c.has_embeddings else [])
                + [f"layers {_span(c.layers)}"]
                + (["head"] if c.has_head else [])
            )
            lines.append(
                f"  stage {c.stage} (rank {c.rank}, chunk {c.chunk}): {', '.join(parts)} — "
                f"{c.cost / total:.1%} of the cost"
            )
        return "\n".join(lines)


def _span(layers: Sequence[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def is_builtin_layout(model: nn.Module) -> bool:
    """True for a model laid out like plait's built-ins, which `build_chunk` copies and cuts."""
    try:
        check_splittable(model)
    except ConfigError:
        return False
    return True


def check_splittable(model: nn.Module) -> None:
    """The pipeline split needs the built-in models' layout; say what is missing otherwise."""
    missing = [
        name
        for name in ("tok_embeddings", "layers", *HEAD_MODULES)
        if not isinstance(getattr(model, name, None), nn.Module)
    ]
    if missing or not isinstance(model.layers, nn.ModuleDict):
        raise ConfigError(
            f"the 'pipeline' strategy splits models laid out as tok_embeddings, layers "
            f"(nn.ModuleDict), norm, output — like plait's built-in llama and gpt2; "
            f"{type(model).__name__} lacks {missing or ['layers as an nn.ModuleDict']}"
        )


def embedding_modules(model: nn.Module) -> tuple[str, ...]:
    """The input-side modules the first chunk owns (token and, for GPT-2, position tables)."""
    names = getattr(model, "embedding_modules", ("tok_embeddings",))
    return tuple(n for n in names if isinstance(getattr(model, n, None), nn.Module))


def module_cost(module: nn.Module, balance: Balance) -> float:
    if balance == "params":
        return float(sum(p.numel() for p in module.parameters()))
    flops = 0.0
    for sub in module.modules():
        if isinstance(sub, nn.Embedding):
            flops += 6.0 * sub.embedding_dim
        else:
            # Matrix weights cost 6 FLOPs per element and token; norm gains and biases are
            # counted the same way, as `plait.core.flops` does (a rounding error either way).
            flops += 6.0 * sum(p.numel() for p in sub.parameters(recurse=False))
    return flops


def unit_costs(
    model: nn.Module, *, balance: Balance, seq_len: int
) -> tuple[float, list[float], float]:
    """(embeddings, per block in `model.layers` order, head) cost per training token."""
    embeddings = sum(module_cost(getattr(model, n), balance) for n in embedding_modules(model))
    config: Any = getattr(model, "config", None)
    blocks = []
    for block in model.layers.values():
        cost = module_cost(block, balance)
        if balance == "flops" and config is not None and hasattr(config, "n_heads"):
            head_dim = getattr(config, "head_dim", config.dim // config.n_heads)
            cost += attention_flops_per_token(
                n_layers=1, n_heads=config.n_heads, head_dim=head_dim, seq_len=seq_len
            )
        blocks.append(cost)
    head = sum(module_cost(getattr(model, n), balance) for n in HEAD_MODULES)
    if balance == "flops":
        output = model.output
        assert isinstance(output, nn.Linear)
        head += CROSS_ENTROPY_FLOPS_PER_LOGIT * output.out_features
    return embeddings, blocks, head


def partition(
    block_costs: Sequence[float], num_chunks: int, *, first_extra: float, last_extra: float
) -> list[int]:
    """Blocks per chunk (each >= 1) minimising the largest chunk cost, then the sum of squares.

    `first_extra` / `last_extra` are the embeddings and head costs the first / last chunk carry.
    """
    n = len(block_costs)
    prefix = [0.0]
    for cost in block_costs:
        prefix.append(prefix[-1] + cost)

    def chunk_cost(k: int, start: int, end: int) -> float:
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == num_chunks - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    # best[k][i]: (bottleneck, sum of squares, blocks in chunk k-1) of the best way to put the
    # first i blocks into k chunks. Two passes keep it exact: the bottleneck first, then the
    # squares among the partitions that reach it.
    def solve(limit: float) -> list[list[tuple[float, float, int]]]:
        inf = (math.inf, math.inf, 0)
        best = [[inf] * (n + 1) for _ in range(num_chunks + 1)]
        best[0][0] = (0.0, 0.0, 0)
        for k in range(1, num_chunks + 1):
            for i in range(k, n - (num_chunks - k) + 1):
                for start in range(k - 1, i):
                    bottleneck, squares, _ = best[k - 1][start]
                    if bottleneck == math.inf:
                        continue
                    cost = chunk_cost(k - 1, start, i)
                    if cost > limit:
                        continue
                    candidate = (max(bottleneck, cost), squares + cost * cost, i - start)
                    if candidate[:2] < best[k][i][:2]:
                        best[k][i] = candidate
        return best

    bottleneck = solve(math.inf)[num_chunks][n][0]
    # A relative tolerance keeps the second pass from rejecting the optimum over rounding.
    best = solve(bottleneck * (1 + 1e-12))
    sizes, i = [], n
    for k in range(num_chunks, 0, -1):
        size = best[k][i][2]
        sizes.append(size)
        i -= size
    return sizes[::-1]


def plan_stages(
    model: nn.Module,
    *,
    num_stages: int,
    virtual_stages: int,
    balance: Balance,
    seq_len: int,
    layers_per_stage: Sequence[int] = (),
    split_points: Sequence[str] = (),
) -> StagePlan:
    """Split a built-in `model` (on any device, meta included) into `num_stages ×
    virtual_stages` chunks."""
    check_splittable(model)
    layer_names = list(model.layers.keys())
    embeddings, blocks, head = unit_costs(model, balance=balance, seq_len=seq_len)
    return plan_blocks(
        layer_names,
        qualified=[f"layers.{name}" for name in layer_names],
        embeddings=embeddings,
        blocks=blocks,
        head=head,
        num_stages=num_stages,
        virtual_stages=virtual_stages,
        balance=balance,
        layers_per_stage=layer_sizes_or_split(layers_per_stage, split_points),
    )


def layer_sizes_or_split(
    layers_per_stage: Sequence[int], split_points: Sequence[str]
) -> Sequence[int] | SplitPoints:
    if layers_per_stage and split_points:
        raise ConfigError(
            "pipeline.layers_per_stage and pipeline.split_points both choose where stages "
            "begin: give one of them"
        )
    return SplitPoints(tuple(split_points)) if split_points else layers_per_stage


@dataclass(frozen=True, slots=True)
class SplitPoints:
    """Module names at which a stage begins (`pipeline.split_points`)."""

    names: tuple[str, ...]

    def sizes(self, qualified: Sequence[str], num_chunks: int) -> list[int]:
        """Blocks per chunk when a chunk begins at each named block."""
        index = {name: i for i, name in enumerate(qualified)}
        unknown = [n for n in self.names if n not in index]
        if unknown:
            shown = ", ".join(qualified[:3]) + (", …" if len(qualified) > 3 else "")
            raise ConfigError(
                f"pipeline.split_points = {list(self.names)}: {unknown} name no block of the "
                f"model; a split point is the name of the block a stage begins with ({shown})"
            )
        starts = [index[n] for n in self.names]
        if len(starts) != num_chunks - 1 or starts != sorted(set(starts)) or 0 in starts:
            raise ConfigError(
                f"pipeline.split_points = {list(self.names)} must name {num_chunks - 1} "
                f"distinct blocks in model order, not the first one (pp × virtual_stages = "
                f"{num_chunks} chunks)"
            )
        bounds = [0, *starts, len(qualified)]
        return [end - start for start, end in itertools.pairwise(bounds)]


def plan_blocks(
    names: Sequence[str],
    *,
    qualified: Sequence[str],
    embeddings: float,
    blocks: Sequence[float],
    head: float,
    num_stages: int,
    virtual_stages: int,
    balance: Balance,
    layers_per_stage: Sequence[int] | SplitPoints = (),
) -> StagePlan:
    """Split a run of blocks (`names`, full module names `qualified`, per-block `blocks` costs)
    into chunks; the first chunk also carries `embeddings`, the last `head`."""
    num_chunks = num_stages * virtual_stages
    if len(names) < num_chunks:
        raise ConfigError(
            f"pipeline: the model has {len(names)} transformer blocks but pp="
            f"{num_stages} × virtual_stages={virtual_stages} needs {num_chunks} chunks of at "
            "least one block each; lower parallel.pp or schedule.virtual_stages, or use a model "
            "with more layers"
        )
    if isinstance(layers_per_stage, SplitPoints):
        sizes = layers_per_stage.sizes(qualified, num_chunks)
    elif layers_per_stage:
        sizes = list(layers_per_stage)
        if len(sizes) != num_chunks or sum(sizes) != len(names) or min(sizes) < 1:
            raise ConfigError(
                f"pipeline.layers_per_stage = {sizes} must give {num_chunks} positive counts "
                f"(pp × virtual_stages) summing to the model's {len(names)} layers"
            )
    else:
        sizes = partition(blocks, num_chunks, first_extra=embeddings, last_extra=head)
    layout = Layout(num_stages, virtual_stages)
    chunks, start = [], 0
    for stage, size in enumerate(sizes):
        end = start + size
        cost = sum(blocks[start:end])
        cost += embeddings if stage == 0 else 0.0
        cost += head if stage == num_chunks - 1 else 0.0
        chunks.append(
            Chunk(
                stage=stage,
                rank=layout.rank_of(stage),
                chunk=layout.chunk_of(stage),
                layers=tuple(names[start:end]),
                has_embeddings=stage == 0,
                has_head=stage == num_chunks - 1,
                cost=cost,
            )
        )
        start = end
    assert start == len(names), "every block must land in exactly one chunk"
    return StagePlan(
        chunks=tuple(chunks),
        balance=balance,
        num_stages=num_stages,
        virtual_stages=virtual_stages,
    )


def build_chunk(model: nn.Module, chunk: Chunk) -> nn.Module:
    """A copy of `model` holding only `chunk`'s modules; parameter names stay the full model's.

    Meant for the meta device, where the copy costs nothing; the engine materialises it by name.
    """
    stage_model = copy.deepcopy(model)
    keep = set(chunk.layers)
    for name in list(stage_model.layers.keys()):
        if name not in keep:
            del stage_model.layers[name]
    if not chunk.has_embeddings:
        for name in embedding_modules(stage_model):
            setattr(stage_model, name, None)
    if not chunk.has_head:
        for name in HEAD_MODULES:
            setattr(stage_model, name, None)
    return stage_model


class PipelineChunks(nn.Module):
    """The chunks one rank holds with virtual stages: `parameters()` covers all of them, so the
    optimizer and data parallelism see one module; `init_weights` initialises each by its full
    model names."""

    def __init__(self, chunks: Sequence[nn.Module], stages: Sequence[int]) -> None:
        super().__init__()
        self.chunks = nn.ModuleDict({f"stage{s}": m for s, m in zip(stages, chunks, strict=True)})
        first = chunks[0]
        # Tensor parallelism reads the plan by module name: the same patterns under each chunk.
        plan = getattr(first, "tp_plan", {})
        self.tp_plan = {f"chunks.*.{k}": v for k, v in plan.items()}
        param_plan = getattr(first, "tp_param_plan", {})
        self.tp_param_plan = {f"chunks.*.{k}": v for k, v in param_plan.items()}

    def local_chunks(self) -> Iterator[nn.Module]:
        return iter(self.chunks.values())

    def init_weights(self, *, seed: int) -> None:
        for chunk in self.chunks.values():
            chunk.init_weights(seed=seed)  # type: ignore[operator]

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(
            "a pipeline rank with virtual stages runs its chunks one at a time through the "
            "pipeline runtime's schedule actions, not as one module"
        )

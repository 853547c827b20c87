"""Context parallelism (axis `cp`): every sequence is split over the cp ranks of a replica.

Strategies, selected by `parallel.cp_strategy`:

- `ring` — ring attention: K/V blocks pass around the cp group by send/recv, the next block's
  transfer overlapping the current block's compute, blocks merged by log-sum-exp; sequences
  are cut load-balanced (2·cp chunks, rank i holds i and 2·cp − 1 − i) so causal attention
  costs every rank the same (`ring.py`);
- `ulysses` — DeepSpeed-Ulysses: all-to-all from sequence shards to head shards around
  attention; the degree must divide the query heads each rank holds (`ulysses.py`);
- `hybrid` — both at once (USP): Ulysses inside groups of `[cp] ulysses_degree` consecutive cp
  ranks, ring across them.

`[cp]` section (shared by the three)::

    [cp]
    ulysses_degree = 2      # hybrid only; default: the largest divisor of cp below cp that
                            # divides the query heads per rank
    load_balance = true     # false: one contiguous chunk per ring position (for comparison)

What the strategy does: writes `context.context_parallel` (`plait.core.transforms.
ContextParallelism`, the sequence layout) and adds its cut to `context.microbatch_cuts`, by
which the engine hands every rank its positions of each batch (tokens and targets alike);
installs the attention above as each attention
module's `attend` and a pre-hook passing the rank's global positions to the model's forward
(RoPE, learned positions). A `transformers` model takes part through its own attention
interface instead (`hf_attention`): the attention above becomes its `attn_implementation`,
and each micro-batch gets its position ids and its labels shifted over the whole sequence
before it is cut (`hf_batches`). Under `transforms.compile` the attention call, either way,
runs eagerly between a block's compiled pieces (a graph break there, `attention.
eager_under_compile`), so the compiler never traces the communicator.

Packed rows (several documents per row, `plait.core.documents`): the `Documents` of each
micro-batch are computed on the whole rows before the cut (by the engine for plait's models, by
`hf_batches` for a `transformers` model, whose attention function receives them as a keyword
argument) and every strategy masks with them: the ring gives each block the ids of its query and
key chunks and skips blocks that share no document, Ulysses attends with the ids of the portion
it gathered (`ring.py` says why the zig-zag layout stays, with measured balance).

The loss is the core's token-weighted mean over the whole global batch (`plait.core.
token_loss`): each rank's loss is the mean over its own scored tokens, weighed by their count,
so averaging gradients over dp × cp (`Mesh.gradient_group`, which DDP and ZeRO use) gives the
mean over every scored token however unevenly padding and packing spread them. cp holds no
parameter shards: every parameter is replicated over cp in the state layout, so checkpoints
move between cp degrees freely.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from pydantic import Field
from torch import nn

from plait.core.config import Section
from plait.core.errors import ConfigError
from plait.core.sharding import ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.core.transformers_models import is_transformers_model, model_kind
from plait.core.transforms import ContextParallelism
from plait.plugins.context_parallel.attention import ContextParallelAttention
from plait.plugins.context_parallel.hf_attention import install_transformers_attention
from plait.plugins.context_parallel.hf_batches import prepare_causal_lm_batch
from plait.plugins.context_parallel.model_hooks import install
from plait.plugins.context_parallel.ring import AttentionWork, Ring
from plait.plugins.context_parallel.ulysses import HeadExchange, check_heads

__all__ = [
    "AttentionWork",
    "ContextParallelAttention",
    "ContextParallelConfig",
    "plait_register_strategies",
    "plait_shard",
]

SECTION = "cp"
DESCRIPTIONS = {
    "ring": "ring attention, load-balanced causal chunks, K/V blocks overlapped with compute",
    "ulysses": "DeepSpeed-Ulysses: all-to-all from sequence shards to head shards",
    "hybrid": "Ulysses inside groups of [cp] ulysses_degree ranks, ring across them",
}


class ContextParallelConfig(Section):
    """`[cp]` section."""

    ulysses_degree: int | None = Field(
        None,
        gt=0,
        description="hybrid: ranks of each Ulysses all-to-all (the ring has cp / this many "
        "positions); None = the largest divisor of cp below cp that divides the heads",
    )
    load_balance: bool = Field(
        True,
        description="cut sequences into 2·ring chunks (position i holds i and 2·ring−1−i) so "
        "causal attention costs every rank the same; false: one contiguous chunk each",
    )


def _head_counts(model: nn.Module, context: ShardContext) -> tuple[int, int] | None:
    """(query heads, key/value heads) each rank holds, when the model's config says (a
    built-in model's, or a `transformers` model's `num_attention_heads`)."""
    config = context.model_config
    heads = getattr(config, "n_heads", None)
    kv_heads = getattr(config, "kv_heads", None) or getattr(config, "n_kv_heads", None)
    transformers_model = _transformers_model(model, context)
    if config is None and transformers_model is not None:
        config = transformers_model.config
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None)
    if not isinstance(heads, int):
        return None
    kv_heads = kv_heads or heads
    tp = context.tensor_parallel.degree if context.tensor_parallel is not None else 1
    return heads // tp, max(1, kv_heads // tp)


def _ulysses_degree(
    strategy: str, degree: int, config: ContextParallelConfig, heads: int | None
) -> int:
    if strategy == "ring":
        return 1
    if strategy == "ulysses":
        return degree
    if config.ulysses_degree is not None:
        if degree % config.ulysses_degree:
            raise ConfigError(
                f"cp.ulysses_degree = {config.ulysses_degree} does not divide parallel.cp = "
                f"{degree}; hybrid context parallelism is ulysses_degree × ring positions"
            )
        return config.ulysses_degree
    for candidate in range(degree - 1, 1, -1):
        if degree % candidate == 0 and (heads is None or heads % candidate == 0):
            return candidate
    raise ConfigError(
        f"hybrid context parallelism with cp = {degree} finds no Ulysses degree between 2 and "
        f"{degree - 1} that divides cp and the heads per rank ({heads}); set [cp] "
        "ulysses_degree, or use parallel.cp_strategy = 'ring'"
    )


def apply_context_parallel(
    model: nn.Module, *, context: ShardContext, config: ContextParallelConfig, strategy: str
) -> Sharded:
    mesh = context.mesh
    degree = mesh.size("cp")
    heads = _head_counts(model, context)
    ulysses = _ulysses_degree(strategy, degree, config, heads[0] if heads else None)
    ring_degree = degree // ulysses
    if ulysses > 1 and heads is not None:
        check_heads(*heads, ulysses, where=f"parallel.cp = {degree} with cp_strategy {strategy!r}")
    layout = ContextParallelism(
        degree=degree,
        rank=mesh.coordinate("cp"),
        strategy=strategy,
        ring_degree=ring_degree,
        ulysses_degree=ulysses,
        load_balanced=config.load_balance,
    )
    _check_sequence(layout, context)
    if ulysses == 1:
        ring_group, exchange_group = mesh.group("cp"), None
    elif ring_degree == 1:
        ring_group, exchange_group = None, mesh.group("cp")
    else:
        exchange_group, ring_group = mesh.split_group("cp", ulysses)
    ring = None
    if ring_group is not None:
        position = ring_group.rank_of(mesh.rank)
        assert position == layout.ring_rank, (position, layout.ring_rank)
        ring = Ring(
            comm=context.comm,
            group=ring_group,
            kernels=context.kernels,
            chunks_of=layout.ring_chunks,
            position=position,
        )
    exchange = (
        HeadExchange(comm=context.comm, group=exchange_group)
        if exchange_group is not None
        else None
    )
    attend = ContextParallelAttention(
        kernels=context.kernels, ring=ring, exchange=exchange, layout=layout
    )
    transformers_model = _transformers_model(model, context)
    if transformers_model is not None:
        install_transformers_attention(transformers_model, attend, layout)
        # Pipeline stages call the blocks themselves and hand them no extra keyword argument:
        # the documents of packed rows would not reach attention.
        documents_reach_attention = context.pipeline is None
        layout = replace(
            layout,
            prepare=_transformers_batches(transformers_model, degree, documents_reach_attention),
        )
    else:
        install(model, attend, layout)
    context.context_parallel = layout
    context.microbatch_cuts.append(layout.shard_microbatch)
    return Sharded(module=model)


def _transformers_model(model: nn.Module, context: ShardContext) -> nn.Module | None:
    """The `transformers` model being trained: `model` itself, or the model a pipeline split
    cut `model`'s stages from."""
    if is_transformers_model(model):
        return model
    source = context.pipeline.source_model if context.pipeline is not None else None
    return source if source is not None and is_transformers_model(source) else None


def _transformers_batches(model: nn.Module, degree: int, documents_reach_attention: bool) -> Any:
    """`ContextParallelism.prepare` for a `transformers` model (see `hf_batches`)."""
    loss = getattr(model, "loss_function", None)
    transformers_loss = getattr(loss, "__name__", "") == "ForCausalLMLoss"
    return partial(
        prepare_causal_lm_batch,
        degree=degree,
        model_name=model_kind(model),
        loss_reads_shift_labels=transformers_loss,
        documents_reach_attention=documents_reach_attention,
    )


def _check_sequence(layout: ContextParallelism, context: ShardContext) -> None:
    """A built-in model trains on `data.seq_len`-token sequences: check them now. Users'
    batches are checked when they arrive (`ContextParallelism.shard_batch`)."""
    if context.model_record is None:
        return
    seq_len = context.config.data.seq_len
    try:
        layout.check_length(seq_len)
    except ValueError as exc:
        raise ConfigError(f"data.seq_len: {exc}") from None
    max_len = getattr(context.model_config, "max_seq_len", None)
    if isinstance(max_len, int) and seq_len > max_len:
        raise ConfigError(
            f"data.seq_len = {seq_len} exceeds the model's max_seq_len {max_len}: context "
            "parallelism gives ranks positions up to the whole sequence's length"
        )


strategies = Strategies()

for _name, _description in DESCRIPTIONS.items():
    strategies.provide(
        name=_name,
        axis="cp",
        config_cls=ContextParallelConfig,
        config_section=SECTION,
        description=_description,
    )(partial(apply_context_parallel, strategy=_name))

plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard


def attention_work(model: nn.Module) -> AttentionWork | None:
    """The forward attention FLOPs counter of a context-parallel model's ring, if any."""
    for module in model.modules():
        attend: Any = module.__dict__.get("attend")
        if isinstance(attend, ContextParallelAttention) and attend.ring is not None:
            return attend.ring.work
    return None

"""Applying a tensor-parallel plan: module-name patterns → parallel layers, in place.

A plan maps module-name patterns to a style, the convention of Hugging Face's `tp_plan`
(`"layers.*.attention.wq": "colwise"`, where `*` stands for one dotted name component):

- `colwise`: an `nn.Linear` split by output features (`ColumnParallelLinear`);
- `colwise_gather`: the same, with the ranks' outputs gathered (a head whose loss the model
  computes itself from full logits, as `transformers` models do);
- `colwise_qkv`: a fused q | k | v projection (GPT-2's `c_attn`), each third split by whole
  heads; the attention's head counts and split size become this rank's;
- `rowwise`: an `nn.Linear` split by input features (`RowParallelLinear`);
- `vocab`: an `nn.Embedding` split by vocabulary rows (`VocabParallelEmbedding`);
- `positions`: a replicated position-embedding table looked up with positions `0..s−1` of the
  local sequence; under sequence parallelism its indices are offset to this rank's shard;
- `none`: remove an entry inherited from the model's own plan.

Linears are `nn.Linear` or `transformers`' `Conv1D` (GPT-2), whose shards keep its in × out
layout. Parameters shared by two planned modules (a head tied to the token embedding) stay
shared: both are split by vocabulary rows, so the head reuses the embedding's shard.

Built-in models declare `tp_plan` (and `tp_param_plan` for loose parameters that follow a
column-parallel output, such as GPT-2's `w1_bias`); a `transformers` model's own plan is
translated (`hf_plan`); `[tp] plan` / `[tp] param_plan` add or override entries. Structure
is inferred from the result, Megatron's way: a module whose direct children include column- and
row-parallel linears (an attention or MLP block) is a *parallel region* — its input goes through
f (or the sequence all-gather) once, on entry, for all its column-parallel children. Attention
modules exposing `head_dim` with `wq`/`wk`/`wv` (built-in) or `q_proj`/`k_proj`/`v_proj`
(`transformers`) children are split by whole heads, with grouped-query KV heads split when the
TP degree divides them and replicated otherwise.

Under sequence parallelism the built-in models enter sequence shards at the vocab-parallel
embedding (reduce-scatter). A `transformers` model derives its positions and causal mask from
the embeddings' length and may reshape by it after its blocks, so there the sequence is split
at the entry of the first block and gathered again at the exit of the last: the embeddings,
the final norm and the head run on the whole sequence (their gradients are whole, not summed
over tp).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.core.blocks import find_block_container
from plait.core.errors import ConfigError, MeshError
from plait.core.grad_norm import sharded_axes
from plait.plugins.tensor_parallel.hf_plan import (
    declared_hf_plan,
    hf_head_counts,
    is_hf_model,
    translate_hf_plan,
    undeclared_hf_plan,
)
from plait.plugins.tensor_parallel.layers import (
    SEQUENCE_DIM,
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_slice,
    features,
    gather_sequence_shard,
    output_dim,
    shard_parameter,
)
from plait.plugins.tensor_parallel.tp_communications import (
    TensorParallelGroup,
    copy_to_tensor_region,
    eager_under_compile,
    gather_from_tensor_region,
    scatter_to_sequence_region,
)

STYLES = ("colwise", "colwise_gather", "colwise_qkv", "rowwise", "vocab", "positions", "none")
LINEAR_STYLES = ("colwise", "colwise_gather", "colwise_qkv", "rowwise")
# q, k and v: the blocks of a fused projection's output features.
QKV_PARTS = 3
# Built-in position tables (GPT-2) that sequence parallelism must offset.
DEFAULT_POSITION_MODULES = ("pos_embeddings",)


@dataclass(kw_only=True)
class TensorParallelLayout:
    """What applying a plan did, for the runtime and for reports."""

    styles: dict[str, str] = field(default_factory=dict)  # module name -> style applied
    regions: list[str] = field(default_factory=list)
    # Replicated parameters whose gradients are partial per rank and are summed over tp.
    tp_reduced_params: list[nn.Parameter] = field(default_factory=list)
    vocab_parallel_output: bool = False
    replicated_kv_heads: bool = False


def resolve_plan(
    model: nn.Module, overrides: Mapping[str, str], *, attribute: str = "tp_plan"
) -> dict[str, str]:
    """The model's declared plan with `overrides` applied; `none` entries are dropped."""
    if is_hf_model(model):
        # `transformers` models expose their own `tp_plan`, in transformers' style names; for
        # families that declare none plait has its own.
        hf_plan = declared_hf_plan(model) if attribute == "tp_plan" else None
        if hf_plan is None and attribute == "tp_plan":
            declared = undeclared_hf_plan(model) or {}
        else:
            declared = translate_hf_plan(hf_plan or {})
    else:
        declared = dict(getattr(model, attribute, {}) or {})
    plan = {**declared, **dict(overrides)}
    bad = {k: v for k, v in plan.items() if v not in STYLES}
    if bad:
        raise ConfigError(f"tp.plan: unknown style(s) {bad}; allowed: {', '.join(STYLES)}")
    return {k: v for k, v in plan.items() if v != "none"}


def _pattern(text: str) -> re.Pattern[str]:
    return re.compile("\\.".join("[^.]+" if p == "*" else re.escape(p) for p in text.split(".")))


def match_plan(names: list[str], plan: Mapping[str, str]) -> dict[str, str]:
    """Name -> style for every name a pattern matches fully (the first matching pattern wins)."""
    compiled = [(_pattern(k), v) for k, v in plan.items()]
    matched: dict[str, str] = {}
    for name in names:
        for pattern, style in compiled:
            if pattern.fullmatch(name):
                matched[name] = style
                break
    return matched


def _indivisible(what: str, name: str, size: int, tp: int) -> MeshError:
    return MeshError(
        f"parallel.tp = {tp} does not divide the {what} of {name!r} ({size}); choose a TP degree "
        f"that divides {size}, or change the model's {what}"
    )


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, leaf, module)


def _head_layout(name: str, attention: nn.Module, tp: TensorParallelGroup) -> slice | None:
    """Check head counts; return the KV rows this rank uses if KV heads are replicated."""
    head_dim = attention.head_dim
    query, key, _ = _projections(attention)
    n_heads = query.out_features // head_dim
    n_kv_heads = key.out_features // head_dim
    if n_heads % tp.size:
        raise _indivisible("attention heads (n_heads)", name, n_heads, tp.size)
    if n_kv_heads % tp.size == 0:
        return None
    if tp.size % n_kv_heads:
        raise MeshError(
            f"parallel.tp = {tp.size} neither divides nor is a multiple of the {n_kv_heads} "
            f"key/value heads (n_kv_heads) of {name!r}: KV heads can be split when tp divides "
            "them, or replicated when tp is a multiple of them"
        )
    queries_per_kv = n_heads // n_kv_heads
    first_query_head = tp.rank * (n_heads // tp.size)
    kv_head = first_query_head // queries_per_kv
    return slice(kv_head * head_dim, (kv_head + 1) * head_dim)


# Query/key/value projection names: the built-in attention's, then the `transformers` ones.
PROJECTION_NAMES = (("wq", "wk", "wv"), ("q_proj", "k_proj", "v_proj"))


def _projection_names(module: nn.Module) -> tuple[str, str, str] | None:
    if not isinstance(getattr(module, "head_dim", None), int):
        return None
    for names in PROJECTION_NAMES:
        if all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
            return names
    return None


def _projections(module: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    names = _projection_names(module)
    assert names is not None
    return tuple(getattr(module, n) for n in names)  # type: ignore[return-value]


def _is_attention(module: nn.Module) -> bool:
    return _projection_names(module) is not None


def _localise_head_counts(attention: nn.Module, tp: TensorParallelGroup, kv_split: bool) -> None:
    """A `transformers` attention reads its head counts from attributes; make them this rank's
    (query heads split; KV heads split or, when replicated, one per rank)."""
    counts = hf_head_counts(attention)
    if counts is None:
        return
    heads, kv_heads = counts
    local_heads = heads // tp.size
    local_kv_heads = kv_heads // tp.size if kv_split else 1
    for attr, value in (("num_heads", local_heads), ("num_key_value_heads", local_kv_heads)):
        if isinstance(getattr(attention, attr, None), int):
            setattr(attention, attr, value)
    if isinstance(getattr(attention, "num_key_value_groups", None), int):
        attention.num_key_value_groups = local_heads // local_kv_heads


class RegionEntry:
    """Forward pre-hook of a parallel region: f (or the sequence all-gather) on its input, once.

    Under sequence parallelism the block's other inputs were computed from the local sequence
    length; the built-in Llama passes RoPE tables sliced `[:local_seq]`, which are replaced by
    the slice for the gathered length (recognised as views of the model's own tables).
    """

    def __init__(
        self, tp: TensorParallelGroup, sequence_parallel: bool, tables: tuple[torch.Tensor, ...]
    ) -> None:
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        self.tables = tables
        self.columns: list[ColumnParallelLinear] = []

    def _full_rope(self, value: Any, local_seq: int, full_seq: int) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != local_seq:
            return value
        for table in self.tables:
            if value.data_ptr() == table.data_ptr():
                return table[:full_seq]
        return value

    @eager_under_compile  # gathers, and points the region's layers at the shard it saves
    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        del module
        # The hidden states come first, positionally or (as `transformers` layers pass them)
        # by keyword.
        key = None if args else _hidden_states_keyword(kwargs)
        x = args[0] if key is None else kwargs[key]
        rest = list(args[1:])
        if not self.sequence_parallel:
            x = copy_to_tensor_region(x, self.tp)
        else:
            local_seq = x.shape[SEQUENCE_DIM]
            x, source = gather_sequence_shard(x, self.tp)
            for column in self.columns:
                column.sequence_source = source
            full_seq = x.shape[SEQUENCE_DIM]
            rest = [self._full_rope(v, local_seq, full_seq) for v in rest]
            kwargs = {k: self._full_rope(v, local_seq, full_seq) for k, v in kwargs.items()}
        if key is None:
            return (x, *rest), kwargs
        return tuple(rest), {**kwargs, key: x}

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: the shard is saved by the layers that used it; drop other references."""
        del module, args, output
        for column in self.columns:
            if column.sequence_source is not None:
                column.sequence_source.shard = None
            column.sequence_source = None


def _hidden_states_keyword(kwargs: dict[str, Any]) -> str:
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states"
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return key
    raise ConfigError(
        f"tensor parallelism: a parallel region was called with no tensor input "
        f"(keywords: {sorted(kwargs)})"
    )


class SequenceEntry:
    """Forward pre-hook of the first block of a `transformers` model under sequence
    parallelism: keep this rank's shard of the (replicated) hidden states."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp = tp

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        del module
        if args:
            return (scatter_to_sequence_region(args[0], self.tp, SEQUENCE_DIM), *args[1:]), kwargs
        key = _hidden_states_keyword(kwargs)
        return args, {**kwargs, key: scatter_to_sequence_region(kwargs[key], self.tp, SEQUENCE_DIM)}


class SequenceExit:
    """Forward hook of the last block of a `transformers` model under sequence parallelism:
    all-gather the sequence again (backward keeps this rank's shard of the gradient), because
    what follows runs on the whole sequence on every rank and may reshape by its length (GPT-2
    views its output as `(-1, seq, dim)`)."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        del module, args
        if isinstance(output, torch.Tensor):
            return gather_from_tensor_region(output, self.tp, SEQUENCE_DIM)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (gather_from_tensor_region(output[0], self.tp, SEQUENCE_DIM), *output[1:])
        raise ConfigError(
            f"tp.sequence_parallel: the last block returned {type(output).__name__}; expected "
            "the hidden states (a tensor, or a tuple starting with them)"
        )


class PositionOffset:
    """Forward pre-hook of a position table under sequence parallelism: positions `0..s/tp−1`
    become this rank's `r·s/tp .. (r+1)·s/tp−1`."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        del module
        positions, *rest = args
        return (positions + self.tp.rank * positions.shape[-1], *rest)


def apply_plan(
    model: nn.Module,
    plan: Mapping[str, str],
    *,
    tp: TensorParallelGroup,
    sequence_parallel: bool,
    param_plan: Mapping[str, str] | None = None,
    output_module: str = "output",
    loss_parallel: bool = True,
) -> TensorParallelLayout:
    """Replace the planned modules of `model` (materialised, full) by their tp shards, in place."""
    layout = TensorParallelLayout()
    modules = dict(model.named_modules())
    split_at_first_block = sequence_parallel and is_hf_model(model)
    styles = match_plan([n for n in modules if n], plan)
    if not any(s in ("colwise", "colwise_qkv", "rowwise", "vocab") for s in styles.values()):
        raise ConfigError(
            f"tensor parallelism: the plan matches no module of {type(model).__name__}; built-in "
            f"models declare `tp_plan`, other models pass [tp] plan = {{pattern = style}} "
            f"(plan: {dict(plan) or 'empty'})"
        )
    replicated_rows: dict[str, slice] = {}
    for name, module in modules.items():
        names = _projection_names(module)
        if names is not None and styles.get(f"{name}.{names[0]}") == "colwise":
            rows = _head_layout(name, module, tp)
            if rows is not None:
                replicated_rows[f"{name}.{names[1]}"] = replicated_rows[f"{name}.{names[2]}"] = rows
            _localise_head_counts(module, tp, kv_split=rows is None)

    shared = _shared_weights(modules, styles)
    for name, style in styles.items():
        module = modules[name]
        if style in LINEAR_STYLES and output_dim(module) is None:
            raise ConfigError(
                f"tp.plan: {name!r} is {style} but a {type(module).__name__} (an nn.Linear or "
                "transformers' Conv1D is needed)"
            )
        if style in ("vocab", "positions") and not isinstance(module, nn.Embedding):
            raise ConfigError(f"tp.plan: {name!r} is {style} but a {type(module).__name__}")
        new: nn.Module
        if style == "colwise" and name in replicated_rows:
            new = ReplicatedHeadsLinear(
                module, tp=tp, rows=replicated_rows[name], input_mode="copy"
            )
            layout.tp_reduced_params.extend(new.parameters())
            layout.replicated_kv_heads = True
        elif style == "colwise_gather":
            _, out_features = features(module)
            if out_features % tp.size:
                raise _indivisible("output features", name, out_features, tp.size)
            new = ColumnParallelLinear.from_linear(module, tp=tp)
            new.gather_output = True
        elif style == "colwise_qkv":
            _localise_fused_attention(name, modules, tp)
            new = ColumnParallelLinear.from_linear(module, tp=tp, parts=QKV_PARTS)
        elif style == "colwise":
            what = "vocabulary (vocab_size)" if name == output_module else "output features"
            if name.rpartition(".")[2] in ("w1", "w3"):
                what = "FFN hidden size (hidden_dim)"
            _, out_features = features(module)
            if out_features % tp.size:
                raise _indivisible(what, name, out_features, tp.size)
            new = ColumnParallelLinear.from_linear(module, tp=tp)
            if name == output_module:
                new.gather_output = not loss_parallel
                layout.vocab_parallel_output = loss_parallel
        elif style == "rowwise":
            in_features, _ = features(module)
            if in_features % tp.size:
                raise _indivisible("input features", name, in_features, tp.size)
            new = RowParallelLinear.from_linear(module, tp=tp)
            if sequence_parallel:
                new.output_mode = "reduce_scatter_sequence"
        elif style == "vocab":
            if module.num_embeddings % tp.size:
                raise _indivisible("vocabulary (vocab_size)", name, module.num_embeddings, tp.size)
            new = VocabParallelEmbedding.from_embedding(module, tp=tp)
            if sequence_parallel and not split_at_first_block:
                new.output_mode = "reduce_scatter_sequence"
        else:  # positions
            if sequence_parallel:
                module.register_forward_pre_hook(PositionOffset(tp))
            layout.styles[name] = style
            continue
        _set_submodule(model, name, new)
        layout.styles[name] = style

    _retie(model, shared)
    _shard_loose_parameters(model, param_plan or {}, tp)
    # A `transformers` model's sequence shards live inside its blocks only, so columns outside
    # them (the head) take the whole sequence.
    _mark_regions(model, layout, tp, sequence_parallel, outside_sharded=not split_at_first_block)
    sequence_sharded: nn.Module = model
    if split_at_first_block:
        _, sequence_sharded = find_block_container(model, field="tp.sequence_parallel")
        blocks = list(sequence_sharded.children())
        blocks[0].register_forward_pre_hook(SequenceEntry(tp), with_kwargs=True)
        blocks[-1].register_forward_hook(SequenceExit(tp))
    elif sequence_parallel:
        _check_sequence_parallel_ends(model, layout, output_module)
        for name in DEFAULT_POSITION_MODULES:
            table = getattr(model, name, None)
            if isinstance(table, nn.Embedding) and name not in layout.styles:
                table.register_forward_pre_hook(PositionOffset(tp))
                layout.styles[name] = "positions"
    if sequence_parallel:
        # Every replicated parameter that sees only this rank's sequence shard (norms, biases
        # added after a reduce-scatter, position tables; in a `transformers` model, those of
        # its blocks) has a partial gradient.
        reduced = {id(p) for p in layout.tp_reduced_params}
        for param in sequence_sharded.parameters():
            if "tp" not in sharded_axes(param) and id(param) not in reduced:
                layout.tp_reduced_params.append(param)
                reduced.add(id(param))
    return layout


def _localise_fused_attention(
    name: str, modules: Mapping[str, nn.Module], tp: TensorParallelGroup
) -> None:
    """The attention owning a fused q | k | v projection computes with this rank's heads: its
    head count and the size it splits the projection's output by become local (GPT-2's
    `num_heads` and `split_size`; heads stay `head_dim` wide)."""
    parent_name = name.rpartition(".")[0]
    attention = modules[parent_name]
    _, out_features = features(modules[name])
    heads = getattr(attention, "num_heads", None)
    if not isinstance(heads, int) or out_features % QKV_PARTS:
        raise ConfigError(
            f"tp.plan: {name!r} is colwise_qkv, so {parent_name!r} must be an attention with "
            f"`num_heads` and q | k | v output features of equal size ({out_features} given)"
        )
    if heads % tp.size:
        raise _indivisible("attention heads (n_heads)", parent_name, heads, tp.size)
    attention.num_heads = heads // tp.size
    for attr in ("split_size", "embed_dim"):
        if isinstance(getattr(attention, attr, None), int):
            setattr(attention, attr, getattr(attention, attr) // tp.size)


@dataclass(frozen=True)
class _SharedWeight:
    """A weight two planned modules share (a head tied to the token embedding)."""

    owner: str  # the vocab-parallel embedding whose shard both use
    users: tuple[str, ...]


def _shared_weights(
    modules: Mapping[str, nn.Module], styles: Mapping[str, str]
) -> list[_SharedWeight]:
    by_weight: dict[int, list[str]] = {}
    for name in styles:
        weight = getattr(modules[name], "weight", None)
        if isinstance(weight, nn.Parameter):
            by_weight.setdefault(id(weight), []).append(name)
    shared = []
    for names in by_weight.values():
        if len(names) < 2:
            continue
        owners = [n for n in names if styles[n] == "vocab"]
        users = tuple(n for n in names if n not in owners)
        if len(owners) != 1 or any(styles[n] not in ("colwise", "colwise_gather") for n in users):
            raise ConfigError(
                f"tp.plan: {', '.join(names)} share one weight, split as "
                f"{', '.join(styles[n] for n in names)}; a shared weight can be split only as "
                "one 'vocab' embedding and 'colwise' / 'colwise_gather' heads (same rows)"
            )
        shared.append(_SharedWeight(owner=owners[0], users=users))
    return shared


def _retie(model: nn.Module, shared: list[_SharedWeight]) -> None:
    """Point each head at its embedding's shard: the same vocabulary rows on this rank, so one
    parameter (and one gradient, summed from both uses) as in the unsharded model."""
    for weight in shared:
        embedding = model.get_submodule(weight.owner)
        for user in weight.users:
            model.get_submodule(user).weight = embedding.weight


def _shard_loose_parameters(
    model: nn.Module, param_plan: Mapping[str, str], tp: TensorParallelGroup
) -> None:
    bad = {k: v for k, v in param_plan.items() if v != "colwise"}
    if bad:
        raise ConfigError(f"tp.param_plan: unknown style(s) {bad}; allowed: colwise")
    for name, style in match_plan([n for n, _ in model.named_parameters()], param_plan).items():
        del style
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        param = getattr(owner, leaf)
        if param.shape[0] % tp.size:
            raise _indivisible("leading dim", name, param.shape[0], tp.size)
        setattr(owner, leaf, shard_parameter(param, 0, even_slice(param.shape[0], tp)))


def _mark_regions(
    model: nn.Module,
    layout: TensorParallelLayout,
    tp: TensorParallelGroup,
    sequence_parallel: bool,
    *,
    outside_sharded: bool,
) -> None:
    """Parallel regions apply f (or the sequence all-gather) once on entry; a column-parallel
    linear outside every region does it itself, gathering the sequence when its input is
    sequence-sharded there (`outside_sharded`)."""
    rope = tuple(
        t
        for t in (getattr(model, "rope_cos", None), getattr(model, "rope_sin", None))
        if t is not None
    )
    in_region: set[int] = set()
    for name, module in model.named_modules():
        children = list(module.children())
        columns = [c for c in children if isinstance(c, ColumnParallelLinear)]
        if columns and any(isinstance(c, RowParallelLinear) for c in children):
            entry = RegionEntry(tp, sequence_parallel, rope)
            entry.columns = columns
            module.register_forward_pre_hook(entry, with_kwargs=True)
            module.register_forward_hook(entry.exit, always_call=True)
            layout.regions.append(name)
            for column in columns:
                column.input_mode = "region"
                in_region.add(id(column))
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear) and id(module) not in in_region:
            gather = sequence_parallel and outside_sharded
            module.input_mode = "gather_sequence" if gather else "copy"


def _check_sequence_parallel_ends(
    model: nn.Module, layout: TensorParallelLayout, output_module: str
) -> None:
    """Sequence shards start at the vocab-parallel embedding and end before the output head."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name not in layout.styles:
            if name in DEFAULT_POSITION_MODULES:
                continue
            raise ConfigError(
                f"tp.sequence_parallel needs the token embedding in the plan as 'vocab' (where "
                f"the sequence is split); {name!r} is a plain nn.Embedding"
            )
    head = dict(model.named_modules()).get(output_module)
    if head is not None and not isinstance(head, ColumnParallelLinear):
        raise ConfigError(
            f"tp.sequence_parallel needs the output head {output_module!r} in the plan as "
            "'colwise' (where the sequence is gathered again); set [tp] output_module"
        )

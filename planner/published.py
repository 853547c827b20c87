"""Published training runs the planner must recover: their models, clusters and layouts.

* GPT-3 175B, Megatron-LM (Narayanan et al., SC 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", Table 1): 96 layers, hidden 12288, 96 heads,
  sequence 2048, vocabulary 51200; 1536 A100-80GB (DGX A100 nodes of 8), global batch 1536;
  tensor-parallel 8, pipeline-parallel 16 (so data-parallel 12); 163 TFLOP/s per GPU = 52 % of
  peak. Their FLOP count (eq. 3) includes the activation recomputation they always used, so the
  52 % compares with the planner's hardware FLOPs utilisation (recomputation counted). The 2021
  system had no distributed optimizer (ZeRO), no sequence parallelism, and 1F1B / interleaved
  schedules: `MEGATRON_2021_SPACE`.
* Llama 3 405B (Llama Team, "The Llama 3 Herd of Models", 2024, Table 4): 126 layers, model
  dimension 16384, FFN 53248, 128 heads and 8 key/value heads, vocabulary 128256, sequence 8192;
  16,384 H100-80GB (8 per node), 16M tokens per batch = 2048 sequences; TP 8, CP 1, PP 16,
  DP 128; 400 TFLOP/s per GPU, 41 % BF16 MFU.

`resolve_shape` reads the MODEL of `plait plan`: one of these published models by name, or a
built-in family's size (`shape_from_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.core.errors import ConfigError
from plait.planner.devices import device_spec
from plait.planner.layouts import Job, SearchSpace
from plait.planner.model_shape import ModelShape, shape_from_config


def _gpt(name: str, *, layers: int, dim: int, heads: int, vocab: int, seq: int) -> ModelShape:
    per_layer = 12 * dim * dim + 13 * dim  # qkv + proj + 2 MLP matrices, biases, 2 LayerNorms
    return ModelShape(
        name=name,
        n_layers=layers,
        dim=dim,
        n_heads=heads,
        kv_heads=heads,
        ffn_dim=4 * dim,
        ffn_matrices=2,
        vocab_size=vocab,
        params_per_layer=per_layer,
        active_params_per_layer=per_layer,
        embedding_params=(vocab + seq) * dim,
        head_params=2 * dim + vocab * dim,
    )


def _llama(
    name: str, *, layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int
) -> ModelShape:
    head_dim = dim // heads
    per_layer = dim * head_dim * (2 * heads + 2 * kv_heads) + 3 * dim * ffn + 2 * dim
    return ModelShape(
        name=name,
        n_layers=layers,
        dim=dim,
        n_heads=heads,
        kv_heads=kv_heads,
        ffn_dim=ffn,
        ffn_matrices=3,
        vocab_size=vocab,
        params_per_layer=per_layer,
        active_params_per_layer=per_layer,
        embedding_params=vocab * dim,
        head_params=dim + vocab * dim,
    )


PUBLISHED_MODELS: dict[str, ModelShape] = {
    "gpt3-175b": _gpt("gpt3-175b", layers=96, dim=12288, heads=96, vocab=51200, seq=2048),
    "llama3-405b": _llama(
        "llama3-405b", layers=126, dim=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256
    ),
}


def resolve_shape(spec: str, overrides: dict[str, Any] | None = None) -> ModelShape:
    """`family:size` (`llama:7b`, `gpt2:small`, `moe:mixtral-8x7b`) or a published model's name
    (`gpt3-175b`, `llama3-405b`) as a shape."""
    if spec in PUBLISHED_MODELS and not overrides:
        return PUBLISHED_MODELS[spec]
    family, _, size = spec.partition(":")
    if not size:
        known = ", ".join(sorted(PUBLISHED_MODELS))
        raise ConfigError(
            f"MODEL: expected family:size (e.g. llama:7b, gpt2:small, moe:mixtral-8x7b) or one "
            f"of {known}, got {spec!r}"
        )
    from plait.plugins.models import resolve_model_config

    config = resolve_model_config(family, size, overrides or {})
    return shape_from_config(family, config, name=spec)


# Both runs reduced gradients over flat data-parallel groups, unsharded across nodes: the
# topology-aware variants (HSDP, hierarchical collectives) are left out of their spaces.
MEGATRON_2021_SPACE = SearchSpace(
    zero_stages=(0,),
    recompute=("full",),
    schedules=("1f1b", "interleaved_1f1b"),
    virtual_stages=(2, 3, 4, 6),
    micro_batches=(1, 2, 4, 8),
    sequence_parallel=(False,),
    max_cp=1,
    hybrid_sharding=False,
    hierarchical=False,
)

# Llama 3's stack: FSDP-style sharding of gradients and optimizer state (ZeRO-2 class),
# sequence parallelism, context parallelism, interleaved 1F1B with many virtual stages.
LLAMA3_SPACE = SearchSpace(
    zero_stages=(1, 2),
    recompute=("none", "selective", "full"),
    schedules=("1f1b", "interleaved_1f1b"),
    virtual_stages=(2, 4, 8),
    micro_batches=(1, 2, 4),
    sequence_parallel=(True,),
    max_cp=16,
    hybrid_sharding=False,
    hierarchical=False,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishedRun:
    name: str
    job: Job
    space: SearchSpace
    degrees: tuple[int, int, int, int, int]  # (tp, cp, pp, dp, ep)
    reported_utilisation: float
    utilisation_counts_recompute: bool  # the paper's FLOP count includes recomputation
    source: str


def published_runs() -> dict[str, PublishedRun]:
    return {
        "megatron-gpt3-175b": PublishedRun(
            name="megatron-gpt3-175b",
            job=Job(
                model=PUBLISHED_MODELS["gpt3-175b"],
                seq_len=2048,
                global_batch=1536,
                world=1536,
                per_node=8,
                device=device_spec("A100-80GB"),
                fused_attention=False,
            ),
            space=MEGATRON_2021_SPACE,
            degrees=(8, 1, 16, 12, 1),
            reported_utilisation=0.52,
            utilisation_counts_recompute=True,
            source="Narayanan et al. 2021, Table 1 (163 TFLOP/s per GPU, 52 % of peak)",
        ),
        "llama3-405b": PublishedRun(
            name="llama3-405b",
            job=Job(
                model=PUBLISHED_MODELS["llama3-405b"],
                seq_len=8192,
                global_batch=2048,
                world=16384,
                per_node=8,
                device=device_spec("H100-80GB"),
            ),
            space=LLAMA3_SPACE,
            degrees=(8, 1, 16, 128, 1),
            reported_utilisation=0.41,
            utilisation_counts_recompute=False,
            source="Llama 3 report 2024, Table 4 (400 TFLOP/s per GPU, 41 % BF16 MFU)",
        ),
    }

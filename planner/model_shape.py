"""What the planner needs to know about a model: its shape, parameter counts and per-layer work.

`ModelShape` is one flat, family-independent description of a decoder-only transformer (dense or
MoE). `shape_from_config` reads it off a built-in family's validated config
(`plait.plugins.models`), so the planner prices exactly the model `plait train` would build;
`published.py` writes the shapes of models plait does not ship (GPT-3 175B, Llama 3 405B) the
same way, and resolves a MODEL argument to either kind (`resolve_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.core.errors import ConfigError
from plait.core.flops import attention_flops_per_token


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's shape. Widths are in elements, counts in parameters."""

    name: str
    n_layers: int
    dim: int
    n_heads: int
    kv_heads: int
    ffn_dim: int  # dense FFN width (one expert's width for MoE layers: `expert_dim`)
    ffn_matrices: int  # 3 for SwiGLU (w1, w3, w2), 2 for a GELU MLP
    vocab_size: int
    params_per_layer: int  # one block, every expert counted
    active_params_per_layer: int  # one block as one token uses it (top-k experts)
    embedding_params: int  # token (and position) tables: lookups, no FLOPs
    head_params: int  # final norm + output projection: a real matmul
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0
    expert_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        return self.n_layers * self.params_per_layer + self.embedding_params + self.head_params

    @property
    def dense_active_params(self) -> int:
        """`N` of `6·N`: what one token multiplies by (no embedding tables, the head included)."""
        return self.n_layers * self.active_params_per_layer + self.head_params

    @property
    def expert_params_per_layer(self) -> int:
        """Routed experts' parameters in one block (sharded by expert parallelism)."""
        return self.num_experts * self.ffn_matrices * self.dim * self.expert_dim

    def model_flops_per_token(self, seq_len: int) -> float:
        """`6·N + causal attention`, the same accounting as `plait.core.flops` and MFU."""
        return 6.0 * self.dense_active_params + attention_flops_per_token(
            n_layers=self.n_layers, n_heads=self.n_heads, head_dim=self.head_dim, seq_len=seq_len
        )


def shape_from_config(family: str, config: Any, *, name: str = "") -> ModelShape:
    """The shape of a built-in family's config (`LlamaConfig`, `GPT2Config`, `MoEConfig`)."""
    if family not in ("llama", "gpt2", "moe"):
        raise ConfigError(f"model.name: the planner knows llama, gpt2 and moe, not {family!r}")
    gpt2 = family == "gpt2"
    # The final norm (GPT-2's has a bias) and the output matrix, outside the blocks.
    head = (2 if gpt2 else 1) * config.dim + config.dim * config.vocab_size
    all_body = config.num_params(exclude_embeddings=True) - head
    active_body = (
        config.num_active_params(exclude_embeddings=True) - head if family == "moe" else all_body
    )
    embedding_rows = config.vocab_size + (config.max_seq_len if gpt2 else 0)
    experts = (
        {
            "num_experts": config.num_experts,
            "top_k": config.top_k,
            "expert_dim": config.expert_hidden_dim,
        }
        if family == "moe"
        else {}
    )
    return ModelShape(
        name=name or family,
        n_layers=config.n_layers,
        dim=config.dim,
        n_heads=config.n_heads,
        kv_heads=config.n_heads if gpt2 else config.kv_heads,
        ffn_dim=config.expert_hidden_dim if family == "moe" else config.hidden_dim,
        ffn_matrices=2 if gpt2 else 3,
        vocab_size=config.vocab_size,
        params_per_layer=all_body // config.n_layers,
        active_params_per_layer=active_body // config.n_layers,
        embedding_params=embedding_rows * config.dim,
        head_params=head,
        **experts,
    )

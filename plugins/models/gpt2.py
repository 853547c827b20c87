"""The GPT-2 family: learned positions, LayerNorm, biased projections, GELU (tanh) MLP.

Presets: `tiny` is a byte-level (vocab 256) model for tests; `small`, `medium` and `large` are
the real GPT-2 124M / 355M / 774M shapes. Unlike OpenAI's GPT-2, the input and output
embeddings are **untied** (`tok_embeddings` and `output` are separate matrices), so tensor and
pipeline parallelism can place them independently; the `small` preset therefore holds 163M
parameters (124M + a second 50257×768 matrix). Attention and MLP output projections use the
depth-scaled init of the GPT-2 paper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field, model_validator
from torch import nn

from plait.core.documents import Documents
from plait.plugins.models.common import (
    Attention,
    LayerNorm,
    ModelConfig,
    TransformerBase,
    UsesKernels,
    _KernelsHandle,
    documents_for,
)

if TYPE_CHECKING:
    from plait.core.kernels import Kernels


class GPT2Config(ModelConfig):
    """Shape of a GPT-2 model."""

    family: ClassVar[str] = "gpt2"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=256),
        "small": dict(dim=768, n_layers=12, n_heads=12, vocab_size=50257, max_seq_len=1024),
        "medium": dict(dim=1024, n_layers=24, n_heads=16, vocab_size=50257, max_seq_len=1024),
        "large": dict(dim=1280, n_layers=36, n_heads=20, vocab_size=50257, max_seq_len=1024),
    }

    vocab_size: int = Field(256, gt=0, description="tokens in the vocabulary (256 = bytes)")
    dim: int = Field(64, gt=0, description="model (residual stream) width")
    n_layers: int = Field(2, gt=0, description="transformer blocks")
    n_heads: int = Field(4, gt=0, description="attention heads")
    ffn_hidden_dim: int | None = Field(None, gt=0, description="MLP width; None = 4·dim")
    norm_eps: float = Field(1e-5, gt=0)
    max_seq_len: int = Field(1024, gt=0, description="learned positions")

    @model_validator(mode="after")
    def _heads_fit(self) -> GPT2Config:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim if self.ffn_hidden_dim is not None else 4 * self.dim

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count from the shape alone; embeddings = token and position tables."""
        attention = 4 * self.dim * self.dim + 4 * self.dim
        mlp = 2 * self.dim * self.hidden_dim + self.hidden_dim + self.dim
        per_layer = attention + mlp + 4 * self.dim  # two LayerNorms, weight and bias
        total = self.n_layers * per_layer + 2 * self.dim + self.dim * self.vocab_size
        if exclude_embeddings:
            return total
        return total + (self.vocab_size + self.max_seq_len) * self.dim


class FeedForward(UsesKernels):
    """GELU MLP: `w2(gelu(w1 x + w1_bias))`, the first bias fused into the `bias_gelu` kernel.

    `w1_bias` follows `w1`'s output dimension: tensor parallelism shards it like a colwise bias
    (`GPT2.tp_param_plan`).
    """

    def __init__(self, dim: int, hidden_dim: int, *, kernels: Kernels | _KernelsHandle) -> None:
        super().__init__(kernels)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w1_bias = nn.Parameter(torch.zeros(hidden_dim))
        self.w2 = nn.Linear(hidden_dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        return self.w2(self.kernel("bias_gelu", h)(h, self.w1_bias))


class GPT2Block(nn.Module):
    """Pre-norm block: `h = x + attention(ln(x))`, `out = h + feed_forward(ln(h))`."""

    def __init__(self, config: GPT2Config, kernels: _KernelsHandle) -> None:
        super().__init__()
        self.attention_norm = LayerNorm(config.dim, eps=config.norm_eps, kernels=kernels)
        self.attention = Attention(
            dim=config.dim,
            n_heads=config.n_heads,
            n_kv_heads=config.n_heads,
            bias=True,
            kernels=kernels,
        )
        self.ffn_norm = LayerNorm(config.dim, eps=config.norm_eps, kernels=kernels)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim, kernels=kernels)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class GPT2(TransformerBase):
    """A GPT-2 decoder: `forward(tokens[batch, seq]) -> logits[batch, seq, vocab]`.

    A pipeline stage may set `tok_embeddings` and `pos_embeddings` to `None` (the input is then
    hidden states [batch, seq, dim]) and `norm`/`output` to `None` (the output is then hidden
    states). Position embeddings stay replicated under tensor parallelism.
    """

    tp_plan: ClassVar[dict[str, str]] = {
        "tok_embeddings": "vocab",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "colwise",
    }
    tp_param_plan: ClassVar[dict[str, str]] = {"layers.*.feed_forward.w1_bias": "colwise"}
    embedding_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings", "pos_embeddings")

    config: GPT2Config
    tok_embeddings: nn.Embedding | None
    pos_embeddings: nn.Embedding | None
    norm: LayerNorm | None
    output: nn.Linear | None

    def __init__(self, config: GPT2Config, kernels: Kernels) -> None:
        super().__init__(config, kernels)
        handle = self._kernels_handle
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): GPT2Block(config, handle) for i in range(config.n_layers)}
        )
        self.norm = LayerNorm(config.dim, eps=config.norm_eps, kernels=handle)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self._init_if_materialised()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """`positions` (seq,) are the global positions of the given tokens (default 0..seq-1);
        context parallelism passes those of this rank's shard. Packed rows give `positions`
        (rows, seq) restarting per document and their `documents` (see `common`)."""
        documents = documents_for(positions, documents)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = h.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {seq} tokens exceeds max_seq_len {self.config.max_seq_len}"
            )
        if self.pos_embeddings is not None:
            if positions is None:
                positions = torch.arange(seq, device=h.device)
            h = h + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h) if documents is None else layer(h, documents)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_gpt2(config: GPT2Config, kernels: Kernels) -> GPT2:
    return GPT2(config, kernels)

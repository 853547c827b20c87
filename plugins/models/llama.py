"""The Llama family (Llama 2 architecture): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Presets: `tiny` and `small` are byte-level (vocab 256) models for tests and laptops; `1b` is the
TinyLlama-1.1B shape; `7b` and `70b` are the real Llama-2-7B and Llama-2-70B shapes (the latter
with 64 query heads sharing 8 key/value heads). Input and output embeddings are untied, as in
Llama. Parameter names follow Meta's reference code and torchtitan (`tok_embeddings`,
`layers.<i>.attention.wq`, `feed_forward.w1/w2/w3`, `norm`, `output`). `qkv_bias` adds biases
to the q/k/v projections, which is all that separates Qwen2's decoder from this one (Mistral's
differs only by its sliding attention window, which plait does not implement).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field, model_validator
from torch import nn

from plait.core.documents import Documents
from plait.plugins.models.common import (
    Attention,
    ModelConfig,
    RMSNorm,
    TransformerBase,
    UsesKernels,
    _KernelsHandle,
    documents_for,
)

if TYPE_CHECKING:
    from plait.core.kernels import Kernels


class LlamaConfig(ModelConfig):
    """Shape of a Llama model. The FFN width follows Meta's rule unless `ffn_hidden_dim` is set."""

    family: ClassVar[str] = "llama"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                     multiple_of=16, max_seq_len=256),
        "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256,
                      multiple_of=64, max_seq_len=1024),
        "1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                   multiple_of=256, max_seq_len=2048),
        "7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                   multiple_of=256, max_seq_len=4096),
        "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                    multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=4096),
    }  # fmt: skip

    vocab_size: int = Field(256, gt=0, description="tokens in the vocabulary (256 = bytes)")
    dim: int = Field(64, gt=0, description="model (residual stream) width")
    n_layers: int = Field(2, gt=0, description="transformer blocks")
    n_heads: int = Field(4, gt=0, description="query heads")
    n_kv_heads: int | None = Field(None, gt=0, description="key/value heads; None = n_heads")
    ffn_hidden_dim: int | None = Field(None, gt=0, description="SwiGLU width; None = Meta's rule")
    multiple_of: int = Field(256, gt=0, description="round the SwiGLU width up to a multiple")
    ffn_dim_multiplier: float | None = Field(None, gt=0, description="scale the SwiGLU width")
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    max_seq_len: int = Field(2048, gt=0, description="longest sequence RoPE tables cover")
    qkv_bias: bool = Field(False, description="biases on the q/k/v projections (Qwen2's layout)")

    @model_validator(mode="after")
    def _heads_fit(self) -> LlamaConfig:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4·dim (so three matrices cost what two 4·dim ones would),
        optionally scaled, rounded up to `multiple_of` — Meta's rule, giving 11008 for 7B and
        28672 for 70B."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * -(-hidden // self.multiple_of)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count from the shape alone (no module is built)."""
        attention = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.kv_heads)
        if self.qkv_bias:
            attention += self.head_dim * (self.n_heads + 2 * self.kv_heads)
        feed_forward = 3 * self.dim * self.hidden_dim
        per_layer = attention + feed_forward + 2 * self.dim
        total = self.n_layers * per_layer + self.dim + self.dim * self.vocab_size
        return total if exclude_embeddings else total + self.vocab_size * self.dim


class FeedForward(UsesKernels):
    """SwiGLU MLP: `w2(swiglu(w1 x, w3 x))` with `w1` the gate, `w3` the up projection."""

    def __init__(self, dim: int, hidden_dim: int, *, kernels: Kernels | _KernelsHandle) -> None:
        super().__init__(kernels)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        return self.w2(self.kernel("swiglu", gate)(gate, self.w3(x)))


class LlamaBlock(nn.Module):
    """Pre-norm block: `h = x + attention(norm(x))`, `out = h + feed_forward(norm(h))`."""

    def __init__(self, config: LlamaConfig, kernels: _KernelsHandle) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps, kernels=kernels)
        self.attention = Attention(
            dim=config.dim,
            n_heads=config.n_heads,
            n_kv_heads=config.kv_heads,
            bias=config.qkv_bias,
            out_bias=False,
            kernels=kernels,
        )
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps, kernels=kernels)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim, kernels=kernels)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(TransformerBase):
    """A Llama decoder: `forward(tokens[batch, seq]) -> logits[batch, seq, vocab]`.

    Embeddings are untied (`tok_embeddings` and `output` are separate matrices). A pipeline stage
    may set `tok_embeddings` to `None` (the input is then hidden states [batch, seq, dim]) and
    `norm`/`output` to `None` (the output is then hidden states). The RoPE tables `rope_cos` /
    `rope_sin` (max_seq_len, head_dim // 2) are non-persistent buffers rebuilt by `init_buffers`.
    """

    tp_plan: ClassVar[dict[str, str]] = {
        "tok_embeddings": "vocab",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "colwise",
    }

    config: LlamaConfig
    tok_embeddings: nn.Embedding | None
    norm: RMSNorm | None
    output: nn.Linear | None
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig, kernels: Kernels) -> None:
        super().__init__(config, kernels)
        handle = self._kernels_handle
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): LlamaBlock(config, handle) for i in range(config.n_layers)}
        )
        self.norm = RMSNorm(config.dim, eps=config.norm_eps, kernels=handle)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        table_shape = (config.max_seq_len, config.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(table_shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table_shape), persistent=False)
        self._init_if_materialised()

    def init_buffers(self) -> None:
        """Rotary tables: angle(position p, pair i) = p · theta^(−2i / head_dim), in float32."""
        # Computed on the CPU in float64 so every device gets bit-identical tables.
        head_dim = self.config.head_dim
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq = 1.0 / (self.config.rope_theta**exponents)
        positions = torch.arange(self.config.max_seq_len, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)
        device = self.rope_cos.device
        self.rope_cos = angles.cos().to(device=device, dtype=torch.float32)
        self.rope_sin = angles.sin().to(device=device, dtype=torch.float32)

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
        if positions is None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.layers.values():
            h = layer(h, cos, sin) if documents is None else layer(h, cos, sin, documents)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_llama(config: LlamaConfig, kernels: Kernels) -> Llama:
    return Llama(config, kernels)

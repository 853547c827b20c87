"""Building blocks shared by the built-in model families: config base, norms, attention, base class.

Every op goes through the kernel facade (`plait.core.kernels.Kernels`), so a faster provider
(Triton on CUDA, …) replaces the reference PyTorch ops without touching the model code.

What the parallel strategies rely on, and why the code is shaped the way it is:

- Layers live in an `nn.ModuleDict` keyed "0".."n-1": a pipeline stage deletes the layers it does
  not own and the remaining parameter names stay those of the full model.
- `tok_embeddings`, `norm` and `output` may be set to `None` by pipeline splitting; the forward
  then takes / returns hidden states.
- Attention derives its head counts from the projected tensors at run time, so tensor parallelism
  can shard `wq`/`wk`/`wv`/`wo` (plain local shards or DTensors) without touching this code.
- Attention calls `attend(q, k, v)` and the model forward takes `positions=` (the global
  positions of the tokens it is given): context parallelism replaces the first and passes the
  second, since each rank then holds only some positions of every sequence.
- Packed rows: the forward takes `documents=` (`plait.core.documents.Documents`, computed on
  whole rows) and `positions` (rows, seq) restarting per document; attention then attends only
  inside a document (`attend(q, k, v, documents=…)`).
- `init_weights(seed=…)` draws every parameter from a generator seeded by (seed, parameter
  name), so any subset of the model, on any device, gets the values of the full model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import ValidationError
from torch import nn

from plait.core.config import Section
from plait.core.documents import Documents, documents_of
from plait.core.errors import ConfigError
from plait.core.flops import transformer_flops_per_token
from plait.plugins.models.init import init_parameter, normalised_name

if TYPE_CHECKING:
    from typing_extensions import Self

    from plait.core.kernels import Kernels


class ModelConfig(Section):
    """Base of a family's config: named presets, with single fields overridable by name."""

    family: ClassVar[str] = ""
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def from_preset(cls, size: str, overrides: Mapping[str, Any] | None = None) -> Self:
        """The preset `size` with `overrides` applied; errors name the allowed presets/fields."""
        if size not in cls.presets:
            raise ConfigError(
                f"model.size: {cls.family!r} has no preset {size!r}; allowed: "
                f"{', '.join(cls.presets)}"
            )
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(cls.model_fields))
        if unknown:
            raise ConfigError(
                f"model.overrides: {cls.family!r} has no field(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(cls.model_fields)}"
            )
        try:
            return cls.model_validate({**cls.presets[size], **overrides})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']} (got {e.get('input')!r})"
                for e in exc.errors()
            )
            raise ConfigError(f"model {cls.family}/{size}: {problems}") from None


class _KernelsHandle:
    """Holds the shared `Kernels` so that copying a model (deepcopy, EMA copies) shares it
    instead of trying to copy the plugin manager inside."""

    __slots__ = ("kernels",)

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels

    def __deepcopy__(self, memo: dict[int, Any]) -> _KernelsHandle:
        return self


class UsesKernels(nn.Module):
    """A module that fetches its ops from the kernel facade."""

    def __init__(self, kernels: Kernels | _KernelsHandle) -> None:
        super().__init__()
        self._kernels_handle = (
            kernels if isinstance(kernels, _KernelsHandle) else _KernelsHandle(kernels)
        )

    @property
    def kernels(self) -> Kernels:
        return self._kernels_handle.kernels

    def kernel(self, name: str, like: torch.Tensor) -> Any:
        """The implementation of op `name` for `like`'s device type and dtype."""
        return self.kernels.get(name, like.device, like.dtype)


class RMSNorm(UsesKernels):
    """Root-mean-square normalisation with a learned scale (no bias, no mean subtraction)."""

    def __init__(self, dim: int, *, eps: float, kernels: Kernels | _KernelsHandle) -> None:
        super().__init__(kernels)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel("rms_norm", x)(x, self.weight, self.eps)


class LayerNorm(UsesKernels):
    """Layer normalisation with a learned scale and bias."""

    def __init__(self, dim: int, *, eps: float, kernels: Kernels | _KernelsHandle) -> None:
        super().__init__(kernels)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel("layer_norm", x)(x, self.weight, self.bias, self.eps)


class Attention(UsesKernels):
    """Multi-head causal self-attention with optional grouped-query heads and RoPE.

    `wq` projects to `n_heads · head_dim`, `wk`/`wv` to `n_kv_heads · head_dim`. The number of
    heads this rank holds is read from the projected tensors (`view(..., -1, head_dim)`), which
    equals `wq.out_features // head_dim` unsharded and the local head count once tensor
    parallelism has sharded the projections column-wise.
    """

    def __init__(
        self,
        *,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        bias: bool,
        kernels: Kernels | _KernelsHandle,
        out_bias: bool | None = None,
    ) -> None:
        super().__init__(kernels)
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        # Qwen2 biases q/k/v but not the output projection; None keeps one flag for all four.
        self.wo = nn.Linear(
            n_heads * self.head_dim, dim, bias=bias if out_bias is None else out_bias
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if cos is not None and sin is not None:
            rope = self.kernel("rope", q)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # An attend() installed by a plugin that knows nothing of documents still serves rows
        # of one sequence each; packed rows always reach it with `documents`.
        out = (
            self.attend(q, k, v) if documents is None else self.attend(q, k, v, documents=documents)
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """Causal attention of q (batch, heads, seq, head_dim) over k/v, inside each document
        of packed rows. Context parallelism sets an instance attribute of this name to attend
        over the whole sequence across its group while this rank holds only its shard of the
        positions."""
        document_ids = documents.document_ids if documents is not None else None
        return self.kernel("attention", q)(q, k, v, causal=True, document_ids=document_ids)


def documents_for(positions: torch.Tensor | None, documents: Documents | None) -> Documents | None:
    """The documents of a forward's rows: those given, or those its own whole rows' restarting
    `positions` show when the model is called directly (the engine always passes `documents`,
    computed before context parallelism cuts the rows)."""
    if documents is not None or positions is None or positions.ndim != 2:
        return documents
    return documents_of({"positions": positions})


class TransformerBase(UsesKernels):
    """What both families share: weight initialisation by name, parameter counting.

    Subclasses set `tok_embeddings`, `layers`, `norm`, `output` (and optionally more embeddings)
    and implement `init_buffers`.
    """

    # Module-name patterns -> "colwise" / "rowwise" / "vocab" (Hugging Face `tp_plan` style).
    tp_plan: ClassVar[dict[str, str]] = {}
    # Parameters that are not a Linear's own weight/bias but follow a sharded Linear's output
    # dimension: parameter-name pattern -> "colwise" (shard dim 0 like a colwise bias).
    tp_param_plan: ClassVar[dict[str, str]] = {}
    # Parameter-name prefixes that count as embeddings (excluded from FLOPs and "dense" counts).
    embedding_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings",)
    # Projections whose output is added to the residual stream get a depth-scaled init.
    residual_projections: ClassVar[tuple[str, ...]] = ("wo", "w2")
    init_std: ClassVar[float] = 0.02

    def __init__(self, config: Any, kernels: Kernels) -> None:
        super().__init__(kernels)
        self.config = config

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty`, or on another device)."""

    def _init_if_materialised(self) -> None:
        """Built on a real device, the model is usable at once; on meta it waits for the engine."""
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights(seed=0)

    @torch.no_grad()
    def init_weights(self, *, seed: int) -> None:
        """Initialise every parameter from a generator seeded by (`seed`, its name), then buffers.

        Norm weights are ones, biases zeros, other weights N(0, 0.02²), and the residual
        projections `wo`/`w2` N(0, (0.02/√(2·n_layers))²) (GPT-2's depth scaling, using the full
        model's layer count so pipeline stages agree). Modules set to `None` hold no parameters and
        are skipped; values do not depend on which other parameters exist or on the device.
        """
        residual_std = self.init_std / math.sqrt(2 * self.config.n_layers)
        for module_name, module in self.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                name = normalised_name(f"{module_name}.{leaf}" if module_name else leaf)
                owner = normalised_name(module_name).rsplit(".", 1)[-1]
                if isinstance(module, RMSNorm | LayerNorm) and leaf == "weight":
                    init_parameter(param, seed=seed, name=name, kind="ones")
                elif leaf.endswith("bias"):
                    init_parameter(param, seed=seed, name=name, kind="zeros")
                elif owner in self.residual_projections:
                    init_parameter(param, seed=seed, name=name, kind="normal", std=residual_std)
                else:
                    init_parameter(param, seed=seed, name=name, kind="normal", std=self.init_std)
        self.init_buffers()

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters held by this module (global sizes for DTensors; works on meta)."""
        total = 0
        for name, param in self.named_parameters():
            top = normalised_name(name).split(".", 1)[0]
            if exclude_embeddings and top in self.embedding_modules:
                continue
            total += param.numel()
        return total


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of a built-in family: 6·N (N without the embedding tables, the
    output projection included) plus the causal attention term (`plait.core.flops`)."""
    return transformer_flops_per_token(
        num_params_dense=config.num_params(exclude_embeddings=True),
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        head_dim=config.head_dim,
        seq_len=seq_len,
    )

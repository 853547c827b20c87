"""The MoE family: the Llama block with its feed-forward replaced by routed (and shared) experts.

Mixtral / DeepSeek-MoE style. Each MoE layer holds `num_experts` SwiGLU experts stacked into
three tensors (`experts.w1`/`w3`: (E, hidden, dim), `experts.w2`: (E, dim, hidden), nn.Linear's
(out, in) convention per expert), a linear router (`router.weight`: (E, dim)) and optionally
`num_shared_experts` SwiGLU experts every token passes through (DeepSeek-MoE), fused into one
SwiGLU of width `num_shared_experts · expert_hidden_dim`. The first `first_dense_layers`
blocks keep a dense SwiGLU (DeepSeek-V2-Lite's first block).

Routing: softmax over the router logits (float32), top-k experts per token, gate weights
renormalised over the k chosen (`normalize_top_k`, Mixtral) or kept as softmax probabilities
(DeepSeek-V2-Lite). With the auxiliary-loss-free balancing of DeepSeek-V3 a per-expert bias
(`router.expert_bias`, a buffer) is added to the scores *for the selection only*, and after
every optimizer step `bias_e += bias_update_rate · sign(mean load − load_e)` over the
whole step's tokens (`MoELayer.update_expert_bias`, called by the expert-parallel runtime, which
sums the loads over the data-parallel ranks first).

Capacity: `capacity_factor = None` is dropless. Otherwise every expert takes at most
`ceil(capacity_factor · seq_len · top_k / num_experts)` assignments *per sequence* (GShard's
routing group is one sequence here), first-choice assignments before second choices, earlier
positions first; the rest are dropped (they contribute nothing; the residual carries the token).
Because the group is a sequence, which tokens are dropped does not depend on how the batch is
split over ranks or micro-batches.

Balancing losses, both per sequence and averaged over the batch's sequences (so they too do not
depend on the split), summed over layers:

- auxiliary loss (Switch / GShard): `aux_loss_coef · E · Σ_e f_e · P_e`, `f_e` the fraction of
  the sequence's k·S assignments routed to expert e (before drops), `P_e` its mean probability;
- router z-loss (ST-MoE): `z_loss_coef · mean(logsumexp(logits)²)`.

They reach the training loss without changing the model's output: each MoE layer passes its
output through `inject_loss`, which is the identity forward and, backward, adds the gradient of
the balancing loss (as if it had been added to the loss the engine differentiates). This works
with any loss function, with micro-batches and pipeline stages, and needs no global state; the
values are kept (detached) in `MoELayer.last_balance_loss` for reporting. Under fp16 loss
scaling the precision runtime sets `MoELayer.backward_loss_scale` to the loss scale before every
forward, so the injected gradient is scaled (and later unscaled) like the main loss's.

FLOPs per token count active parameters only (see `moe_flops_per_token`).

Expert parallelism replaces `MoELayer.run_experts` (an instance attribute, as context
parallelism replaces `Attention.attend`): it receives the kept assignments sorted by global
expert id with the count per expert and returns the experts' outputs in the same order.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from plait.core.flops import attention_flops_per_token
from plait.plugins.models.common import UsesKernels, _KernelsHandle
from plait.plugins.models.init import full_initial_value, normalised_name
from plait.plugins.models.llama import FeedForward, Llama, LlamaBlock, LlamaConfig

if TYPE_CHECKING:
    from plait.core.kernels import Kernels


class MoEConfig(LlamaConfig):
    """Shape and routing of a MoE model; every Llama field keeps its meaning."""

    family: ClassVar[str] = "moe"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                     max_seq_len=256, num_experts=4, top_k=2, expert_hidden_dim=32),
        "tiny-shared": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                            max_seq_len=256, num_experts=8, top_k=2, expert_hidden_dim=16,
                            num_shared_experts=1, normalize_top_k=False),
        "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256,
                      max_seq_len=1024, num_experts=8, top_k=2, expert_hidden_dim=256),
        # Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active.
        "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                             max_seq_len=32768, rope_theta=1e6, num_experts=8, top_k=2,
                             expert_hidden_dim=14336),
        # DeepSeek-V2-Lite's expert layout (64 routed, 6 active, 2 shared, first block dense);
        # attention is plain multi-head here (plait has no MLA), so its count differs.
        "deepseek-v2-lite": dict(dim=2048, n_layers=27, n_heads=16, vocab_size=102400,
                                 max_seq_len=4096, num_experts=64, top_k=6,
                                 expert_hidden_dim=1408, num_shared_experts=2,
                                 first_dense_layers=1, ffn_hidden_dim=10944,
                                 normalize_top_k=False, aux_loss_coef=0.001),
    }  # fmt: skip

    num_experts: int = Field(8, gt=0, description="routed experts per MoE layer")
    top_k: int = Field(2, gt=0, description="experts each token is routed to")
    expert_hidden_dim: int = Field(64, gt=0, description="SwiGLU width of one expert")
    num_shared_experts: int = Field(0, ge=0, description="experts every token passes through")
    first_dense_layers: int = Field(0, ge=0, description="leading blocks with a dense FFN")
    normalize_top_k: bool = Field(True, description="renormalise the k gate weights to sum 1")
    capacity_factor: float | None = Field(
        None, gt=0, description="per-expert capacity per sequence, × S·k/E; None = dropless"
    )
    aux_loss_coef: float = Field(0.01, ge=0, description="Switch/GShard load-balancing loss")
    z_loss_coef: float = Field(0.0, ge=0, description="router z-loss (ST-MoE); 0 = off")
    bias_update_rate: float = Field(
        0.0, ge=0, description="DeepSeek-V3 auxiliary-loss-free bias step; 0 = off"
    )

    @model_validator(mode="after")
    def _routing_fits(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.first_dense_layers > self.n_layers:
            raise ValueError(
                f"first_dense_layers {self.first_dense_layers} exceeds n_layers {self.n_layers}"
            )
        return self

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return self.n_layers - self.first_dense_layers

    def _layer_params(self, *, experts: int) -> tuple[int, int]:
        """(dense block, MoE block) parameters when `experts` routed experts are counted."""
        attention = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.kv_heads)
        if self.qkv_bias:
            attention += self.head_dim * (self.n_heads + 2 * self.kv_heads)
        norms = 2 * self.dim
        expert = 3 * self.dim * self.expert_hidden_dim
        routed = experts * expert + self.num_experts * self.dim  # experts + router
        shared = self.num_shared_experts * expert
        dense_ffn = 3 * self.dim * self.hidden_dim
        return attention + norms + dense_ffn, attention + norms + routed + shared

    def _count(self, *, experts: int, exclude_embeddings: bool) -> int:
        dense, moe = self._layer_params(experts=experts)
        total = self.first_dense_layers * dense + self.num_moe_layers * moe
        total += self.dim + self.dim * self.vocab_size  # final norm, output projection
        return total if exclude_embeddings else total + self.vocab_size * self.dim

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Every parameter (all experts), from the shape alone."""
        return self._count(experts=self.num_experts, exclude_embeddings=exclude_embeddings)

    def num_active_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters one token uses: `top_k` routed experts (plus shared ones and the router)."""
        return self._count(experts=self.top_k, exclude_embeddings=exclude_embeddings)


def moe_flops_per_token(config: MoEConfig, seq_len: int) -> float:
    """Training FLOPs per token: `6·N_active + 6·L·H·d_head·T` (causal attention).

    `N_active` = parameters without the embedding table, counting `top_k` of the routed experts
    per MoE layer (each `3·dim·expert_hidden_dim`), the shared experts, the router (`E·dim`), the
    dense blocks' FFNs, attention, norms and the output projection: the work one token causes
    in the forward (2 FLOPs per weight) and backward (4). With a capacity factor, dropped
    assignments do less work; the formula counts the dropless figure.
    """
    return 6.0 * config.num_active_params(exclude_embeddings=True) + attention_flops_per_token(
        n_layers=config.n_layers, n_heads=config.n_heads, head_dim=config.head_dim, seq_len=seq_len
    )


def inject_loss(output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`output`, with `scale · loss` added to the objective its gradient flows back from."""
    return _ScaledInjectLoss.apply(output, loss, scale)


class _ScaledInjectLoss(torch.autograd.Function):
    """Identity on `output`; backward also gives `loss` the gradient `scale` (Megatron-Core's
    `MoEAuxLossAutoScaler`): the loss joins the objective wherever `output`'s gradient comes
    from. `scale` is the factor the engine applies to each micro-batch's loss (1 / count)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        loss_grad = torch.full(ctx.loss_shape, ctx.scale, dtype=torch.float32, device=grad.device)
        return grad, loss_grad, None


class GroupedExperts(UsesKernels):
    """`num_experts` SwiGLU experts as three stacked tensors, run with the `grouped_mm` op.

    `forward(x, counts)`: x (N, dim) holds the rows of expert 0, then expert 1, … (`counts[e]`
    rows each); returns (N, dim) in the same order. Expert parallelism keeps a slice of the
    experts (`first_expert` is the global index of row 0 of the tensors).
    """

    def __init__(
        self, num_experts: int, dim: int, hidden: int, *, kernels: Kernels | _KernelsHandle
    ) -> None:
        super().__init__(kernels)
        self.first_expert = 0
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensors the forward multiplies with (expert parallelism rescales their grads)."""
        return self.w1, self.w3, self.w2

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self.weights()
        grouped_mm = self.kernel("grouped_mm", x)
        gate, up = grouped_mm(x, w1, counts), grouped_mm(x, w3, counts)
        return grouped_mm(self.kernel("swiglu", gate)(gate, up), w2, counts)


class Router(nn.Module):
    """Linear scores over the experts, and the selection bias of loss-free balancing."""

    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoELayer(UsesKernels):
    """Router → top-k → (capacity) → grouped experts → gated combine, plus shared experts."""

    def __init__(self, config: MoEConfig, kernels: _KernelsHandle) -> None:
        super().__init__(kernels)
        self.config = config
        self.router = Router(config.dim, config.num_experts)
        self.experts = GroupedExperts(
            config.num_experts, config.dim, config.expert_hidden_dim, kernels=kernels
        )
        self.shared_experts = (
            FeedForward(
                config.dim, config.num_shared_experts * config.expert_hidden_dim, kernels=kernels
            )
            if config.num_shared_experts
            else None
        )
        # Assignments per expert (after drops) since the last bias update / report.
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts), persistent=False)
        # Assignments dropped over capacity since the last clear (reported with the loads).
        self.register_buffer("dropped_tokens", torch.zeros(()), persistent=False)
        self.balance_loss_scale = 1.0  # set per step by the runtime: 1 / micro-batches
        # The factor the engine's loss is multiplied by before backward (fp16 loss scaling),
        # set by the precision runtime: the injected balancing gradient is scaled alike.
        self.backward_loss_scale = 1.0
        self.last_balance_loss: torch.Tensor | None = None
        self.last_dropped: torch.Tensor | None = None  # assignments over capacity, last forward

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of `x` sorted by global expert id, `counts[e]` each → outputs, same order.
        Expert parallelism sets an instance attribute of this name."""
        return self.experts(x, counts)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs, chosen experts, gate weights) for logits (B, S, E)."""
        probs = logits.softmax(dim=-1)
        scores = probs + self.router.expert_bias if self.config.bias_update_rate else probs
        chosen = scores.topk(self.config.top_k, dim=-1).indices  # (B, S, k)
        gates = probs.gather(-1, chosen)
        if self.config.normalize_top_k:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return probs, chosen, gates

    def capacity(self, seq_len: int) -> int:
        cfg = self.config
        assert cfg.capacity_factor is not None
        return math.ceil(cfg.capacity_factor * seq_len * cfg.top_k / cfg.num_experts)

    def kept(self, chosen: torch.Tensor) -> torch.Tensor:
        """(B, S, k) mask of the assignments within capacity: per sequence and expert, choice
        slot 0 of every position first, then slot 1, …, earlier positions first."""
        if self.config.capacity_factor is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        batch, seq, k = chosen.shape
        order = chosen.transpose(1, 2).reshape(batch, k * seq)  # slot-major priority
        one_hot = F.one_hot(order, self.config.num_experts)
        rank_in_expert = (one_hot.cumsum(dim=1) * one_hot).sum(-1) - 1
        keep = rank_in_expert < self.capacity(seq)
        return keep.view(batch, k, seq).transpose(1, 2)

    def balance_loss(
        self, logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """Aux (Switch/GShard) + z-loss, per sequence, averaged over sequences."""
        cfg = self.config
        loss = logits.new_zeros(())
        if cfg.aux_loss_coef:
            batch, seq, _ = probs.shape
            counts = torch.zeros(batch, cfg.num_experts, device=probs.device)
            picks = chosen.flatten(1)
            counts.scatter_add_(1, picks, torch.ones_like(picks, dtype=counts.dtype))
            fraction = counts / (seq * cfg.top_k)
            mean_prob = probs.mean(dim=1)
            aux = cfg.num_experts * (fraction * mean_prob).sum(-1).mean()
            loss = loss + cfg.aux_loss_coef * aux
        if cfg.z_loss_coef:
            loss = loss + cfg.z_loss_coef * logits.logsumexp(-1).square().mean()
        return loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        cfg = self.config
        logits = self.router(x)  # (B, S, E) float32
        probs, chosen, gates = self.route(logits)
        keep = self.kept(chosen)
        # The kept assignments, sorted by expert (stable: token order within an expert).
        token = torch.arange(batch * seq, device=x.device).repeat_interleave(cfg.top_k)
        expert, gate = chosen.reshape(-1), gates.reshape(-1)
        mask = keep.reshape(-1)
        token, expert, gate = token[mask], expert[mask], gate[mask]
        order = expert.argsort(stable=True)
        token, expert, gate = token[order], expert[order], gate[order]
        counts = torch.bincount(expert, minlength=cfg.num_experts)
        with torch.no_grad():
            self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
            self.last_dropped = mask.numel() - mask.sum()
            self.dropped_tokens += self.last_dropped.to(self.dropped_tokens.dtype)
        flat = x.reshape(batch * seq, dim)
        routed = self.run_experts(flat.index_select(0, token), counts)
        weighted = routed * gate.unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add(0, token, weighted).view(batch, seq, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        balance = self.balance_loss(logits, probs, chosen)
        self.last_balance_loss = balance.detach()
        if balance.requires_grad:
            scale = self.balance_loss_scale * self.backward_loss_scale
            out = inject_loss(out, balance, scale)
        return out

    def routing_buffers(self) -> dict[str, torch.Tensor]:
        """Routing state no optimizer holds, by name under this layer, for checkpoints: the
        loss-free balancing bias when it is on (an HF Mixtral has no place for it)."""
        return (
            {"router.expert_bias": self.router.expert_bias} if self.config.bias_update_rate else {}
        )

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3: raise the bias of underloaded experts, lower it for overloaded ones."""
        if self.config.bias_update_rate:
            error = load.float().mean() - load.float()
            self.router.expert_bias += self.config.bias_update_rate * error.sign()


class MoEBlock(LlamaBlock):
    """The Llama block with `feed_forward` a `MoELayer` (or the dense SwiGLU of early blocks)."""

    def __init__(self, config: MoEConfig, kernels: _KernelsHandle, index: int) -> None:
        super().__init__(config, kernels)
        if config.is_moe_layer(index):
            self.feed_forward = MoELayer(config, kernels)  # type: ignore[assignment]


class MoE(Llama):
    """A MoE decoder with the Llama layout (`tok_embeddings`, `layers`, `norm`, `output`), so
    pipeline splitting, tensor-parallel attention and checkpoint naming work unchanged."""

    # Attention (and dense FFNs) are tensor-parallel; experts stay whole on every tp rank (the
    # plan's feed_forward entries match only the dense blocks' Linear modules).
    tp_plan: ClassVar[dict[str, str]] = dict(Llama.tp_plan)

    config: MoEConfig

    def __init__(self, config: MoEConfig, kernels: Kernels) -> None:
        super().__init__(config, kernels)
        handle = self._kernels_handle
        self.layers = nn.ModuleDict(
            {str(i): MoEBlock(config, handle, i) for i in range(config.n_layers)}
        )
        self._init_if_materialised()

    @torch.no_grad()
    def init_weights(self, *, seed: int) -> None:
        """As Llama's; an expert-parallel slice takes its rows of the full stacked tensor."""
        super().init_weights(seed=seed)
        residual_std = self.init_std / math.sqrt(2 * self.config.n_layers)
        for module_name, module in self.named_modules():
            if not isinstance(module, GroupedExperts):
                continue
            start = module.first_expert
            for leaf in ("w1", "w3", "w2"):
                param = getattr(module, leaf)
                name = normalised_name(f"{module_name}.{leaf}")
                shape = (self.config.num_experts, *param.shape[1:])
                std = residual_std if leaf == "w2" else self.init_std
                full = full_initial_value(shape, seed=seed, name=name, kind="normal", std=std)
                param.copy_(full[start : start + param.shape[0]])

    def init_buffers(self) -> None:
        """RoPE tables, and zeroed routing bias and load counters (after `to_empty`)."""
        super().init_buffers()
        for layer in self.moe_layers():
            layer.router.expert_bias.zero_()
            layer.tokens_per_expert.zero_()
            layer.dropped_tokens.zero_()

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]


def build_moe(config: MoEConfig, kernels: Kernels) -> MoE:
    return MoE(config, kernels)


__all__ = [
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "MoELayer",
    "Router",
    "build_moe",
    "inject_loss",
    "moe_flops_per_token",
]

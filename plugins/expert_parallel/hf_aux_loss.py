"""A `transformers` MoE model's load-balancing loss over every rank's tokens.

With `output_router_logits=True` a transformers MoE causal LM adds `router_aux_loss_coef ·
load_balancing_loss_func(router_logits, …)` to its loss: Switch's `E · Σ_e f_e · P_e`, where
`f_e` (the share of assignments routed to expert e) and `P_e` (its mean router probability)
are taken over *all* the tokens of the forward. It is not a mean of per-token terms, so the
ranks that split a micro-batch (dp, and cp's positions) each computing it over their own tokens
would not give the loss of the whole micro-batch. A forward hook on the model therefore takes
the router logits the model returns, gathers them (and the padding mask the loss weighs them
by) over the gradient group, recomputes the loss with the model's own
`load_balancing_loss_func` over them, and puts it in the output in place of the rank's own
(`loss` − coef · own + coef · whole; `aux_loss` = whole).

Gradients: every rank's loss carries the same whole-batch term and data parallelism averages
gradients over the group, so the term's gradient must reach each rank's router summed over
the ranks (backward of the gather: the group's sum of the gradient, this rank's rows), which
then averages back to exactly the gradient of one whole-batch term.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.core.comm import Comm, Group
from plait.core.comm_algorithms import MOE_AUX_LOSS
from plait.core.errors import PlaitError
from plait.core.transformers_models import model_kind


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward: the group's summed gradient, my rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.rows = comm, group, x.shape[0]
        out = x.new_empty(group.size * x.shape[0], *x.shape[1:])
        comm.all_gather(out, x.contiguous(), group=group, purpose=MOE_AUX_LOSS)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = grad.contiguous().clone()
        ctx.comm.all_reduce(total, group=ctx.group, op="sum", purpose=MOE_AUX_LOSS)
        me = ctx.group.rank_of(torch.distributed.get_rank())
        return total[me * ctx.rows : (me + 1) * ctx.rows], None, None


class WholeBatchLoadBalancingLoss:
    """Forward hook (with kwargs) of a `transformers` MoE causal LM; see the module docstring."""

    def __init__(self, model: nn.Module, *, comm: Comm, group: Group) -> None:
        self.comm, self.group = comm, group
        self.model_name = model_kind(model)
        module = sys.modules.get(type(model).__module__)
        self.loss_function: Callable[..., torch.Tensor] | None = getattr(
            module, "load_balancing_loss_func", None
        )
        self.coefficient = getattr(model, "router_aux_loss_coef", None)
        self.num_experts = getattr(model, "num_experts", None)
        self.top_k = getattr(model, "num_experts_per_tok", None)

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        del module, args
        own = getattr(output, "aux_loss", None)
        logits = getattr(output, "router_logits", None)
        if self.group.size == 1 or not isinstance(own, torch.Tensor) or not logits:
            return None
        if self.loss_function is None or None in (self.coefficient, self.num_experts, self.top_k):
            raise PlaitError(
                f"expert parallelism with {self.model_name} and output_router_logits: its "
                "load-balancing loss must cover every rank's tokens, which plait computes with "
                "the modeling module's load_balancing_loss_func and the model's "
                "router_aux_loss_coef, num_experts and num_experts_per_tok; this model lacks "
                "one of them. Train with output_router_logits = False"
            )
        rows = logits[0].shape[0]
        self._check_rows(rows, logits[0].device)
        gathered = tuple(_GatherRows.apply(layer, self.comm, self.group) for layer in logits)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            mask = _GatherRows.apply(mask.reshape(rows, -1), self.comm, self.group)
        whole = self.loss_function(gathered, self.num_experts, self.top_k, mask)
        if getattr(output, "loss", None) is not None:
            output.loss = output.loss + self.coefficient * (whole - own.to(whole.device))
        output.aux_loss = whole
        return output

    def _check_rows(self, rows: int, device: torch.device) -> None:
        """The gather needs every rank's micro-batch to have as many tokens: say so if not."""
        mine = torch.tensor([rows], dtype=torch.int64, device=device)
        every = mine.new_empty(self.group.size)
        self.comm.all_gather(every, mine, group=self.group, purpose=MOE_AUX_LOSS)
        if bool((every != rows).any()):
            raise PlaitError(
                f"expert parallelism with {self.model_name}: the ranks that share a micro-batch "
                f"hold different token counts ({every.tolist()}); its load-balancing loss over "
                "all of them needs equal micro-batch shapes on every data-parallel rank"
            )

"""The ep transform finds MoE layers whatever the Python version: their members live in an
`nn.Module`'s `_modules` and `_buffers`, which Python 3.12's runtime protocol check
(`inspect.getattr_static`) cannot see — there `isinstance(layer, MoELayerLike)` is False for
every layer, and ep refused plait's own MoE model on a Python 3.12 GPU node."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from plait.plugins.expert_parallel.runtime import is_moe_layer, moe_layers
from plait.plugins.models.moe import MoE, MoEConfig


def test_plait_moe_layers_are_found_though_their_members_are_not_static() -> None:
    model = MoE(MoEConfig.from_preset("tiny"), kernels=None)  # type: ignore[arg-type]
    found = moe_layers(model)
    assert [name for name, _ in found] == ["layers.0.feed_forward", "layers.1.feed_forward"]
    # What made the protocol check fail on 3.12: the experts are a submodule, not an attribute.
    assert inspect.getattr_static(found[0][1], "experts", None) is None


def test_a_module_missing_a_member_is_not_a_moe_layer() -> None:
    class Experts(nn.Module):
        first_expert = 0

    class Almost(nn.Module):
        balance_loss_scale = 1.0

        def __init__(self) -> None:
            super().__init__()
            self.experts = Experts()
            self.register_buffer("tokens_per_expert", torch.zeros(2))

        def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return x

    assert not is_moe_layer(Almost())  # no update_expert_bias
    Almost.update_expert_bias = lambda self, load: None  # type: ignore[attr-defined]
    assert is_moe_layer(Almost())
    del Experts.first_expert
    assert not is_moe_layer(Almost())

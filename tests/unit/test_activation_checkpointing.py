"""Activation checkpointing: gradients equal to none, the right blocks, the right recomputation."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from plait.core.errors import ConfigError
from plait.core.kernels import Kernels
from plait.plugins.activation_checkpointing import apply_activation_checkpointing
from plait.plugins.models import resolve_model_config
from plait.plugins.models.init import normalised_name

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that actually run (ops answered from a selective-checkpoint cache
    never reach this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Any] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def matmuls(self) -> int:
        return sum(self.counts[op] for op in MATMULS)


def _model(plugins: Any, family: str, n_layers: int = 2) -> nn.Module:
    config = resolve_model_config(family, "tiny", {"n_layers": n_layers, "max_seq_len": 16})
    torch.manual_seed(0)
    return plugins.model(family).build(config, Kernels(plugins))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], OpCounter]:
    """Loss, gradients by normalised name, and the ops run during backward."""
    inputs, targets = _tokens()
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    with OpCounter() as backward_ops:
        loss.backward()
    grads = {normalised_name(n): p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, backward_ops


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["full", "every", "selective"])
def test_checkpointed_gradients_equal_plain_gradients(plugins: Any, family: str, mode: str) -> None:
    plain = _model(plugins, family, n_layers=4)
    checkpointed = copy.deepcopy(plain)
    wrapped = apply_activation_checkpointing(checkpointed, mode=mode, every=2)
    assert wrapped == (["0", "2"] if mode == "every" else ["0", "1", "2", "3"])

    plain_loss, plain_grads, plain_ops = _grads(plain)
    loss, grads, ops = _grads(checkpointed)
    # The recomputed forward runs the same kernels on the same inputs: bit-identical results.
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    assert grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)

    # Backward of a Linear is two matmuls; recomputing a block adds its forward matmuls again,
    # selective checkpointing keeps those outputs and recomputes only the element-wise ops.
    if mode == "selective":
        assert ops.matmuls == plain_ops.matmuls
        assert sum(ops.counts.values()) > sum(plain_ops.counts.values())
    else:
        assert ops.matmuls > plain_ops.matmuls
    if mode == "every":
        _, _, full_ops = _grads(_full(plain))
        assert plain_ops.matmuls < ops.matmuls < full_ops.matmuls


def _full(model: nn.Module) -> nn.Module:
    copied = copy.deepcopy(model)
    copied.zero_grad(set_to_none=True)
    apply_activation_checkpointing(copied, mode="full")
    return copied


def test_state_dict_keys_survive_wrapping_and_load_both_ways(plugins: Any) -> None:
    plain = _model(plugins, "llama")
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, mode="full")
    assert all(isinstance(block, CheckpointWrapper) for block in checkpointed.layers.values())
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    # named_parameters carries the wrapper's component; normalised names match the plain model.
    names = [n for n, _ in checkpointed.named_parameters()]
    assert "layers.0._checkpoint_wrapped_module.attention.wq.weight" in names
    assert [normalised_name(n) for n in names] == [n for n, _ in plain.named_parameters()]
    fresh = _model(plugins, "llama")
    apply_activation_checkpointing(fresh, mode="full")
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    fresh.load_state_dict(plain.state_dict())
    torch.testing.assert_close(fresh.layers["1"].state_dict(), plain.layers["1"].state_dict())


def test_applying_twice_wraps_once_and_bad_settings_are_errors(plugins: Any) -> None:
    model = _model(plugins, "llama")
    assert apply_activation_checkpointing(model, mode="full") == ["0", "1"]
    assert apply_activation_checkpointing(model, mode="full") == []
    with pytest.raises(
        ConfigError, match=r"checkpoint\.blocks = 'blocks': Llama has nothing there"
    ):
        apply_activation_checkpointing(model, mode="full", blocks="blocks")
    with pytest.raises(ValueError, match="mode must be"):
        apply_activation_checkpointing(model, mode="sometimes")  # type: ignore[arg-type]

"""The state layout description in the core: the module's own layout, refinement by runtimes,
regions and pieces (single process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from plait.core.sharding import ParallelRuntime
from plait.core.state_layout import (
    LocalPiece,
    Region,
    StateLayout,
    describe_state,
    module_state_layout,
)


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._checkpoint_wrapped_module(x)


def _stepped() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(Wrapped())
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_module_layout_names_shapes_and_optimizer_state() -> None:
    model, optimizer = _stepped()
    layout = module_state_layout(model, optimizer, replicated_over=("dp",))
    entries = layout.by_name()
    assert sorted(entries) == ["0.bias", "0.weight"]  # wrapper component removed
    weight = entries["0.weight"]
    assert weight.value.global_shape == torch.Size([3, 4])
    assert weight.value.replicated_over == ("dp",) and weight.value.sharded_over == ()
    assert sorted(weight.optimizer_state) == ["exp_avg", "exp_avg_sq"]
    assert weight.step is not None and float(weight.step.get()) == 1.0
    weight.step.set(5)
    assert float(optimizer.state[weight.param]["step"]) == 5.0
    assert isinstance(optimizer.state[weight.param]["step"], torch.Tensor)


def test_runtimes_refine_in_order_and_the_default_changes_nothing() -> None:
    model, optimizer = _stepped()
    calls: list[str] = []

    class Renaming(ParallelRuntime):
        def state_layout(self, previous: StateLayout) -> StateLayout:
            calls.append("renaming")
            return previous.map(lambda e: None if e.name.endswith("bias") else e).then(
                lambda: calls.append("after_load")
            )

    mesh = SimpleNamespace(degrees={"pp": 1, "dp": 2, "tp": 1})
    layout = describe_state(model, optimizer, [ParallelRuntime(), Renaming()], mesh)  # type: ignore[arg-type]
    assert [e.name for e in layout.parameters] == ["0.weight"]
    assert layout.parameters[0].value.replicated_over == ("dp",)
    layout.finish_load()
    assert calls == ["renaming", "after_load"]


def test_regions_and_pieces() -> None:
    block = Region.whole((6, 4)).narrow(1, 2, 2)
    assert block == Region((0, 2), (6, 2)) and block.numel == 12
    flat = block.flat_range(3, 9)
    assert flat.numel == 6
    covered = sorted((r.offsets, r.sizes) for r in flat.rectangles())
    assert covered == [((1, 3), (1, 1)), ((2, 2), (2, 2)), ((4, 2), (1, 1))]
    assert sum(r.stop - r.start for r in flat.rectangles()) == 6
    with pytest.raises(ValueError, match="flat range"):
        flat.narrow(0, 0, 1)
    with pytest.raises(ValueError, match="either a tensor or a getter"):
        LocalPiece(block)
    with pytest.raises(ValueError, match="describes a region of 12"):
        LocalPiece(block, tensor=torch.zeros(5))
    store = {"value": torch.zeros(6, 2)}
    piece = LocalPiece(block, get=lambda: store["value"], set=lambda v: store.update(value=v))
    piece.write(torch.ones(6, 2))
    assert piece.read().sum() == 12

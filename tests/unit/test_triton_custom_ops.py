"""plait's Triton kernels under `torch.compile`, as the provider hands them out: as custom ops
each is one node, so a function calling them compiles as one graph (`fullgraph=True`) and
trains as the eager kernels do, and the compiler never traces the kernels' launch code."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._dynamo.utils import counters

from plait.plugins.kernels_triton.custom_ops import (
    bias_gelu,
    layer_norm,
    rms_norm,
    rope,
    softmax_cross_entropy,
    swiglu,
)
from tests.unit.triton_interpreter import interpreted_only

pytestmark = [
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    interpreted_only,
]


def block(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """Every covered op once, with plain torch code between them for the compiler to fuse."""
    h = swiglu(rms_norm(x, w, 1e-6), x) + 1
    h = bias_gelu(layer_norm(h, w, b, 1e-5), b) * 2
    h = rope(h.view(2, 8, 2, 32), cos, sin).reshape(16, 64)
    return softmax_cross_entropy(h, targets)


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=generator) for s in ((16, 64), (64,), (64,)))
    cos, sin = torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator)
    targets = torch.randint(0, 64, (16,), generator=generator)
    return [x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), cos, sin, targets]


def _loss_and_grads(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    inputs = _inputs()
    loss = fn(*inputs)
    (3 * loss).backward()  # an upstream gradient other than 1 reaches every backward
    return [loss.detach(), *(t.grad for t in inputs[:3])]


def test_a_block_of_triton_ops_compiles_as_one_graph_and_trains_as_eager() -> None:
    eager = _loss_and_grads(block)
    torch._dynamo.reset()
    breaks = sum(counters["graph_break"].values())
    # fullgraph: a graph break anywhere (a kernel's launch code traced) is an error.
    compiled = _loss_and_grads(torch.compile(block, fullgraph=True, backend="aot_eager"))
    assert sum(counters["graph_break"].values()) == breaks
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_graph_holds_one_node_per_kernel() -> None:
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def capture(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        graphs.append(graph)
        return graph.forward

    torch.compile(block, fullgraph=True, backend=capture)(*_inputs())
    (graph,) = graphs
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    ops = sorted(t.removeprefix("plait.") for t in targets if t.startswith("plait."))
    assert ops == sorted(
        ["rms_norm.default", "layer_norm.default", "swiglu.default", "bias_gelu.default",
         "rope.default", "softmax_cross_entropy.default"]
    ), targets  # fmt: skip

"""plait's Triton kernels under `torch.compile`, as the provider hands them out: as custom ops
each is one node, so a function calling them compiles as one graph (`fullgraph=True`) and
trains as the eager kernels do, and the compiler never traces the kernels' launch code."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._dynamo.utils import counters

from plait.plugins.kernels_triton.custom_ops import (
    attention,
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
    h = rope(h.view(2, 8, 2, 32), cos, sin)
    # (batch 2, heads 2, seq 8, head 32); two documents in the second row; the lse is used, so
    # both of its gradients reach the backward.
    heads = h.transpose(1, 2)
    ids = torch.tensor([[0] * 8, [0] * 3 + [1] * 5], dtype=torch.int32)
    out, lse = attention(heads, heads[:, :1], heads[:, 1:], return_lse=True, document_ids=ids)
    h = out.transpose(1, 2).reshape(16, 64)
    return softmax_cross_entropy(h, targets) + lse.mean()


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
         "rope.default", "attention.default", "softmax_cross_entropy.default"]
    ), targets  # fmt: skip


def test_attention_compiles_once_for_two_lengths_with_symbolic_shapes() -> None:
    """Under `dynamic=True` the op's fake implementation takes symbolic shapes: one graph, no
    break, for two sequence lengths, and the gradients of eager."""
    torch._dynamo.reset()

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, True).square().mean()

    frames = counters["stats"]["unique_graphs"]
    compiled = torch.compile(loss, dynamic=True, fullgraph=True, backend="aot_eager")
    generator = torch.Generator().manual_seed(3)
    for seq in (24, 40):
        q, k, v = (torch.randn(2, heads, seq, 16, generator=generator) for heads in (4, 2, 2))
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        eager = [t.clone().requires_grad_() for t in (q, k, v)]
        compiled(*ours).backward()
        loss(*eager).backward()
        for got, want in zip(ours, eager, strict=True):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - frames == 1

"""Rank functions for the compile transform tests (module level, so spawned ranks import them)."""

from __future__ import annotations

from typing import Any

import torch

from plait.core.engine import Engine
from plait.core.plugins import Plugins
from plait.plugins import activation_checkpointing, compile, ddp, pipeline, precision, zero
from plait.plugins.models.init import normalised_name
from tests.dist.precision_workers import GLOBAL_BATCH, SEQ, global_batches, local_share

COUNTING_BACKEND = "plait_test_counting"


class GraphCalls:
    """What the counting backend saw: graphs compiled and calls into them. A block that was
    compiled calls its graph on every forward, one that was not never does."""

    calls = 0
    graphs = 0


def counting_backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A torch.compile backend that runs the traced graph as is and counts its calls."""
    del example_inputs
    GraphCalls.graphs += 1

    def run(*args: Any) -> Any:
        GraphCalls.calls += 1
        return graph.forward(*args)

    return run


def _register_counting_backend() -> None:
    import torch._dynamo

    if COUNTING_BACKEND not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(counting_backend, name=COUNTING_BACKEND)


def make_engine(run: dict[str, Any], micro_batch: int, steps: int) -> Engine:
    transforms: dict[str, str] = {}
    config: dict[str, Any] = {
        "model": {"name": "llama", "size": "tiny",
                  "overrides": {"max_seq_len": SEQ, "n_layers": 2}},
        "data": {"seq_len": SEQ},
        "train": {"steps": steps, "global_batch_size": GLOBAL_BATCH,
                  "micro_batch_size": micro_batch, "max_grad_norm": 1.0, "seed": 0,
                  "device": "cpu"},
        "optimizer": {"lr": 1e-2, "warmup_steps": 2, "weight_decay": 0.0},
        "telemetry": {"enabled": False},
    }  # fmt: skip
    if run.get("compile") is not None:
        transforms["compile"] = compile.NAME
        config["compile"] = run["compile"]
    if run.get("amp") is not None:
        transforms["precision"] = precision.NAME
        config["amp"] = run["amp"]
    if run.get("checkpoint") is not None:
        transforms["ac"] = activation_checkpointing.NAME
        config["checkpoint"] = run["checkpoint"]
    config["parallel"] = {
        "transforms": transforms,
        "dp_strategy": run.get("dp", "ddp"),
        **run.get("parallel", {}),
    }
    if "schedule" in run:
        config["schedule"] = run["schedule"]
    if "tp" in run:
        config["tp"] = run["tp"]
    plugins = Plugins.create(
        autoload=False,
        extra=[("precision", precision), ("checkpointing", activation_checkpointing),
               ("compile", compile), ("ddp", ddp), ("zero", zero), ("pipeline", pipeline)],
    )  # fmt: skip
    return Engine(config=config, plugins=plugins)


def train(
    rank: int, world_size: int, runs: dict[str, dict[str, Any]], steps: int, micro_batch: int
) -> dict[str, Any]:
    """Train one tiny Llama per named run on the same data: losses, final parameters by name,
    and how often the blocks' compiled graphs ran."""
    _register_counting_backend()
    results: dict[str, Any] = {}
    for name, run in runs.items():
        torch._dynamo.reset()
        GraphCalls.calls = GraphCalls.graphs = 0
        engine = make_engine(run, micro_batch, steps)
        losses = [
            engine.train_step(local_share(batch, rank, world_size))
            for batch in global_batches(steps)
        ]
        results[name] = {
            "losses": losses,
            "params": {
                normalised_name(n): p.detach().float().clone()
                for n, p in engine.module.named_parameters()
            },
            "names": [n for n, _ in engine.module.named_parameters()],
            "graph_calls": GraphCalls.calls,
            "graphs": GraphCalls.graphs,
        }
        engine.close()
    return results


def train_hf(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """A `transformers` Llama through `plait.initialize`, eager and with its decoder layers
    compiled: losses, parameter names, the FLOPs plait counted, and the graph's calls."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import plait

    _register_counting_backend()
    tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    share = tokens.shape[0] // world_size
    mine = tokens[rank * share : (rank + 1) * share]
    results: dict[str, Any] = {}
    for name, transforms in (("eager", {}), ("compiled", {"compile": compile.NAME})):
        torch._dynamo.reset()
        GraphCalls.calls = GraphCalls.graphs = 0
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        )  # fmt: skip
        engine = plait.initialize(
            model,
            config={
                "parallel": {"transforms": transforms},
                "compile": {"backend": COUNTING_BACKEND},
                "telemetry": {"enabled": False},
                "train": {"device": "cpu"},
            },
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        )
        losses = [engine.train_step({"input_ids": mine, "labels": mine}) for _ in range(steps)]
        results[name] = {
            "losses": losses,
            "names": [n for n, _ in engine.module.named_parameters()],
            "flops_per_token": engine.flops_per_token,
            "graph_calls": GraphCalls.calls,
        }
        engine.close()
    return results


def assert_same_training(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Two runs' losses and parameters (by name) equal within 1e-4."""
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-4, atol=1e-4, msg=what
    )
    assert got["params"].keys() == want["params"].keys(), what
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-4, msg=name)

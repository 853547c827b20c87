"""Rank functions for the tensor-parallel tests (module level, so spawned ranks can import them).

Each rank function trains several configurations one after another in the same processes (one
spawn is the expensive part) and returns, per configuration, the losses and this rank's
gradients by parameter name, with the tensor dim each sharded gradient is split along.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.core.engine import Engine
from plait.core.errors import PlaitError
from plait.core.plugins import Plugins
from plait.plugins import tensor_parallel
from plait.plugins.tensor_parallel.layers import TP_DIM_ATTR

SEQ = 16
STEPS = 5
GLOBAL_BATCH = 4
MODELS: dict[str, dict[str, Any]] = {
    # 4 query heads sharing 2 KV heads: TP=2 splits KV heads, TP=4 replicates them.
    "llama": {"name": "llama", "size": "tiny", "overrides": {"n_kv_heads": 2}},
    "gpt2": {"name": "gpt2", "size": "tiny", "overrides": {}},
}


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the (synchronised, clipped) gradients it is given."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(list(params), lr=lr)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def plugins() -> Plugins:
    return Plugins.create(autoload=False, extra=[("tensor_parallel", tensor_parallel)])


def make_config(
    model: str, *, tp: int, dp: int, sequence_parallel: bool, micro_batch: int, seq: int = SEQ
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": MODELS[model],
        "parallel": {"tp": tp, "dp": dp},
        "train": {"micro_batch_size": micro_batch, "max_grad_norm": 1.0, "seed": 0},
        "data": {"seq_len": seq},
        "telemetry": {"enabled": False},
    }
    if tp > 1:
        config["tp"] = {"sequence_parallel": sequence_parallel}
    return config


def batches(vocab: int = 256, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=gen)
        stride = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=gen)
        tokens = (start + stride * torch.arange(SEQ + 1)) % vocab
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def train(model: str, *, tp: int, dp: int, sequence_parallel: bool) -> dict[str, Any]:
    """Five SGD steps; the global batch of 4 is split over dp, two micro-batches per rank."""
    share = GLOBAL_BATCH // dp
    holder: dict[str, RecordingSGD] = {}

    def make_optimizer(params: Any) -> RecordingSGD:
        holder["opt"] = RecordingSGD(params, lr=1.0)
        return holder["opt"]

    config = make_config(
        model, tp=tp, dp=dp, sequence_parallel=sequence_parallel, micro_batch=share // 2
    )
    engine = Engine(config=config, optimizer=make_optimizer, plugins=plugins())
    dp_rank = engine.mesh.coordinate("dp")
    losses = []
    for inputs, targets in batches():
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        losses.append(engine.train_step((inputs[rows], targets[rows])))
    names = {id(p): n for n, p in engine.module.named_parameters()}
    params = [p for g in holder["opt"].param_groups for p in g["params"]]
    grads = [
        {
            names[id(p)]: (g, getattr(p, TP_DIM_ATTR, None))
            for p, g in zip(params, seen, strict=True)
        }
        for seen in holder["opt"].seen
    ]
    return {"losses": losses, "grads": grads, "coords": engine.mesh.coordinates()}


def run_configs(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[Any]:
    """Train each configuration (`train`'s keyword arguments) in turn; errors are returned as
    (type name, message) when the configuration asks for `expect_error`."""
    del rank, world_size
    results: list[Any] = []
    for spec in configs:
        spec = dict(spec)
        if spec.pop("expect_error", False):
            results.append(_build_error(**spec))
        elif spec.pop("measure_activations", False):
            results.append(saved_activation_bytes(**spec))
        else:
            results.append(train(**spec))
    return results


def _build_error(model_overrides: dict[str, Any], tp: int, sequence_parallel: bool = False) -> Any:
    config = make_config(
        "llama", tp=tp, dp=1, sequence_parallel=sequence_parallel, micro_batch=2, seq=SEQ + 2
    )
    config["model"] = {**config["model"], "overrides": model_overrides}
    try:
        Engine(config=config, plugins=plugins())
    except PlaitError as exc:
        return (type(exc).__name__, str(exc))
    return None


def saved_activation_bytes(
    model: str, *, tp: int, sequence_parallel: bool, batch: int, seq: int, size: str = "tiny"
) -> int:
    """Bytes of the distinct tensors autograd saves for backward during one forward + loss on
    this rank, parameters excluded (measured with `saved_tensors_hooks`)."""
    config = make_config(model, tp=tp, dp=1, sequence_parallel=sequence_parallel, micro_batch=batch)
    config["model"] = {**config["model"], "size": size}
    config["data"] = {"seq_len": seq}
    engine = Engine(config=config, plugins=plugins())
    param_storages = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=gen)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = engine.module(tokens[:, :-1])
        loss = engine.loss_fn(logits, tokens[:, 1:])
    loss.backward()
    return sum(seen.values())

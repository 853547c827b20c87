"""Rank functions for the packed-rows tests: one step of each layout against every document alone.

Each configuration trains one step of a fresh model with plain SGD at learning rate 1, so a
parameter's step is exactly minus its gradient whatever the strategy holds (ZeRO's flat shards,
tensor-parallel slices, pipeline stages): the gradient is read back as `before − after` from
the parameters the ranks declare they hold (`hf_workers.global_parameters`, a checkpoint's
view). The reference is the plain model with every document run alone, the token losses summed
over the global batch's scored tokens, computed on each rank (the models are seeded alike).

The global batch is 4 packed rows; under data parallelism rank 0 holds rows 0–1 (mostly
padding, few scored tokens) and rank 1 rows 2–3 (full): the mean of the two ranks' means would
weigh rank 0's tokens ten times more than rank 1's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import plait
from plait.core.engine import Engine
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.plugins import tensor_parallel
from plait.plugins.models import Llama, resolve_model_config
from tests.dist import hf_workers

SEQ = 16
SEED = 3
LLAMA = {"max_seq_len": 32, "n_layers": 2}
# Document lengths per row (rows of SEQ; the rest of a row is padding, never scored).
LENGTHS = [[3, 1], [2], [16], [5, 11]]


def plugins() -> Plugins:
    return Plugins.create(autoload=False, extra=[("tensor_parallel", tensor_parallel)])


def documents(seed: int = 0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    # Token ids fit both models' vocabularies (plait's tiny Llama 256, the HF one 96).
    return [[torch.randint(1, 96, (n,), generator=generator) for n in row] for row in LENGTHS]


def plait_batch(docs: list[list[torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """plait's convention: targets -100 at each document's last token and on padding."""
    tokens = torch.zeros(len(docs), SEQ, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    targets = torch.full_like(tokens, -100)
    for row, row_docs in enumerate(docs):
        start = 0
        for document in row_docs:
            n = len(document)
            tokens[row, start : start + n] = document
            positions[row, start : start + n] = torch.arange(n)
            targets[row, start : start + n - 1] = document[1:]
            start += n
        positions[row, start:] = torch.arange(SEQ - start)
    return {"tokens": tokens, "positions": positions}, targets


def hf_batch(docs: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """transformers' convention (as `DataCollatorWithFlattening`): labels -100 at each
    document's first position, restarting position ids; padding is a segment of its own."""
    input_ids = torch.zeros(len(docs), SEQ, dtype=torch.long)
    position_ids = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, row_docs in enumerate(docs):
        start = 0
        for document in row_docs:
            n = len(document)
            input_ids[row, start : start + n] = document
            position_ids[row, start : start + n] = torch.arange(n)
            labels[row, start + 1 : start + n] = document[1:]
            start += n
        position_ids[row, start:] = torch.arange(SEQ - start)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def rows_of(batch: Any, rows: slice) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[rows]
    if isinstance(batch, dict):
        return {key: value[rows] for key, value in batch.items()}
    return tuple(rows_of(part, rows) for part in batch)


def plait_reference(docs: list[list[torch.Tensor]]) -> tuple[float, dict[str, torch.Tensor]]:
    config = resolve_model_config("llama", "tiny", LLAMA)
    model = Llama(config, Kernels(plugins()))  # type: ignore[arg-type]
    model.init_weights(seed=SEED)
    scored = sum(len(d) - 1 for row in docs for d in row)
    total = torch.zeros(())
    for row in docs:
        for document in row:
            if len(document) < 2:
                continue  # scores nothing
            logits = model(document[None, :-1])
            total = total + nn.functional.cross_entropy(
                logits.flatten(0, 1), document[1:], reduction="sum"
            )
    loss = total / scored
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def hf_reference(docs: list[list[torch.Tensor]]) -> tuple[float, dict[str, torch.Tensor]]:
    model = hf_workers.build("llama")
    scored = sum(len(d) - 1 for row in docs for d in row)
    total = torch.zeros(())
    for row in docs:
        for document in row:
            if len(document) > 1:
                ids = document[None]
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                total = total + loss * (len(document) - 1) / scored
    total.backward()
    return total.item(), {name: p.grad for name, p in model.named_parameters()}


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def one_step(engine: Engine, batch: Any, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One step on this rank's rows; the step's loss and each gradient's largest difference
    from the reference, read back as the parameters' change."""
    before = hf_workers.global_parameters(engine)
    dp, dp_rank = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
    share = 4 // dp
    loss = engine.train_step(rows_of(batch, slice(dp_rank * share, (dp_rank + 1) * share)))
    after = hf_workers.global_parameters(engine)
    differences = {
        name: ((before[name] - after[name]) - grad).abs().max().item()
        for name, grad in reference.items()
    }
    engine.close()
    return {"loss": loss, "grad_differences": differences, "held": sorted(after)}


def run(rank: int, world_size: int, layouts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every layout in turn on these ranks; its results next to the references."""
    del rank, world_size
    docs = documents()
    plait_loss, plait_grads = plait_reference(docs)
    hf_loss, hf_grads = hf_reference(docs)
    results: dict[str, Any] = {"plait_reference": plait_loss, "hf_reference": hf_loss}
    for name, layout in layouts.items():
        layout = copy.deepcopy(layout)
        family = layout.pop("family")
        config = {
            "data": {"seq_len": SEQ},
            "telemetry": {"enabled": False},
            **layout,
            "train": {"device": "cpu", "seed": SEED, **layout.get("train", {})},
        }
        if family == "llama":
            config["model"] = {"name": "llama", "size": "tiny", "overrides": LLAMA}
            engine = Engine(config=config, optimizer=sgd, plugins=plugins())
            results[name] = one_step(engine, plait_batch(docs), plait_grads)
        else:
            engine = plait.initialize(hf_workers.build("llama"), config=config, optimizer=sgd)
            results[name] = one_step(engine, hf_batch(docs), hf_grads)
    return results

"""Rank functions for the packed-rows context-parallel tests: plait's Llama and a transformers
`LlamaForCausalLM` (tiny, from a config) trained on packed rows under ring, Ulysses, hybrid and
cp × dp; a contamination probe (one document's tokens changed, every other document's logits
read back); and the negative control, attention handed no documents.

Every rank builds the same batches: rows of 32 tokens packing documents of lengths 1, 2 and
primes, one document spanning its row, documents whose boundaries fall exactly on the edges of
the cp shards, and trailing padding scored nowhere (-100).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait.core.documents import Documents
from plait.testing.distributed import VOCAB_SIZE, merged_config

SEQ, GLOBAL_BATCH, STEPS = 32, 4, 2
HF_VOCAB, LR = 96, 3e-3
IGNORE = -100
PADDING = 5  # trailing tokens of row 3, scored nowhere
# Document lengths per row (each row 32 tokens; row 3 ends with PADDING tokens of padding,
# packed as a document of their own that no label scores).
ROWS = (
    (1, 2, 3, 5, 7, 11, 3),
    (SEQ,),
    (8, 8, 4, 4, 8),  # boundaries on every shard edge of cp 2 (8) and cp 4 hybrid (4, 8)
    (13, 1, 1, 12, PADDING),
)
# The document the contamination probe rewrites: row 0's fifth (7 tokens, positions 11-17).
PROBE_ROW, PROBE_DOCUMENT = 0, 4


def packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS])


def document_spans(row: int) -> list[tuple[int, int]]:
    spans, start = [], 0
    for n in ROWS[row]:
        spans.append((start, start + n))
        start += n
    return spans


def packed_tokens(step: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=generator)


def next_token_targets(tokens: torch.Tensor) -> torch.Tensor:
    """Each token's target is the next token of its own document; a document's last token and
    the padding score nothing."""
    targets = torch.full_like(tokens, IGNORE)
    for row in range(GLOBAL_BATCH):
        for start, stop in document_spans(row):
            targets[row, start : stop - 1] = tokens[row, start + 1 : stop]
    targets[3, SEQ - PADDING - 1 :] = IGNORE
    return targets


def collator_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Labels as transformers' `DataCollatorWithFlattening` makes them: the tokens, with every
    document's first label -100 (and the padding's)."""
    labels = tokens.clone()
    for row in range(GLOBAL_BATCH):
        for start, _ in document_spans(row):
            labels[row, start] = IGNORE
    labels[3, SEQ - PADDING :] = IGNORE
    return labels


def plait_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    tokens = packed_tokens(step, VOCAB_SIZE)
    return {"tokens": tokens, "positions": packed_positions()}, next_token_targets(tokens)


def hf_batch(step: int) -> dict[str, torch.Tensor]:
    tokens = packed_tokens(step, HF_VOCAB)
    return {
        "input_ids": tokens,
        "labels": collator_labels(tokens),
        "position_ids": packed_positions(),
    }


def rows_of(batch: Any, dp: int, dp_size: int) -> Any:
    share = GLOBAL_BATCH // dp_size
    if isinstance(batch, tuple):
        return tuple(rows_of(part, dp, dp_size) for part in batch)
    if isinstance(batch, dict):
        return {k: rows_of(v, dp, dp_size) for k, v in batch.items()}
    return batch[dp * share : (dp + 1) * share]


@contextlib.contextmanager
def documents_dropped() -> Iterator[None]:
    """The negative control: context-parallel attention handed no documents (plain causal)."""
    from plait.plugins.context_parallel.attention import ContextParallelAttention

    original = ContextParallelAttention.__call__

    def blind(self: Any, q: Any, k: Any, v: Any, documents: Any = None) -> Any:
        del documents
        return original(self, q, k, v)

    ContextParallelAttention.__call__ = blind  # type: ignore[method-assign]
    try:
        yield
    finally:
        ContextParallelAttention.__call__ = original  # type: ignore[method-assign]


def build_hf_llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    # A training step holds no KV cache (plait turns it off too); with one, transformers would
    # not build the block-diagonal mask of packed rows.
    model.config.use_cache = False
    return model


def _gradients(engine: Any) -> dict[str, torch.Tensor]:
    from tests.dist.cp_workers import _gradient_pieces

    grads = {}
    for name, pieces in _gradient_pieces(engine).items():
        (slices, tensor), *_ = pieces
        assert all(o == 0 for o, _ in slices), (name, slices)  # cp / dp hold whole parameters
        grads[name] = tensor
    return grads


def _train(engine: Any, batches: list[Any]) -> dict[str, Any]:
    """Train over `batches` (this rank's dp share), recording each step's loss and gradients."""
    recorded: list[dict[str, torch.Tensor]] = []
    step_optimizer = engine.optimizer.step

    def record_then_step(*args: Any, **kwargs: Any) -> Any:
        recorded.append(_gradients(engine))
        return step_optimizer(*args, **kwargs)

    engine.optimizer.step = record_then_step
    dp, dp_size = engine.mesh.coordinate("dp"), engine.mesh.size("dp")
    losses = [engine.train_step(rows_of(batch, dp, dp_size)) for batch in batches]
    engine.optimizer.step = step_optimizer
    from plait.plugins.context_parallel import attention_work

    work = attention_work(engine.module)
    return {
        "losses": losses,
        "grads": recorded,
        "skipped_blocks": None if work is None else work.skipped,
    }


def _plait_engine(parallel: dict[str, Any]) -> Any:
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins

    config = merged_config(
        {
            "data": {"seq_len": SEQ},
            "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2},
            **({"parallel": parallel} if parallel else {}),
        }
    )
    return Engine(config=config, plugins=Plugins.create(autoload=False))


def _hf_engine(parallel: dict[str, Any]) -> Any:
    import plait
    from plait.core.plugins import Plugins

    config: dict[str, Any] = {
        "telemetry": {"enabled": False},
        "train": {"device": "cpu", "micro_batch_size": 2},
        **({"parallel": parallel} if parallel else {}),
    }
    return plait.initialize(
        build_hf_llama(),
        config=config,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
        plugins=Plugins.create(autoload=False),
    )


def hf_plain_loop() -> dict[str, Any]:
    """The transformers reference: the user's loop on one process over the whole batches
    (transformers masks the packed rows itself from their restarting position_ids)."""
    model = build_hf_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, grads = [], []
    for step in range(STEPS):
        loss = model(**hf_batch(step)).loss
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def plait_reference(rank: int, world_size: int) -> dict[str, Any]:
    """plait's Llama on one process, no context parallelism."""
    del rank, world_size
    engine = _plait_engine({})
    result = _train(engine, [plait_batch(step) for step in range(STEPS)])
    engine.close()
    return result


def run_cases(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case: {"model": "plait" | "hf", "parallel": {...}, "drop_documents": bool,
    "probe": bool}."""
    del rank, world_size
    results: dict[str, Any] = {}
    hf_reference: dict[str, Any] | None = None
    for name, case in cases.items():
        hf = case["model"] == "hf"
        if hf and hf_reference is None:
            hf_reference = hf_plain_loop()
        make = _hf_engine if hf else _plait_engine
        batches = [hf_batch(s) if hf else plait_batch(s) for s in range(STEPS)]
        drop = documents_dropped() if case.get("drop_documents") else contextlib.nullcontext()
        with drop:
            engine = make(copy.deepcopy(case["parallel"]))
            result = _train(engine, batches)
            if case.get("probe"):
                result["probe"] = contamination(engine, hf=hf)
        engine.close()
        if hf:
            result["reference"] = hf_reference
        results[name] = result
    return results


def contamination(engine: Any, *, hf: bool) -> dict[str, float]:
    """Logits of this rank's positions for a batch and for the same batch with one document's
    tokens changed: the largest change outside that document, and inside it."""
    cp = engine.context.context_parallel
    positions = cp.positions(SEQ)
    tokens = packed_tokens(0, HF_VOCAB if hf else VOCAB_SIZE)
    start, stop = document_spans(PROBE_ROW)[PROBE_DOCUMENT]
    changed = tokens.clone()
    changed[PROBE_ROW, start:stop] = (changed[PROBE_ROW, start:stop] + 1) % 7
    logits = [_logits(engine, t, hf=hf) for t in (tokens, changed)]
    difference = (logits[0] - logits[1]).abs().amax(-1)  # (rows, this rank's positions)
    inside = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.bool)
    inside[PROBE_ROW, start:stop] = True
    inside = inside.index_select(1, positions)
    return {
        "outside": difference[~inside].max().item(),
        "inside": difference[inside].max().item() if bool(inside.any()) else float("nan"),
    }


@torch.no_grad()
def _logits(engine: Any, tokens: torch.Tensor, *, hf: bool) -> torch.Tensor:
    cp = engine.context.context_parallel
    if hf:
        batch: dict[str, Any] = {"input_ids": tokens, "position_ids": packed_positions()}
        inputs, _ = cp.shard_microbatch(batch, None, SEQ)
        return engine.module(**inputs).logits
    positions = packed_positions()
    batch = {"tokens": tokens, "positions": positions}
    batch["documents"] = Documents.from_positions(positions)
    return engine.module(**cp.shard_batch(batch, SEQ))

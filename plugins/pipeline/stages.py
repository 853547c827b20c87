"""Pipeline stages of models plait did not write: the stage module contract and its pieces.

A built-in model is cut by copying it and dropping the other stages' layers (`split.build_chunk`);
its forward already skips missing parts. A user's or a `transformers` model cannot be edited that
way, so each stage is a `ModelStage`: a module that holds only this stage's pieces of the model
(the very same module objects, not copies) under their names in the full model, so parameter
names, checkpoints and HF export stay the model's own. The runtime calls it as
`stage(hidden, batch)`: `hidden` is the received activation (`None` on the first stage) and
`batch` the micro-batch's model inputs (`StepState.inputs[mb]`), from which every stage
recomputes what the model's top-level forward derives for its blocks (positions, masks) and the
last stage reads its labels.

A built-in model's chunk is called as `chunk(tokens_or_hidden, positions=…, documents=…)`:
`ChunkInputs` reads a micro-batch's inputs once, so that packed rows' positions and `Documents`
(computed on whole rows by the engine) reach the attention of every stage, not the first alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.core.documents import Documents
from plait.core.errors import PlaitError

# The keyword inputs of a built-in model's forward (`tokens`, `positions`, `documents`).
CHUNK_INPUT_KEYS = ("tokens", "positions", "documents")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageParts:
    """The pieces of a model one stage holds, each as (name in the full model, module)."""

    before: tuple[tuple[str, nn.Module], ...]  # embeddings: the first stage only
    blocks: tuple[tuple[str, nn.Module], ...]  # a contiguous run of the repeated blocks
    after: tuple[tuple[str, nn.Module], ...]  # final norm and head: the last stage only
    shared: tuple[tuple[str, nn.Module], ...] = ()  # parameter-free helpers every stage needs
    first: bool  # global stage 0: its input is the micro-batch
    last: bool  # the last global stage: it returns the model's output


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkInputs:
    """A micro-batch's inputs as every chunk of a built-in model takes them: the token ids
    (the first stage's input), and the positions and documents of packed rows, which each
    stage's attention needs while only hidden states cross a stage boundary."""

    tokens: Any  # token ids [micro_batch, seq], or the micro-batch itself when not a dict
    positions: torch.Tensor | None = None  # (rows, seq), restarting per document
    documents: Documents | None = None

    @classmethod
    def of(cls, batch: Any) -> ChunkInputs:
        """From the engine's micro-batch inputs: a tensor of token ids, or a dict of
        `CHUNK_INPUT_KEYS` (what the engine makes of a packed batch)."""
        if not isinstance(batch, Mapping):
            return cls(tokens=batch)
        unknown = sorted(set(batch) - set(CHUNK_INPUT_KEYS))
        if unknown or "tokens" not in batch:
            raise PlaitError(
                f"a pipelined built-in model takes micro-batch inputs {list(CHUNK_INPUT_KEYS)} "
                f"(tokens required); got {sorted(batch)}"
            )
        return cls(
            tokens=batch["tokens"],
            positions=batch.get("positions"),
            documents=batch.get("documents"),
        )

    def keywords(self) -> dict[str, Any]:
        """`positions=` / `documents=` for a chunk's forward, those the micro-batch has."""
        given = {"positions": self.positions, "documents": self.documents}
        return {key: value for key, value in given.items() if value is not None}


def attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` under dotted `path` of `root`, creating empty parents on the way, so
    `root.named_parameters()` yields the names the full model gives them."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, module)


class ModelStage(nn.Module):
    """One pipeline stage of a model: `forward(hidden, batch)` → hidden states, or on the last
    stage the model's output (a loss-carrying output, or logits for the engine's loss)."""

    def __init__(self, model: nn.Module, parts: StageParts) -> None:
        super().__init__()
        self.parts = parts
        # The full model stays reachable for its config and loss function, but is not a
        # submodule: this stage's parameters are only its own pieces.
        self._model_ref: tuple[nn.Module, ...] = (model,)
        for name, module in (*parts.before, *parts.blocks, *parts.after, *parts.shared):
            attach(self, name, module)

    @property
    def full_model(self) -> nn.Module:
        return self._model_ref[0]

    def forward(self, hidden: torch.Tensor | None, batch: Any) -> Any:
        raise NotImplementedError


class ChainStage(ModelStage):
    """A stage of a model whose forward is a plain chain `x = module(x)` (embed → blocks →
    head): it runs its own run of that chain. The first stage's input is the micro-batch itself."""

    def forward(self, hidden: torch.Tensor | None, batch: Any) -> Any:
        x = batch if hidden is None else hidden
        for _, module in (*self.parts.before, *self.parts.blocks, *self.parts.after):
            x = module(x)
        return x


def modules_of(parts: StageParts) -> Sequence[nn.Module]:
    return [m for _, m in (*parts.before, *parts.blocks, *parts.after, *parts.shared)]

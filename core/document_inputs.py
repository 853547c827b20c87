"""How a model takes packed rows: their `Documents` handed to it, left to the model, or refused.

The engine reads each micro-batch's documents from its whole rows, before anything cuts them
(`plait.core.documents`), and asks the model's `ModelInputs` what the model is given. A plugin
that knows a kind of model answers for it (`plait_model_inputs`: the huggingface plugin for
`transformers` models, which mask packed rows themselves); any other model gets
`DocumentInputs`:

- a model whose forward takes `documents=` (plait's own) gets them beside its `positions`;
- any other model is refused by name when a batch holds packed rows: trained as it is, every
  token would attend to the documents before it.

`loss_counting` says which tokens the model's default loss is a mean over, for the token-weighted
step loss (`plait.core.token_loss`); `attention_square` gives the Σ nᵢ² the FLOPs count.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from plait.core.batches import input_tokens
from plait.core.documents import documents_of
from plait.core.errors import PlaitError
from plait.core.token_loss import LossCounting
from plait.core.transformers_models import is_transformers_model, model_kind

# How a model takes packed rows (`DocumentInputs.mode`); any other mode is why it cannot.
TAKES_DOCUMENTS = "documents"


class ModelInputs(Protocol):
    """What a model is given of packed rows, decided once from the model before it is sharded."""

    def prepare(self, inputs: Any) -> Any:
        """A micro-batch as the model takes it; packed rows it cannot honour are refused."""
        ...

    def loss_counting(self, model: nn.Module) -> LossCounting:
        """Which tokens the model's default loss is a mean over, known before the first step."""
        ...


def packed_rows_refused(problem: str, *, instead: str = "") -> PlaitError:
    """The refusal of a batch of packed rows a model would not mask: `problem` says why,
    `instead` (ending in ", ") what else a user may do besides the two ways any model has."""
    return PlaitError(
        f"the batch holds packed documents (position ids that restart at 0 inside a row), "
        f"but {problem}: it would train every token on the documents before it. Give the "
        "model a `documents=` argument (plait.core.documents.Documents) and pass it to its "
        f"attention, {instead}or send one document per row"
    )


@dataclass(frozen=True, slots=True)
class DocumentInputs:
    """How a model no plugin answers for takes packed rows."""

    mode: str  # TAKES_DOCUMENTS, or why the model cannot take packed rows

    @classmethod
    def of(cls, model: nn.Module) -> DocumentInputs:
        """`"documents"` when the model's forward has a `documents=` argument (as plait's
        models do), else why it cannot take packed rows (they are then refused)."""
        if is_transformers_model(model):
            # Its loss and its packed rows are the huggingface plugin's to read: without it,
            # the step's loss would silently weigh tokens differently.
            raise PlaitError(
                f"{model_kind(model)} is a transformers model, which plait takes through its "
                "huggingface plugin, and that plugin is switched off (plugins.disable or "
                "PLAIT_DISABLE_PLUGINS); switch it back on"
            )
        try:
            parameters = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            parameters = {}
        if "documents" in parameters:
            return cls(mode=TAKES_DOCUMENTS)
        return cls(
            mode=f"{type(model).__name__}.forward takes no documents= argument to mask "
            "attention with"
        )

    def prepare(self, inputs: Any) -> Any:
        """A micro-batch of packed rows (position ids that restart) with its `Documents` added
        for a model that takes them; a model that cannot honour them is refused by name."""
        documents = documents_of(inputs)
        if documents is None:
            if self.mode == TAKES_DOCUMENTS and _plain_positions(inputs):
                # Rows of one sequence each (a packed sampler's row inside one document): their
                # positions are the default ones, dropped so that the piece context parallelism
                # cuts from them is not read as documents restarting.
                return {key: value for key, value in inputs.items() if key != "positions"}
            return inputs
        if self.mode == TAKES_DOCUMENTS:
            return {**inputs, "documents": documents}
        raise packed_rows_refused(self.mode)

    def loss_counting(self, model: nn.Module) -> LossCounting:
        """plait's models return logits, scored by plait's token cross-entropy against the
        targets; any other model may return a loss of its own kind: its steps stay a mean of
        micro-batch losses."""
        del model
        return "targets" if self.mode == TAKES_DOCUMENTS else None


def _plain_positions(inputs: Any) -> bool:
    """Whether a micro-batch carries `positions` (rows, seq) that are 0 … seq − 1 on every row."""
    positions = inputs.get("positions") if isinstance(inputs, Mapping) else None
    return isinstance(positions, torch.Tensor) and positions.ndim == 2


def attention_square(microbatch: Any) -> tuple[int, bool]:
    """Σ nᵢ² over a micro-batch's documents (a row of one sequence counts T²), and whether it
    holds packed rows."""
    documents = microbatch.get("documents") if isinstance(microbatch, Mapping) else None
    if documents is None:
        documents = documents_of(microbatch)
    if documents is None:
        tokens = input_tokens(microbatch)
        return tokens.shape[0] * tokens.shape[-1] ** 2, False
    return int((documents.lengths() ** 2).sum()), True

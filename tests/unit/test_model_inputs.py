"""What a model is given of packed rows is decided by whoever knows the model: a plugin answering
`plait_model_inputs` (the huggingface plugin for `transformers` models, a third party's for its
own), else the core — documents for a forward that takes `documents=`, a refusal by name for any
other. A `transformers` model with the huggingface plugin switched off is refused at once rather
than trained with a loss weighed another way."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

import plait
from plait.core.documents import Documents
from plait.core.errors import PlaitError
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins

VOCAB = 32
CONFIG = {"train": {"device": "cpu", "seed": 0}, "telemetry": {"enabled": False}}
# Two rows of 8 tokens: documents of 3 and 5 tokens, then one of 8.
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))])


class TokenModel(nn.Module):
    """Logits from token ids; keeps what its forward was handed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)
        self.handed: list[dict[str, Any]] = []

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        self.handed.append({"positions": positions})
        return self.head(self.embed(tokens))


class DocumentModel(TokenModel):
    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        self.handed.append({"positions": positions, "documents": documents})
        return self.head(self.embed(tokens))


class SegmentModel(TokenModel):
    """A third party's model that takes document ids under a name of its own."""

    def forward(  # type: ignore[override]
        self, tokens: torch.Tensor, segments: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.handed.append({"segments": segments})
        return self.head(self.embed(tokens))


class SegmentInputs:
    def prepare(self, inputs: Any) -> Any:
        positions = inputs.pop("positions")
        # A document starts where the position restarts at 0.
        return {**inputs, "segments": (positions == 0).long().cumsum(dim=1) - 1}

    def loss_counting(self, model: nn.Module) -> str:
        return "targets"


class SegmentPlugin:
    @hookimpl
    def plait_model_inputs(self, model: nn.Module) -> SegmentInputs | None:
        return SegmentInputs() if isinstance(model, SegmentModel) else None


def packed_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=generator)
    targets = torch.randint(0, VOCAB, (2, 8), generator=generator)
    return {"tokens": tokens, "positions": POSITIONS}, targets


def assert_segments_handed(plugins: Plugins) -> None:
    """A `SegmentModel` trained on the packed batch was handed its document ids by `plugins`."""
    model = SegmentModel()
    engine = plait.initialize(model, config=CONFIG, plugins=plugins)
    engine.train_step(packed_batch())
    (handed,) = model.handed
    assert handed["segments"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8]
    engine.close()


def test_a_model_whose_forward_takes_documents_gets_them() -> None:
    model = DocumentModel()
    engine = plait.initialize(model, config=CONFIG)
    engine.train_step(packed_batch())
    (handed,) = model.handed
    assert handed["documents"].lengths().tolist() == [3, 5, 8]
    engine.close()


def test_any_other_model_is_refused_packed_rows_by_name() -> None:
    model = TokenModel()
    engine = plait.initialize(model, config=CONFIG)
    with pytest.raises(PlaitError, match=r"TokenModel\.forward takes no documents= argument"):
        engine.train_step(packed_batch())
    assert model.handed == []  # refused before the forward
    # Rows of one sequence each still train.
    inputs, targets = packed_batch()
    plain = {"tokens": inputs["tokens"], "positions": torch.arange(8).expand(2, 8)}
    assert torch.isfinite(torch.tensor(engine.train_step((plain, targets))))
    engine.close()


def test_a_plugin_that_knows_the_model_says_what_it_is_given() -> None:
    plugins = Plugins.create()
    plugins.register(SegmentPlugin(), "segments")
    assert_segments_handed(plugins)


def test_a_transformers_model_without_the_huggingface_plugin_is_refused_at_once() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    disabled = {**CONFIG, "plugins": {"disable": ["huggingface"]}}
    with pytest.raises(PlaitError, match="huggingface plugin, and that plugin is switched off"):
        plait.initialize(model, config=disabled)


def test_the_docs_example_answers_for_its_model() -> None:
    """docs/plugins.md's `plait_model_inputs` example, run as written."""
    from tests.doc_blocks import page, python_blocks

    (block,) = [b for b in python_blocks(page("plugins.md")) if "def plait_model_inputs" in b]
    module = types.ModuleType("segment_plugin")
    module.MySegmentModel = SegmentModel  # type: ignore[attr-defined]
    exec(compile(block, "docs/plugins.md", "exec"), module.__dict__)
    plugins = Plugins.create()
    plugins.register(module, "segments")
    assert_segments_handed(plugins)

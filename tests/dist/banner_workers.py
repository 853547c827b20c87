"""Rank side of the banner test: the parameter figures `plait train` prints, under ZeRO-3."""

from __future__ import annotations

from typing import Any

import torch

from plait.core.engine import Engine
from plait.core.plugins import Plugins
from plait.core.state_chunks import layout_for
from plait.training.banner import parameters_text


def zero3_parameter_figures(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = Engine(
        config={
            "model": {
                "name": "llama",
                "size": "tiny",
                "overrides": {"dim": 32, "n_heads": 2, "n_kv_heads": 1},
            },
            "parallel": {"dp_strategy": "zero3"},
            "train": {"micro_batch_size": 2, "global_batch_size": 4, "seed": 0},
            "telemetry": {"enabled": False},
            "data": {"seq_len": 16},
        },
        plugins=Plugins.create(autoload=False),
    )
    layout = layout_for(engine)
    return {
        "text": parameters_text(layout, pp=engine.mesh.size("pp")),
        "module_count": sum(p.numel() for p in engine.module.parameters()),
        "held": sum(entry.value.numel() for entry in layout.parameters),
    }

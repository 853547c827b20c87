"""Rank functions for the HF family tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.core.engine import Engine

GPT2 = {"name": "gpt2", "size": "tiny", "overrides": {"dim": 32, "n_heads": 4, "max_seq_len": 32}}


def _config(parallel: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": GPT2,
        "data": {"seq_len": 16},
        "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 2, "seed": 3,
                  "device": "cpu"},
        "parallel": parallel,
        "telemetry": {"enabled": False},
    }  # fmt: skip


def gpt2_through_tp2_and_zero2(rank: int, world_size: int, hf_dir: str, out_dir: str) -> Any:
    """A 2-way tensor-parallel GPT-2 loads a transformers folder (each rank reads its heads'
    blocks of the fused, transposed c_attn) and exports it again; a ZeRO-2 job (flat ranges of
    every tensor) loads the same folder. Returns the ZeRO-2 job's parameters."""
    del rank, world_size
    from plait.plugins.huggingface.weights import export_hf_from, load_hf_into

    tp = Engine(config=_config({"tp": 2}))
    local = {name: p.shape for name, p in tp.module.named_parameters()}
    load_hf_into(tp, Path(hf_dir))
    export_hf_from(tp, Path(out_dir))
    tp.close()
    zero = Engine(config=_config({"dp_strategy": "zero2"}))
    load_hf_into(zero, Path(hf_dir))
    after = {name: p.detach().clone() for name, p in zero.module.named_parameters()}
    zero.close()
    return {"tp_local_shapes": local, "zero2": after}

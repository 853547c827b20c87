"""Hugging Face interop for Llama weights: plait checkpoint <-> safetensors in HF naming.

HF's `LlamaForCausalLM` applies rotary embeddings in the "rotate_half" convention (the first
half of each head against the second), as plait's `rope` kernel does, with the same frequencies
(`theta^(-2i/head_dim)`), so q/k projections map across unchanged. (Meta's original checkpoints
rotate interleaved pairs, which is why HF's conversion script permutes wq/wk; weights that are
already in HF layout need no permutation.) The round-trip test checks logits, not just names.

A running job exports and imports through the state layout its strategies declare
(`plait.core.state_layout`), whatever they are: `export_hf_from` writes each rank's pieces of the
weights (replicas once) and assembles them on rank 0; `load_hf_into` has every rank read from
the safetensors files only the regions it holds.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import torch

from plait.plugins.checkpoint.layout import (
    Staging,
    first_replica,
    layout_for,
    region_chunks,
    tensor_pieces,
)
from plait.plugins.checkpoint.storage import CheckpointError

# plait name pattern -> HF name pattern (layer index as {i}).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PLAIT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def plait_to_hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _PLAIT_LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise CheckpointError(f"parameter {name!r} has no Hugging Face Llama name")


def hf_to_plait_name(name: str) -> str | None:
    """The plait name of an HF tensor, or None for tensors plait does not hold (rotary caches)."""
    for plait_name, hf_name in _TOP_NAMES.items():
        if name == hf_name:
            return plait_name
    match = _HF_LAYER.match(name)
    if match:
        for plait_suffix, hf_suffix in _LAYER_NAMES.items():
            if match.group(2) == hf_suffix:
                return f"layers.{match.group(1)}.{plait_suffix}"
        if match.group(2) == "self_attn.rotary_emb.inv_freq":
            return None
    raise CheckpointError(f"tensor {name!r} is not part of a Hugging Face Llama checkpoint")


def hf_config(model: dict[str, Any]) -> dict[str, Any]:
    """`config.json` for `LlamaForCausalLM` from a resolved plait Llama config (as a dict)."""
    dim, n_heads = model["dim"], model["n_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": model["hidden_dim"],
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": model.get("n_kv_heads") or n_heads,
        "head_dim": dim // n_heads,
        "vocab_size": model["vocab_size"],
        "max_position_embeddings": model["max_seq_len"],
        "rms_norm_eps": model["norm_eps"],
        "rope_theta": model["rope_theta"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def plait_model_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """plait Llama config fields from an HF `config.json`."""
    if config.get("model_type") != "llama":
        raise CheckpointError(f"config.json has model_type {config.get('model_type')!r}, not llama")
    if config.get("tie_word_embeddings"):
        raise CheckpointError("tied input/output embeddings are not supported by plait's Llama")
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "ffn_hidden_dim": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "max_seq_len": config.get("max_position_embeddings", 2048),
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": config.get("rope_theta", 10000.0),
    }


def export_hf(weights: dict[str, torch.Tensor], model: dict[str, Any], out_dir: Path) -> Path:
    """Write `model.safetensors` and `config.json` for plait Llama `weights` (full tensors)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {plait_to_hf_name(k): v.detach().contiguous().cpu() for k, v in weights.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(model), indent=2) + "\n")
    return out_dir


def import_hf(hf_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read HF Llama safetensors (one file or shards) from a local directory.

    Returns plait-named weights and the plait model overrides from `config.json`.
    """
    from safetensors.torch import load_file

    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{hf_dir} has no config.json")
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for hf_name, tensor in load_file(str(file)).items():
            name = hf_to_plait_name(hf_name)
            if name is not None:
                weights[name] = tensor
    return weights, plait_model_overrides(json.loads(config_path.read_text()))


def model_fields(model_config: Any) -> dict[str, Any]:
    """The fields `hf_config` reads, from a resolved Llama config object."""
    return {**model_config.model_dump(), "hidden_dim": model_config.hidden_dim}


def export_hf_from(engine: Any, out_dir: Path, *, process_group: Any = None) -> Path:
    """Write a running Llama job's weights as HF safetensors, however they are sharded.

    Collective: every rank writes the pieces its strategies declare (DCP, replicas once) into a
    staging directory under `out_dir`, which must be shared by the ranks; rank 0 reads them
    back whole and writes `model.safetensors` and `config.json`.
    """
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from plait.plugins.checkpoint.planner import ChunkedValue, ChunkSavePlanner

    staging = out_dir / ".plait-export"
    is_writer = first_replica(engine)
    state = {
        name: ChunkedValue(tensor_pieces(entry.value, is_writer=is_writer))
        for name, entry in layout_for(engine).by_name().items()
    }
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(staging, single_file_per_rank=True),
        planner=ChunkSavePlanner(),
        process_group=process_group,
    )
    if engine.mesh.rank == 0:
        from plait.plugins.checkpoint.offline import read_tensors

        export_hf(read_tensors(staging), model_fields(engine.model_config), out_dir)
        shutil.rmtree(staging)
    if dist.is_initialized():
        dist.barrier(group=process_group)
    return out_dir


@torch.no_grad()
def load_hf_into(engine: Any, hf_dir: Path) -> int:
    """Load HF Llama safetensors into a running job in place; each rank reads only the regions
    of each tensor that its strategies declare it holds. Returns the number of tensors."""
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir} has no *.safetensors files")
    layout = layout_for(engine)
    entries = layout.by_name()
    staging = Staging()
    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for hf_name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                where[hf_name] = handle
        for name, entry in entries.items():
            hf_name = plait_to_hf_name(name)
            if hf_name not in where:
                raise CheckpointError(f"{hf_dir} has no tensor {hf_name!r} (for {name!r})")
            source = where[hf_name].get_slice(hf_name)
            if tuple(source.get_shape()) != tuple(entry.value.global_shape):
                raise CheckpointError(
                    f"{hf_name}: shape {tuple(source.get_shape())} in {hf_dir}, this model has "
                    f"{tuple(entry.value.global_shape)}"
                )
            for piece in entry.value.pieces:
                for chunk in region_chunks(piece.region, staging.storage(piece)):
                    index = tuple(
                        slice(o, o + n)
                        for o, n in zip(chunk.offsets, chunk.tensor.shape, strict=True)
                    )
                    chunk.tensor.copy_(source[index])
    staging.write_back()
    layout.finish_load()
    return len(entries)

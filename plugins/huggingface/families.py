"""Hugging Face model families as plait's built-in models hold them: names, layouts, config.json.

| HF `model_type` | HF class               | plait model                    |
|-----------------|------------------------|--------------------------------|
| `llama`         | `LlamaForCausalLM`     | `llama`                        |
| `mistral`       | `MistralForCausalLM`   | `llama` (no sliding window)    |
| `qwen2`         | `Qwen2ForCausalLM`     | `llama` with `qkv_bias = true` |
| `gpt2`          | `GPT2LMHeadModel`      | `gpt2`                         |

A family is one table of name rules used in both directions. A rule places a plait tensor in an
HF tensor, possibly transposed (GPT-2's `Conv1D` stores weights as [in, out], plait's `Linear`
as [out, in]) and possibly as one of several equal blocks of its last dim (GPT-2's fused
`c_attn` holds q, k and v side by side). Reading a block of a plait tensor therefore reads a
block of the HF one, so a sharded job can load only what it holds.

plait's models keep untied input and output embeddings. An HF checkpoint with tied ones stores
only the embedding; importing it copies the embedding into plait's output matrix (same logits,
trained untied from then on). Exports are always untied (`tie_word_embeddings: false`).

Llama-style attention maps across unchanged: HF applies rotary embeddings in the "rotate_half"
convention with frequencies `theta^(-2i/head_dim)`, as plait's `rope` kernel does. (Meta's
original checkpoints rotate interleaved pairs, which is why HF's conversion script permutes
wq/wk; weights already in HF layout need no permutation.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.core.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one plait tensor lives in an HF checkpoint: in tensor `hf_name`, transposed or not,
    as block `part` of `parts` equal blocks of the HF tensor's last dim."""

    hf_name: str
    transpose: bool = False
    part: int = 0
    parts: int = 1

    def hf_index(self, plait_index: Sequence[slice], hf_shape: Sequence[int]) -> tuple[slice, ...]:
        """The block of the HF tensor that holds `plait_index` (slices with start and stop)."""
        index = tuple(reversed(plait_index)) if self.transpose else tuple(plait_index)
        if self.parts == 1:
            return index
        shift = self.part * (hf_shape[-1] // self.parts)
        last = index[-1]
        return (*index[:-1], slice(shift + last.start, shift + last.stop))

    def plait_shape(self, hf_shape: Sequence[int]) -> tuple[int, ...]:
        shape = (*hf_shape[:-1], hf_shape[-1] // self.parts)
        return tuple(reversed(shape)) if self.transpose else shape

    def read(self, source: Any, hf_shape: Sequence[int], plait_index: Sequence[slice]) -> Any:
        """`plait_index` of the plait tensor, from `source` (a tensor or a safetensors slice)."""
        block = source[self.hf_index(plait_index, hf_shape)]
        return block.T if self.transpose else block

    def extract(self, hf_tensor: torch.Tensor) -> torch.Tensor:
        """The whole plait tensor out of its HF tensor."""
        whole = [slice(0, n) for n in self.plait_shape(hf_tensor.shape)]
        return self.read(hf_tensor, hf_tensor.shape, whole).contiguous()


def merge(hf_name: str, placed: list[tuple[Slot, torch.Tensor]]) -> torch.Tensor:
    """The HF tensor `hf_name` from every plait tensor placed in it."""
    placed = sorted(placed, key=lambda item: item[0].part)
    parts = placed[0][0].parts
    if [slot.part for slot, _ in placed] != list(range(parts)):
        raise CheckpointError(f"{hf_name}: got parts {[s.part for s, _ in placed]} of {parts}")
    blocks = [(t.T if slot.transpose else t).detach().cpu() for slot, t in placed]
    return torch.cat(blocks, dim=-1).contiguous() if parts > 1 else blocks[0].contiguous()


@dataclass(frozen=True, slots=True)
class Rule:
    """plait name pattern <-> HF name pattern, `{i}` standing for the layer index."""

    plait: str
    hf: str
    transpose: bool = False
    part: int = 0
    parts: int = 1


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


@dataclass(frozen=True, slots=True, kw_only=True)
class HFFamily:
    """One HF architecture and how a plait built-in model holds it."""

    model_type: str
    architecture: str
    plait_model: str
    rules: tuple[Rule, ...]
    # The prefix of the decoder's tensors: a base model (`LlamaModel`, `GPT2Model`) saves
    # them without it.
    base_prefix: str
    # (plait output, plait embedding): a tied HF checkpoint stores only the embedding.
    tied: tuple[str, str]
    # HF tensors plait has no use for (buffers older transformers versions saved).
    ignored: tuple[str, ...] = ()
    to_config: Callable[[dict[str, Any]], dict[str, Any]]
    from_config: Callable[[dict[str, Any]], tuple[dict[str, Any], list[str]]]
    _compiled: list[tuple[re.Pattern[str], re.Pattern[str], Rule]] = field(
        init=False, repr=False, default_factory=list
    )

    def __post_init__(self) -> None:
        self._compiled.extend((_pattern(r.plait), _pattern(r.hf), r) for r in self.rules)

    def slot(self, plait_name: str) -> Slot:
        """Where plait tensor `plait_name` lives in this family's checkpoints."""
        for plait_pattern, _, rule in self._compiled:
            match = plait_pattern.match(plait_name)
            if match:
                hf_name = rule.hf.replace("{i}", match.group(1)) if match.groups() else rule.hf
                return Slot(hf_name, rule.transpose, rule.part, rule.parts)
        raise CheckpointError(f"parameter {plait_name!r} has no place in an HF {self.model_type}")

    def canonical(self, hf_name: str) -> str:
        """`hf_name` as the causal-LM class names it (a base model's names gain the prefix)."""
        if hf_name.startswith((self.base_prefix, "lm_head.")):
            return hf_name
        return self.base_prefix + hf_name

    def plait_slots(self, hf_name: str) -> list[tuple[str, Slot]]:
        """The plait tensors held in HF tensor `hf_name` (none for an ignored buffer)."""
        hf_name = self.canonical(hf_name)
        found: list[tuple[str, Slot]] = []
        for _, hf_pattern, rule in self._compiled:
            match = hf_pattern.match(hf_name)
            if match:
                name = rule.plait.replace("{i}", match.group(1)) if match.groups() else rule.plait
                found.append((name, Slot(hf_name, rule.transpose, rule.part, rule.parts)))
        if not found and not any(re.search(p, hf_name) for p in self.ignored):
            raise CheckpointError(f"tensor {hf_name!r} is not part of an HF {self.model_type}")
        return found


# -- Llama, Mistral, Qwen2 --------------------------------------------------------------------

_LLAMA_RULES = (
    Rule("tok_embeddings.weight", "model.embed_tokens.weight"),
    Rule("norm.weight", "model.norm.weight"),
    Rule("output.weight", "lm_head.weight"),
    *(
        Rule(f"layers.{{i}}.{plait}", f"model.layers.{{i}}.{hf}")
        for plait, hf in (
            ("attention.wq.weight", "self_attn.q_proj.weight"),
            ("attention.wk.weight", "self_attn.k_proj.weight"),
            ("attention.wv.weight", "self_attn.v_proj.weight"),
            ("attention.wq.bias", "self_attn.q_proj.bias"),
            ("attention.wk.bias", "self_attn.k_proj.bias"),
            ("attention.wv.bias", "self_attn.v_proj.bias"),
            ("attention.wo.weight", "self_attn.o_proj.weight"),
            ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
            ("feed_forward.w3.weight", "mlp.up_proj.weight"),
            ("feed_forward.w2.weight", "mlp.down_proj.weight"),
            ("attention_norm.weight", "input_layernorm.weight"),
            ("ffn_norm.weight", "post_attention_layernorm.weight"),
        )
    ),
)


def _llama_like_config(model: dict[str, Any]) -> dict[str, Any]:
    dim, n_heads = model["dim"], model["n_heads"]
    theta = float(model["rope_theta"])
    return {
        "hidden_size": dim,
        "intermediate_size": model["hidden_dim"],
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": model.get("n_kv_heads") or n_heads,
        "head_dim": dim // n_heads,
        "vocab_size": model["vocab_size"],
        "max_position_embeddings": model["max_seq_len"],
        "rms_norm_eps": model["norm_eps"],
        # transformers 5 reads `rope_parameters`, 4.x reads `rope_theta`: both, same value.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
    }


def _llama_config(model: dict[str, Any]) -> dict[str, Any]:
    if model.get("qkv_bias"):
        raise CheckpointError(
            "an HF llama biases all four attention projections or none; this model biases "
            "q/k/v only: export it as qwen2"
        )
    return {**_llama_like_config(model), "attention_bias": False, "mlp_bias": False}


def _mistral_config(model: dict[str, Any]) -> dict[str, Any]:
    if model.get("qkv_bias"):
        raise CheckpointError("an HF mistral has no q/k/v biases: export this model as qwen2")
    # plait attends over the whole sequence: no sliding window.
    return {**_llama_like_config(model), "sliding_window": None}


def _qwen2_config(model: dict[str, Any]) -> dict[str, Any]:
    if not model.get("qkv_bias"):
        raise CheckpointError(
            "an HF qwen2 has q/k/v biases and this model has none (qkv_bias = false): export "
            "it as llama or mistral"
        )
    return {
        **_llama_like_config(model),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": model["n_layers"],
    }


def _rope_theta(config: dict[str, Any]) -> float:
    """RoPE base frequency; scaled variants (llama3, yarn, linear, …) are refused by name."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(
            f"config.json asks for rope_type {rope_type!r}; plait's rope is the default one only"
        )
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def _llama_like_overrides(
    config: dict[str, Any], *, window: int | None, eps_default: float, positions_default: int
) -> tuple[dict[str, Any], list[str]]:
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {config['hidden_act']!r}: plait's llama uses silu")
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise CheckpointError(
            f"head_dim {head_dim} × {n_heads} heads != hidden_size {dim}; plait's llama derives "
            "head_dim from hidden_size / num_attention_heads"
        )
    notes: list[str] = []
    max_seq_len = config.get("max_position_embeddings", positions_default)
    if window is not None and window < max_seq_len:
        # Within the window, sliding attention is plain causal attention: capping the
        # sequence length keeps plait's logits equal to the HF model's for every input.
        notes.append(
            f"sliding attention window {window} < {max_seq_len} positions: plait attends over "
            f"the whole sequence, so max_seq_len is capped at {window}"
        )
        max_seq_len = window
    if config.get("tie_word_embeddings"):
        notes.append(_TIED_NOTE)
    overrides = {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": config.get("num_key_value_heads") or n_heads,
        "ffn_hidden_dim": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "max_seq_len": max_seq_len,
        "norm_eps": config.get("rms_norm_eps", eps_default),
        "rope_theta": _rope_theta(config),
    }
    return overrides, notes


_TIED_NOTE = (
    "tied input/output embeddings: plait's output matrix starts as a copy of the embedding and "
    "trains untied"
)


def _llama_overrides(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise CheckpointError(
            "attention_bias/mlp_bias: plait's llama has no o_proj or MLP biases (q/k/v biases "
            "are Qwen2's layout)"
        )
    return _llama_like_overrides(config, window=None, eps_default=1e-6, positions_default=2048)


def _mistral_overrides(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    return _llama_like_overrides(
        config, window=config.get("sliding_window"), eps_default=1e-6, positions_default=131072
    )


def _qwen2_overrides(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    layer_types = config.get("layer_types") or []
    sliding = config.get("use_sliding_window") or "sliding_attention" in layer_types
    window = config.get("sliding_window") if sliding else None
    overrides, notes = _llama_like_overrides(
        config, window=window, eps_default=1e-6, positions_default=32768
    )
    return {**overrides, "qkv_bias": True}, notes


LLAMA = HFFamily(
    model_type="llama",
    architecture="LlamaForCausalLM",
    plait_model="llama",
    rules=_LLAMA_RULES,
    base_prefix="model.",
    tied=("output.weight", "tok_embeddings.weight"),
    ignored=(r"\.rotary_emb\.inv_freq$",),
    to_config=_llama_config,
    from_config=_llama_overrides,
)
MISTRAL = HFFamily(
    model_type="mistral",
    architecture="MistralForCausalLM",
    plait_model="llama",
    rules=_LLAMA_RULES,
    base_prefix="model.",
    tied=LLAMA.tied,
    ignored=LLAMA.ignored,
    to_config=_mistral_config,
    from_config=_mistral_overrides,
)
QWEN2 = HFFamily(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    plait_model="llama",
    rules=_LLAMA_RULES,
    base_prefix="model.",
    tied=LLAMA.tied,
    ignored=LLAMA.ignored,
    to_config=_qwen2_config,
    from_config=_qwen2_overrides,
)


# -- GPT-2 --------------------------------------------------------------------------------------

_GPT2_LAYER = (
    ("attention_norm.weight", "ln_1.weight", False, 0, 1),
    ("attention_norm.bias", "ln_1.bias", False, 0, 1),
    # c_attn: one Conv1D projecting to [q | k | v].
    ("attention.wq.weight", "attn.c_attn.weight", True, 0, 3),
    ("attention.wk.weight", "attn.c_attn.weight", True, 1, 3),
    ("attention.wv.weight", "attn.c_attn.weight", True, 2, 3),
    ("attention.wq.bias", "attn.c_attn.bias", False, 0, 3),
    ("attention.wk.bias", "attn.c_attn.bias", False, 1, 3),
    ("attention.wv.bias", "attn.c_attn.bias", False, 2, 3),
    ("attention.wo.weight", "attn.c_proj.weight", True, 0, 1),
    ("attention.wo.bias", "attn.c_proj.bias", False, 0, 1),
    ("ffn_norm.weight", "ln_2.weight", False, 0, 1),
    ("ffn_norm.bias", "ln_2.bias", False, 0, 1),
    ("feed_forward.w1.weight", "mlp.c_fc.weight", True, 0, 1),
    ("feed_forward.w1_bias", "mlp.c_fc.bias", False, 0, 1),
    ("feed_forward.w2.weight", "mlp.c_proj.weight", True, 0, 1),
    ("feed_forward.w2.bias", "mlp.c_proj.bias", False, 0, 1),
)
_GPT2_RULES = (
    Rule("tok_embeddings.weight", "transformer.wte.weight"),
    Rule("pos_embeddings.weight", "transformer.wpe.weight"),
    Rule("norm.weight", "transformer.ln_f.weight"),
    Rule("norm.bias", "transformer.ln_f.bias"),
    Rule("output.weight", "lm_head.weight"),
    *(
        Rule(f"layers.{{i}}.{plait}", f"transformer.h.{{i}}.{hf}", transpose, part, parts)
        for plait, hf, transpose, part, parts in _GPT2_LAYER
    ),
)
# Both are GELU's tanh approximation, which plait's `bias_gelu` computes.
_GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


def _gpt2_config(model: dict[str, Any]) -> dict[str, Any]:
    vocab = model["vocab_size"]
    return {
        "n_embd": model["dim"],
        "n_layer": model["n_layers"],
        "n_head": model["n_heads"],
        "n_inner": model["hidden_dim"],
        "n_positions": model["max_seq_len"],
        "vocab_size": vocab,
        "layer_norm_epsilon": model["norm_eps"],
        "activation_function": "gelu_new",
        # plait trains GPT-2 without dropout; HF's default of 0.1 would change training.
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": False,
        # GPT-2's <|endoftext|> is token 50256; a smaller vocabulary has no such token.
        "bos_token_id": 50256 if vocab > 50256 else None,
        "eos_token_id": 50256 if vocab > 50256 else None,
    }


def _gpt2_overrides(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise CheckpointError(
            f"activation_function {activation!r}: plait's gpt2 uses the tanh GELU "
            f"({', '.join(_GPT2_ACTIVATIONS)})"
        )
    if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx"):
        raise CheckpointError(
            "plait's gpt2 scales attention by 1/sqrt(head_dim) only (scale_attn_weights = true, "
            "scale_attn_by_inverse_layer_idx = false)"
        )
    if config.get("add_cross_attention"):
        raise CheckpointError("add_cross_attention: plait's gpt2 is a decoder only")
    dim = config["n_embd"]
    overrides = {
        "dim": dim,
        "n_layers": config["n_layer"],
        "n_heads": config["n_head"],
        "ffn_hidden_dim": config.get("n_inner") or 4 * dim,
        "vocab_size": config["vocab_size"],
        "max_seq_len": config.get("n_positions", 1024),
        "norm_eps": config.get("layer_norm_epsilon", 1e-5),
    }
    # GPT2Config ties by default, so a config.json without the key is tied.
    return overrides, [_TIED_NOTE] if config.get("tie_word_embeddings", True) else []


GPT2 = HFFamily(
    model_type="gpt2",
    architecture="GPT2LMHeadModel",
    plait_model="gpt2",
    rules=_GPT2_RULES,
    base_prefix="transformer.",
    tied=("output.weight", "tok_embeddings.weight"),
    # Older transformers saved the causal mask as `attn.bias` / `attn.masked_bias`.
    ignored=(r"\.attn\.bias$", r"\.attn\.masked_bias$"),
    to_config=_gpt2_config,
    from_config=_gpt2_overrides,
)

FAMILIES: dict[str, HFFamily] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, GPT2)}


def family_named(model_type: str) -> HFFamily:
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"HF model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def family_for_export(model: str, fields: dict[str, Any], requested: str | None) -> HFFamily:
    """The HF family to write plait model `model` as: `requested`, else its natural one."""
    default = {"gpt2": "gpt2", "llama": "qwen2" if fields.get("qkv_bias") else "llama"}
    if model not in default:
        raise CheckpointError(
            f"model {model!r} has no HF export; the built-in llama and gpt2 families have"
        )
    family = family_named(requested or default[model])
    if family.plait_model != model:
        allowed = [name for name, f in FAMILIES.items() if f.plait_model == model]
        raise CheckpointError(
            f"a plait {model} model exports as {', '.join(allowed)}, not {family.model_type}"
        )
    return family


def hf_config(family: HFFamily, fields: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """`config.json` for `family` from a resolved plait model config (as a dict)."""
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **family.to_config(fields),
        # transformers 5 reads `dtype`, 4.x `torch_dtype`.
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }

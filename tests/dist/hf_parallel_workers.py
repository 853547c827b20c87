"""Rank functions: context and expert parallelism for `transformers` models passed unwrapped to
`plait.initialize`, against the user's plain single-process loop over the same global batches.

Models come from tiny configs (nothing is downloaded), compute their own loss from `labels`
(shifted inside the model) and, for MoE families, their own routing and auxiliary loss. Each
case records, per step, the loss and every gradient piece this rank holds, placed in its global
tensor by the state layout the run declares; the plain loop records its own.
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import plait
from plait.core.hookspecs import hookimpl

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR = 96, 16, 4, 5, 3e-3
Slices = tuple[tuple[int, int], ...]  # (offset, size) per dim of a piece in its global tensor


def build(family: str, **overrides: Any) -> nn.Module:
    """A tiny `transformers` model of `family`, identically initialised on every rank."""
    import transformers

    torch.manual_seed(0)
    attention = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            **attention, **overrides,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    if family == "mistral":  # its sliding window (4096) spans every sequence here
        config = transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            **attention, **overrides,
        )  # fmt: skip
        return transformers.MistralForCausalLM(config)
    if family == "qwen2":  # q/k/v projections with biases
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            **attention, **overrides,
        )  # fmt: skip
        return transformers.Qwen2ForCausalLM(config)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **overrides,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if family == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            num_local_experts=4, num_experts_per_tok=2, **attention, **overrides,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(config)
    if family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, num_hidden_layers=2, num_experts=4,
            num_experts_per_tok=2, **attention, **overrides,
        )  # fmt: skip
        return transformers.Qwen2MoeForCausalLM(config)
    if family == "gpt_oss":  # experts transposed, with biases and a clamped gate of its own
        config = transformers.GptOssConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
            num_local_experts=4, num_experts_per_tok=2, head_dim=8, **attention, **overrides,
        )  # fmt: skip
        return transformers.GptOssForCausalLM(config)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, head_dim=8,
            **attention, **overrides,
        )  # fmt: skip
        return transformers.Qwen3MoeForCausalLM(config)
    raise ValueError(family)


def batches(steps: int = STEPS, *, padded: bool = False) -> list[dict[str, torch.Tensor]]:
    """Global batches as a collator makes them (`labels` = `input_ids`); `padded`: right
    padding of varying length, labels -100 on the padding."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)
        batch = {"input_ids": tokens, "labels": tokens.clone()}
        if padded:
            lengths = torch.randint(SEQ // 2, SEQ + 1, (GLOBAL_BATCH,), generator=generator)
            mask = (torch.arange(SEQ) < lengths.unsqueeze(1)).long()
            batch["attention_mask"] = mask
            batch["labels"] = tokens.masked_fill(mask == 0, -100)
        out.append(batch)
    return out


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def plain_loop(case: dict[str, Any]) -> dict[str, Any]:
    """The reference: the user's loop on one process, the whole global batch each step."""
    model = build(case["family"], **case.get("model", {}))
    opt = optimizer(model.parameters())
    losses, grads, norms = [], [], []
    for batch in batches(padded=case.get("padded", False)):
        loss = model(**batch).loss
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads[-1].values()])))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    parameters = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "grads": grads,
        "grad_norms": [n.item() for n in norms],
        "parameters": parameters,
    }


def gradient_pieces(engine: Any) -> dict[str, tuple[Slices, torch.Tensor]]:
    """Every whole-region gradient this rank holds (ZeRO's flat shards are left out)."""
    from plait.core.state_layout import describe_state

    layout = describe_state(engine.module, engine.optimizer, engine.runtimes, engine.mesh)
    pieces: dict[str, tuple[Slices, torch.Tensor]] = {}
    for entry in layout.parameters:
        grad = entry.param.grad
        if grad is None or len(entry.value.pieces) != 1:
            continue
        region = entry.value.pieces[0].region
        if region.flat is not None or region.numel != grad.numel():
            continue
        slices = tuple(zip(region.offsets, region.sizes, strict=True))
        pieces[entry.name] = (slices, grad.detach().reshape(region.sizes).clone())
    return pieces


class PurposeRecorder:
    """A comm wrapper, as telemetry is: counts every op by (op, purpose)."""

    def __init__(self) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: Any) -> Any:
        self.seen[(request.op, request.purpose)] += 1
        return (yield)


def _engine(case: dict[str, Any], model: nn.Module) -> Any:
    from plait.core.plugins import Plugins

    config = copy.deepcopy(case["config"])
    config.setdefault("telemetry", {"enabled": False})
    config.setdefault("train", {}).setdefault("device", "cpu")
    recorder = PurposeRecorder()
    plugins = Plugins.create(autoload=False, extra=[("purposes", recorder)])
    engine = plait.initialize(model, config=config, optimizer=optimizer, plugins=plugins)
    engine.purposes = recorder.seen
    return engine


def train_case(case: dict[str, Any], *, steps: range = range(STEPS), engine: Any = None) -> Any:
    """Train `case` on these ranks (a fresh engine unless one is given) over `steps`:
    (engine, losses, gradient pieces per step, gradient norms)."""
    engine = engine or _engine(case, build(case["family"], **case.get("model", {})))
    recorded: list[dict[str, tuple[Slices, torch.Tensor]]] = []
    step_optimizer = engine.optimizer.step

    def record_then_step(*args: Any, **kwargs: Any) -> Any:
        recorded.append(gradient_pieces(engine))
        return step_optimizer(*args, **kwargs)

    engine.optimizer.step = record_then_step
    dp, dp_rank = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
    share = GLOBAL_BATCH // dp
    losses, norms = [], []
    every = batches(padded=case.get("padded", False))
    for step in steps:
        mine = {k: v[dp_rank * share : (dp_rank + 1) * share] for k, v in every[step].items()}
        losses.append(engine.train_step(mine))
        norms.append(engine.last_report.grad_norm)
    engine.optimizer.step = step_optimizer
    return engine, losses, recorded, norms


def parameter_difference(engine: Any, reference: dict[str, Any]) -> tuple[float, list[str]]:
    """Worst difference of every parameter piece this rank holds (ZeRO's flat ranges of its
    masters too) from the plain loop's after the same steps, and the names it holds no piece
    of (the test checks the ranks together cover every parameter)."""
    from plait.core.state_layout import describe_state

    layout = describe_state(engine.module, engine.optimizer, engine.runtimes, engine.mesh)
    worst, held = 0.0, set()
    for entry in layout.parameters:
        full = reference["parameters"][entry.name]
        for piece in entry.value.pieces:
            region = piece.region
            index = tuple(
                slice(o, o + n) for o, n in zip(region.offsets, region.sizes, strict=True)
            )
            expected = full[index].reshape(-1)
            if region.flat is not None:
                expected = expected[region.flat[0] : region.flat[1]]
            values = piece.read().detach().float().reshape(-1)
            if values.numel():
                worst = max(worst, (values - expected).abs().max().item())
                held.add(entry.name)
    return worst, sorted(held)


def compare(case: dict[str, Any], reference: dict[str, Any], run: tuple) -> dict[str, Any]:
    """Worst loss, gradient, gradient-norm and parameter differences of one run against the
    plain loop, and how many gradient elements were compared."""
    engine, losses, recorded, norms = run
    worst_loss = max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True))
    worst_norm = max(abs(a - b) for a, b in zip(norms, reference["grad_norms"], strict=True))
    worst_parameter, held = parameter_difference(engine, reference)
    worst_grad, compared = 0.0, 0
    for step, pieces in enumerate(recorded):
        whole = reference["grads"][step]
        for name, (slices, grad) in pieces.items():
            index = tuple(slice(o, o + n) for o, n in slices)
            expected = whole[name][index]
            worst_grad = max(worst_grad, (expected - grad).abs().max().item())
            compared += grad.numel()
    return {
        "loss": worst_loss,
        "grad": worst_grad,
        "compared": compared,
        "grad_norm": worst_norm,
        "parameter": worst_parameter,
        "parameters_held": held,
        "parameters_total": sorted(reference["parameters"]),
    }


def run_cases(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case against its plain loop (computed here: every rank builds the same model)."""
    from plait.core.span_board import BOARD
    from plait.plugins.expert_parallel.expert_load import PublishedExpertLoad

    del rank, world_size
    references: dict[tuple, dict[str, Any]] = {}
    results: dict[str, Any] = {}
    for name, case in cases.items():
        key = (case["family"], tuple(sorted(case.get("model", {}).items())), case.get("padded"))
        if key not in references:
            references[key] = plain_loop(case)
        BOARD.take()
        run = train_case(case)
        engine = run[0]
        # The last step's counts, summed over the data-parallel ranks.
        published = [s for s in BOARD.take() if isinstance(s, PublishedExpertLoad)]
        load = published[-1].resolve() if published else None
        results[name] = {
            **compare(case, references[key], run),
            "comm": {f"{op}/{purpose}": n for (op, purpose), n in engine.purposes.items()},
            "schedule": engine.config.schedule.name,
            "schedule_chosen_by_default": engine.config.schedule.chosen_by_default,
            "expert_load": None
            if load is None
            else {layer.layer: layer.tokens_per_expert for layer in load.layers},
        }
        engine.close()
    return results


# -- expert parallelism: checkpoint resharding, HF export ----------------------------------------


def expert_runs(rank: int, world_size: int, cases: dict[str, Any], out_dir: str) -> dict:
    """The MoE cases, then a Mixtral trained 3 steps at ep 2, saved, resumed at ep 1 for the
    last 2 (losses against the plain loop), and a Mixtral trained at ep 2 exported to HF and
    read back by `from_pretrained` (logits against the trained engine's)."""
    results = run_cases(rank, world_size, cases)
    results["resume"] = _save_at_ep2_resume_at_ep1(Path(out_dir) / "ckpt")
    results["export"] = _export_after_ep2(Path(out_dir) / "hf")
    return results


MIXTRAL_EP2 = {"family": "mixtral", "config": {"parallel": {"ep": 2}}}


def _save_at_ep2_resume_at_ep1(ckpt_dir: Path) -> dict[str, Any]:
    from plait.plugins.checkpoint import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig

    reference = plain_loop(MIXTRAL_EP2)
    settings = CheckpointIOConfig(dir=str(ckpt_dir), resume=True, keep=0)
    engine, first, _, _ = train_case(MIXTRAL_EP2, steps=range(3))
    checkpointer = Checkpointer(engine, None, settings)
    checkpointer.save(3)
    checkpointer.close()
    engine.close()
    ep1 = {"family": "mixtral", "config": {"parallel": {"transforms": {"ep": "ep"}}}}
    resumed = _engine(ep1, build("mixtral"))
    checkpointer = Checkpointer(resumed, None, settings)
    start = checkpointer.maybe_resume()
    _, rest, _, _ = train_case(ep1, steps=range(start, STEPS), engine=resumed)
    experts = resumed.module.model.layers[0].mlp.experts.gate_up_proj.shape[0]
    checkpointer.close()
    resumed.close()
    losses = first + rest
    worst = max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True))
    return {"start": start, "loss": worst, "experts_held_after_resume": experts}


def _export_after_ep2(out_dir: Path) -> dict[str, Any]:
    import transformers

    from plait.plugins.huggingface.weights import export_hf_from

    engine, _, _, _ = train_case(MIXTRAL_EP2)
    probe = batches(1)[0]["input_ids"]
    engine.module.eval()
    with torch.no_grad():
        trained = engine.module(input_ids=probe).logits
    export_hf_from(engine, out_dir)
    held = engine.module.model.layers[0].mlp.experts.gate_up_proj.shape[0]
    engine.close()
    result: dict[str, Any] = {"experts_held": held}
    if dist.get_rank() == 0:
        from safetensors import safe_open

        build("mixtral").save_pretrained(out_dir.parent / "save-pretrained")
        for key, folder in (
            ("tensors", out_dir),
            ("save_pretrained_tensors", out_dir.parent / "save-pretrained"),
        ):
            with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
                result[key] = sorted(handle.keys())
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
        with torch.no_grad():
            exported = loaded(input_ids=probe).logits
        result["logits"] = (exported - trained).abs().max().item()
        result["experts_loaded"] = loaded.model.layers[0].mlp.experts.gate_up_proj.shape[0]
        result["class"] = type(loaded).__name__
    return result

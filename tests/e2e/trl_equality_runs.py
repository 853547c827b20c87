"""One LoRA fine-tuning on chat data, run twice: by TRL's `SFTTrainer` in one process and by
plait on 2 Gloo ranks under ZeRO-3, for `test_trl_equality.py` to compare step by step.

Both sides get the same tiny transformers Llama (built from `torch.manual_seed(0)`), the same
tokenizer files, the same conversations in the same order, the same LoRA adapters (seeded with
`SEED` right before `peft.get_peft_model`, which is what TRL's `set_seed(args.seed)` and
plait's `train.seed` each do) and fp32 AdamW at a constant learning rate with no clipping.

plait reads the conversations as `plait data prepare --chat` wrote them, through the sampler
`plait train` uses (`build_batches`, one conversation per row: `packing = "none"`). That sampler
shuffles the conversations with `train.seed`; TRL's has no such order, so TRL is given them in
the order plait's sampler takes them (`plait_order`), read sequentially.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import plait

SEED, STEPS, GLOBAL_BATCH, SEQ = 7, 20, 4, 64
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.0
RANK, ALPHA = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
WORDS = [
    "what", "is", "two", "plus", "the", "cat", "sat", "on", "mat", "and", "dog", "ran", "to", "it",
    "hello", "how", "are", "you", "fine", "red",
]  # fmt: skip
ANSWERS = ["four.", "the cat sat on the mat.", "i am fine, thank you.", "red, green, blue or red."]


def conversations(count: int) -> list[list[dict[str, str]]]:
    """Short conversations of one or two exchanges: random questions, answers drawn from a few
    of different lengths (learnt within the run, and a per-row or per-rank mean would weigh
    their tokens differently from the global batch's mean)."""
    rng = np.random.default_rng(3)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS, size=int(rng.integers(low, high))))

    rows = []
    for _ in range(count):
        messages = []
        for _ in range(1 + int(rng.random() < 0.3)):
            messages.append({"role": "user", "content": words(2, 5)})
            messages.append({"role": "assistant", "content": str(rng.choice(ANSWERS))})
        rows.append(messages)
    return rows


def build_model(vocab_size: int) -> nn.Module:
    """The base model, identical wherever it is built."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def plait_order(directory: Path) -> list[int]:
    """Which conversation (its index in the prepared directory, = its row in the input file)
    each row of the first `STEPS` global batches of plait's sampler holds, in order."""
    from plait.core.config import DataSection
    from plait.plugins.data import PackedBatches, build_batches

    batches = build_batches(
        DataSection(path=str(directory), seq_len=SEQ, packing="none"),
        seq_len=SEQ, global_batch_size=GLOBAL_BATCH, dp_rank=0, dp_size=1, seed=SEED,
    )  # fmt: skip
    assert isinstance(batches, PackedBatches)
    starts = np.asarray(batches.token_file.documents.starts)
    order: list[int] = []
    for step in range(STEPS):
        plan = batches.local_plan(step)
        assert plan.pieces == plan.rows == GLOBAL_BATCH  # one whole conversation per row
        order += np.searchsorted(starts, plan.token_starts).tolist()
    return order


def causal_lm_batch(inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> dict[str, Any]:
    """A packed sampler's rows as a transformers causal LM takes them. The sampler's targets
    are already shifted (`targets[:, i]` is what position i predicts, or -100); the model shifts
    `labels` itself, so `labels[:, i + 1] = targets[:, i]`. The last column's target is always
    -100 (a row's last token predicts nothing), so nothing is lost. One conversation per row:
    its positions are the default 0, 1, … and the padding after it is never attended to."""
    ignored = torch.full_like(targets[:, :1], -100)
    return {"input_ids": inputs["tokens"], "labels": torch.cat([ignored, targets[:, :-1]], 1)}


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def train_plait(rank: int, world_size: int, directory: str, vocab_size: int) -> list[float]:
    """plait's side, on one of 2 Gloo ranks: ZeRO-3, the `lora` transform, the prepared rows."""
    from plait.core.config import DataSection
    from plait.plugins.data import build_batches

    config = {
        "parallel": {"dp_strategy": "zero3", "transforms": {"adapter": "lora"}},
        "peft": {"r": RANK, "alpha": ALPHA, "dropout": 0.0, "target_modules": TARGETS},
        "telemetry": {"enabled": False},
        "train": {"device": "cpu", "seed": SEED},
    }
    engine = plait.initialize(build_model(vocab_size), config=config, optimizer=adamw)
    batches = build_batches(
        DataSection(path=directory, seq_len=SEQ, packing="none"),
        seq_len=SEQ,
        global_batch_size=GLOBAL_BATCH,
        dp_rank=engine.mesh.coordinate("dp"),
        dp_size=engine.mesh.size("dp"),
        seed=SEED,
    )
    return [engine.train_step(causal_lm_batch(*batches.next_batch())) for _ in range(STEPS)]


def train_trl(
    tokenizer_dir: Path, rows: list[list[dict[str, str]]], output_dir: Path
) -> dict[str, Any]:
    """TRL's side, in this process: `SFTTrainer` with `assistant_only_loss` and a peft
    `LoraConfig`, the conversations in `rows`' order. Returns its per-step losses and the
    token ids and labels it trained on (row by row, padding left out)."""
    import peft
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    args = SFTConfig(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=0.0,  # no clipping (plait clips nothing unless asked)
        seed=SEED,  # set right before get_peft_model: the adapters' initialisation
        train_sampling_strategy="sequential",  # the rows in the order given
        shuffle_dataset=False,
        assistant_only_loss=True,
        packing=False,
        padding_free=False,
        max_length=SEQ,
        # TRL's defaults are bf16 and activation checkpointing: fp32, as plait's side.
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    lora = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    trainer = SFTTrainer(
        model=build_model(len(tokenizer)),
        args=args,
        train_dataset=Dataset.from_list([{"messages": messages} for messages in rows]),
        processing_class=tokenizer,
        peft_config=lora,
    )
    trained = trainer.train_dataset
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "losses": losses,
        "input_ids": [list(ids) for ids in trained["input_ids"]],
        "labels": [list(labels) for labels in trained["labels"]],
    }

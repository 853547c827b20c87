"""Small transformers tokenizers with chat templates, built locally for the chat-data tests.

A byte-level BPE (lossless: every rendering decodes back to itself) is trained on a few strings
and saved with `save_pretrained`, with one of three templates of different shapes:

- `MARKED`: ChatML with `{% generation %}` markers around the assistant's text;
- `INSTRUCT`: Llama-2's `[INST] … [/INST] answer</s>` without markers, no system role (a system
  message makes it raise, as Llama-2-style templates do);
- `HEADERS`: Llama-3's header blocks without markers, with a default system turn and history.
"""

from __future__ import annotations

from pathlib import Path

MARKED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INSTRUCT = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}"
    "{% else %}{{ raise_exception('this template has no ' + m.role + ' role') }}{% endif %}"
    "{% endfor %}"
)
HEADERS = (
    "{% if messages[0].role != 'system' %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You help.<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEMPLATES = {"marked": MARKED, "instruct": INSTRUCT, "headers": HEADERS}

SPECIAL = [
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "[INST]",
    "[/INST]",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
TRAINING_TEXT = [
    "what is two plus two? two plus two is four.",
    "the cat sat on the mat and the dog ran to it.",
    "hello there, how are you? i am fine, thank you.",
    "system user assistant you help name a colour: red, green, blue.",
]


def build_chat_tokenizer(folder: Path, template: str) -> Path:
    """A byte-level BPE tokenizer with `template`, saved in `folder` (returned)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder

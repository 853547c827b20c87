"""Batches as users have them: split into micro-batches, fed to the model, turned into a loss.

A batch is one of:

- a pair `(inputs, targets)`: the model is called as `model(inputs)` and the loss is
  `loss_fn(output, targets)` (token cross-entropy by default for logits);
- a dict (`input_ids`, `labels`, `attention_mask`, …): the model is called as `model(**batch)`,
  as a Hugging Face model is, and `batch["labels"]` is the loss function's target;
- a single tensor, or a tuple/list of another length: `model(batch)` / `model(*batch)`, for a
  model that computes its own loss.

Every tensor in the batch is split along dim 0 into micro-batches. Without a `loss_fn` the loss
comes from the model's output: a scalar tensor, `.loss`, `["loss"]`, or the first element of a
tuple (nanoGPT's `(logits, loss)` is read as the last element when the first is not a scalar).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from plait.core.documents import Documents
from plait.core.errors import PlaitError

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Microbatches:
    """One step's micro-batches: what the model is called with, and the loss targets."""

    inputs: list[Any]
    targets: list[Any]
    samples: int  # rows of the batch on this rank

    def __len__(self) -> int:
        return len(self.inputs)


# transformers' varlen metadata of a flattened batch (`DataCollatorWithFlattening(
# return_flash_attn_kwargs=True)`): offsets over the one row's tokens, not per-row tensors.
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _row_tensors(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return {key: value for key, value in batch.items() if key not in VARLEN_KEYS}
    return batch


def batch_rows(batch: Any) -> int:
    """The batch dimension shared by every tensor of `batch` (varlen offsets aside)."""
    tensors = tree_flatten(_row_tensors(batch))[0]
    rows = {t.shape[0] for t in tensors if isinstance(t, torch.Tensor) and t.ndim}
    if len(rows) != 1:
        raise PlaitError(
            "every tensor of a batch must have the same size along dim 0 (the samples); got "
            + (f"sizes {sorted(rows)}" if rows else "no tensor with a batch dimension")
        )
    return rows.pop()


def split_batch(
    batch: Any,
    *,
    micro_batch_size: int | None,
    device: torch.device,
    prepare_inputs: Callable[[Any], Any] | None = None,
) -> Microbatches:
    """Split every tensor of `batch` along dim 0 into micro-batches of `micro_batch_size` rows
    (`None`: the whole batch is one micro-batch), and move them to `device`.

    `prepare_inputs(inputs)` sees each micro-batch's inputs before the move, where the batch
    was made (a sampler's batch on the host: reading its positions costs no device sync)."""
    rows = batch_rows(batch)
    micro = micro_batch_size or rows
    if rows % micro and rows > micro:
        raise PlaitError(
            f"the batch on this rank has {rows} samples, not a multiple of "
            f"train.micro_batch_size = {micro}"
        )
    count = max(1, rows // micro)
    if count > 1 and isinstance(batch, Mapping) and any(key in batch for key in VARLEN_KEYS):
        raise PlaitError(
            f"the batch carries varlen offsets ({', '.join(k for k in VARLEN_KEYS if k in batch)}) "
            f"over its {rows} rows, which cannot be split into {count} micro-batches; leave "
            "train.micro_batch_size unset for such a batch"
        )
    pieces = [_take_rows(batch, i * micro, min(rows, (i + 1) * micro)) for i in range(count)]
    inputs, targets = zip(*(split_inputs_and_targets(p) for p in pieces), strict=True)
    if prepare_inputs is not None:
        inputs = tuple(prepare_inputs(x) for x in inputs)
    return Microbatches(
        inputs=[to_device(x, device) for x in inputs],
        targets=[to_device(y, device) for y in targets],
        samples=rows,
    )


def to_device(data: Any, device: torch.device) -> Any:
    """`data` with every tensor (and every `Documents`) moved to `device`, without waiting."""
    return tree_map(
        lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor | Documents) else t,
        data,
    )


def _take_rows(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, Mapping) and any(key in batch for key in VARLEN_KEYS):
        return dict(batch)  # one micro-batch: the offsets stay with their row (checked above)
    return tree_map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) and t.ndim else t, batch)


def split_inputs_and_targets(batch: Any) -> tuple[Any, Any]:
    """What the model is called with, and what the loss function compares against."""
    if isinstance(batch, Mapping):
        return dict(batch), batch.get("labels")
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None


def call_model(module: torch.nn.Module, inputs: Any) -> Any:
    """`module(**inputs)` for a dict, `module(*inputs)` for a tuple/list, else `module(inputs)`."""
    if isinstance(inputs, Mapping):
        return module(**inputs)
    if isinstance(inputs, tuple | list):
        return module(*inputs)
    return module(inputs)


def input_tokens(inputs: Any) -> torch.Tensor:
    """The token-id tensor of a micro-batch's inputs (to count tokens, shape activations)."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, Mapping) and isinstance(inputs.get("input_ids"), torch.Tensor):
        return inputs["input_ids"]
    for tensor in tree_flatten(inputs)[0]:
        if isinstance(tensor, torch.Tensor):
            return tensor
    raise PlaitError("the batch holds no tensor")


def loss_from_output(output: Any) -> torch.Tensor | None:
    """The loss a model returned itself, or `None` if `output` carries none."""
    if isinstance(output, torch.Tensor):
        return output if output.ndim == 0 else None
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, tuple | list) and output:
        for candidate in (output[0], output[-1]):
            if isinstance(candidate, torch.Tensor) and candidate.ndim == 0:
                return candidate
    return None


def describe_output(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, Mapping):
        return f"a mapping with keys {sorted(map(str, output))}"
    if isinstance(output, tuple | list):
        return f"a {type(output).__name__} of {len(output)} items"
    return f"a {type(output).__name__}"


def default_loss(token_cross_entropy: LossFn) -> LossFn:
    """The loss when the user gave no `loss_fn`: the model's own loss if its output carries
    one, else token cross-entropy of logits against the batch's targets."""

    def loss(output: Any, targets: Any) -> torch.Tensor:
        own = loss_from_output(output)
        if own is not None:
            return own
        logits = getattr(output, "logits", output)
        if isinstance(logits, torch.Tensor) and logits.ndim >= 2 and targets is not None:
            return token_cross_entropy(logits, targets)
        raise PlaitError(
            f"cannot find a loss: the model returned {describe_output(output)} with no `loss` "
            "and the batch has no targets; return a scalar loss (or an output with `.loss`), "
            "pass the batch as (inputs, targets) or a dict with `labels`, or give "
            "plait.initialize(..., loss_fn=lambda output, targets: ...)"
        )

    return loss

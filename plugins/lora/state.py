"""What a LoRA job's checkpoint holds: the adapters and their optimizer state, not the base.

The frozen base is the model the job started from (a pretrained checkpoint, loaded before
`plait.initialize`): writing it again at every save would cost its whole size for nothing.
The adapter transform's runtime leaves it out of the state layout that checkpoints are written
from and read into, and the checkpoint names the base instead, with a content hash:

    plugins.rank<r>   {"lora": {"peft": {...[peft]...}, "base": {"name": ..., "sha256": ...}}}

At resume the hash of the base the job holds now must equal the saved one, or the adapters
would be put on another model; the `[peft]` section is what `plait ckpt export --format peft`
writes as peft's `adapter_config.json`.

The base stays in the layout as `StateLayout.left_out`, under the names the base's own
checkpoint gives it (without `base_model.model.`, `.base_layer.` and `.original_module.`), so
that a weights-only load (`checkpoint_io.init_from`: plait's built-in models arrive without
weights) fills it. The record is then taken again over the base that load read, as it would
have been had the base arrived loaded, and says where it came from (`loaded_from`).

A module to save (`[peft] modules_to_save`) is held twice: its frozen original
(`….original_module.…`, part of the base, hashed) and the copy that trains
(`….modules_to_save.default.…`, saved with its optimizer state). peft copies the module when it
wraps it, so the copy starts from the base's weights; a base that arrives without weights is
loaded after that copy was made, so the left-out entry under the module's own name describes
the trained copy: the weights-only load starts it from the base's weights, as peft would have,
and a resume then reads it from the job's own checkpoint. The frozen original, which plait
never runs, is then neither saved nor loaded (the record hashes the weights the load read).

Under pipeline parallelism no rank holds the whole base: each stage hashes its own frozen
tensors one by one, the stages exchange those digests, and the record's `sha256` is the hash of
all of them (`"scheme": "per-tensor"`, `digests_hash`), the same on every stage and for the
whole model read back at export. The adapters keep the names peft gives them in one process
(`base_model.model.…`), so a pipelined job's checkpoint exports and merges as any other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from plait.core.errors import CheckpointError
from plait.core.hookspecs import hookimpl
from plait.core.sharding import ParallelRuntime
from plait.core.state_layout import LoadedFrom, ParameterLayout, StateLayout
from plait.plugins.lora.config import PeftSection

if TYPE_CHECKING:
    from plait.core.schedule import MicrobatchPosition
    from plait.plugins.lora.tensor_parallel import TensorParallelFactors

KEY = "lora"
ADAPTER = "default"  # the adapter name peft gives a model's only adapter
PREFIX = "base_model.model."  # where peft puts the base model's own names
BASE_LAYER = ".base_layer."  # where peft puts an adapted layer's own parameters
ORIGINAL = ".original_module."  # where peft puts a module to save's frozen original
TRAINED_COPY = f".modules_to_save.{ADAPTER}."  # and the copy of it that trains
# `base.loaded_from`: the checkpoint a weights-only load read the base from (`init_from`)
LOADED_FROM = "loaded_from"
# `base.scheme` of a record hashed tensor by tensor (a pipelined job's); none: `base_hash`
PER_TENSOR = "per-tensor"


class StagesRecord(Protocol):
    """A pipelined job's record of `frozen`, this stage's tensors, and every other stage's."""

    def __call__(
        self, frozen: Iterable[tuple[str, torch.Tensor]], *, name: str
    ) -> dict[str, Any]: ...


def base_hash(named: Iterable[tuple[str, torch.Tensor]], *, in_order: bool = False) -> str:
    """sha256 of the frozen parameters' names, dtypes, shapes and bytes, in name order.
    `in_order`: `named` comes in name order already, and is read one tensor at a time."""
    digest = hashlib.sha256()
    for name, tensor in named if in_order else sorted(named, key=lambda item: item[0]):
        value = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """One line per tensor: its name, dtype, shape and the sha256 of its bytes."""
    lines = []
    for name, tensor in named:
        value = tensor.detach().to("cpu").contiguous()
        data = value.view(torch.uint8).numpy().tobytes() if value.numel() else b""
        lines.append(
            f"{name}|{value.dtype}|{tuple(value.shape)}|{hashlib.sha256(data).hexdigest()}"
        )
    return lines


def digests_hash(lines: Iterable[str]) -> str:
    """sha256 of `tensor_digests` lines, in name order: whichever ranks computed them."""
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()


def record_hash(
    named: Iterable[tuple[str, torch.Tensor]], base: dict[str, Any], *, in_order: bool = False
) -> str:
    """The hash of `named` as the record `base` was hashed (whole, or tensor by tensor);
    `in_order` as for `base_hash`."""
    if base.get("scheme") == PER_TENSOR:
        return digests_hash(tensor_digests(named))
    return base_hash(named, in_order=in_order)


def base_weight_name(name: str) -> str:
    """A frozen parameter's name in the base's own checkpoint, or a module to save's trained
    copy's: without peft's additions."""
    name = name.removeprefix(PREFIX)
    for added in (BASE_LAYER, ORIGINAL, TRAINED_COPY):
        name = name.replace(added, ".")
    return name


def trained_copies(adapted: nn.Module) -> dict[int, int]:
    """id(a module to save's trained parameter) -> id(its frozen original), over every module
    peft wraps to save (`modules_to_save`)."""
    from peft.utils import ModulesToSaveWrapper

    pairs = {}
    for module in adapted.modules():
        if not isinstance(module, ModulesToSaveWrapper) or ADAPTER not in module.modules_to_save:
            continue
        originals = dict(module.original_module.named_parameters())
        for leaf, copy in module.modules_to_save[ADAPTER].named_parameters():
            pairs[id(copy)] = id(originals[leaf])
    return pairs


def base_name(model: nn.Module) -> str:
    """The name a transformers model was loaded under (`name_or_path`), else its class."""
    config = getattr(model, "config", None)
    return str(getattr(config, "name_or_path", "") or type(model).__name__)


class AdapterState(ParallelRuntime):
    """The `lora` transform's runtime: the base left out of checkpoints, named and hashed in
    them, and checked when one is loaded. Registered as a plugin of its engine, for the
    checkpoint-state hooks."""

    name = "lora"

    def __init__(
        self,
        adapted: nn.Module,
        section: PeftSection,
        *,
        name: str,
        task_type: str | None,
        base: dict[str, Any] | None = None,
        stage_names: bool = False,
        tensor_parallel: TensorParallelFactors | None = None,
        over_stages: StagesRecord | None = None,
    ) -> None:
        """`base`: the record of a base no rank holds whole (a pipelined job's, from every
        stage), else it is hashed here. `stage_names`: the layout before this runtime names the
        parameters as the pipeline stage does (without peft's `base_model.model.`).
        `tensor_parallel`: the adapters' factors on tensor-parallel layers. `over_stages`: how a
        pipelined job's record is taken over every stage's frozen tensors (`stages.stage_base`),
        for a base loaded later."""
        frozen = [(n, p) for n, p in adapted.named_parameters() if not p.requires_grad]
        # id -> (name as hashed, dtype as hashed): a base loaded later is hashed as built.
        self._frozen = {id(p): (n, p.dtype) for n, p in frozen}
        # id(trained copy) -> id(frozen original) of every module to save.
        self._copies = trained_copies(adapted)
        originals = set(self._copies.values())
        # What a weights-only load fills by the base's own names: the frozen tensors, but a
        # module to save's trained copy in its frozen original's place.
        self._loaded_base = {i: i for i in self._frozen if i not in originals} | self._copies
        self._over_stages = over_stages
        self._stage_names = stage_names
        self._tensor_parallel = tensor_parallel
        if base is None:
            base = {"name": name, "sha256": base_hash(frozen), "parameters": len(frozen)}
        self.record = {
            "peft": section.model_dump(mode="json"),
            "task_type": task_type,
            "base": base,
        }

    def before_backward(self, position: MicrobatchPosition) -> None:
        if self._tensor_parallel is not None:
            self._tensor_parallel.before_backward(position)

    def sync_gradients(self) -> None:
        if self._tensor_parallel is not None:
            self._tensor_parallel.sync_gradients()

    def state_layout(self, previous: StateLayout) -> StateLayout:
        """The adapters kept (under peft's one-process names), the base left out under its own
        checkpoint's names (a module to save by its trained copy), and hashed again once a
        weights-only load filled it."""

        def keep(entry: ParameterLayout) -> ParameterLayout | None:
            if id(entry.param) in self._frozen:
                return None
            if self._tensor_parallel is not None:
                entry = self._tensor_parallel.place(entry)
            if self._stage_names and not entry.name.startswith(PREFIX):
                return replace(entry, name=PREFIX + entry.name)
            return entry

        base = [
            replace(entry, name=base_weight_name(entry.name))
            for entry in previous.parameters
            if id(entry.param) in self._loaded_base
        ]
        # Hashed as the frozen tensor (a trained copy as its original).
        hashed_as = {e.name: self._frozen[self._loaded_base[id(e.param)]] for e in base}
        rehash = partial(self._rehash, hashed_as)
        return previous.map(keep).leave_out(base).then_left_out_loaded(rehash)

    def _rehash(self, hashed_as: dict[str, tuple[str, torch.dtype]], loaded: LoadedFrom) -> None:
        """The record of the base a weights-only load just filled, taken as when the adapters
        were added (whole tensors, in their dtype then, under their names then): from the
        tensors the load read, read again whole, so no gather of what later runtimes shard is
        needed; one at a time, in name order, so no rank holds more of the base than one
        tensor beyond its own part."""
        in_order = sorted(hashed_as, key=lambda fqn: hashed_as[fqn][0])
        named = (
            (hashed_as[fqn][0], loaded.read({fqn: hashed_as[fqn][1]})[fqn]) for fqn in in_order
        )
        ours = self.record["base"]
        if self._over_stages is not None:
            base = self._over_stages(named, name=ours["name"])
        else:
            base = {**ours, "sha256": record_hash(named, ours, in_order=True)}
        # The name stays the model's (the export finds a built-in family by it).
        self.record["base"] = {**base, LOADED_FROM: loaded.source}

    @hookimpl
    def plait_checkpoint_state(self, rank: int) -> dict[str, Any] | None:
        del rank
        return {KEY: self.record}

    @hookimpl
    def plait_load_checkpoint_state(self, state: dict[str, Any]) -> None:
        saved = state.get(KEY)
        if saved is None:
            return
        theirs, ours = saved["base"], self.record["base"]
        if theirs["sha256"] != ours["sha256"]:
            remedy = "load the same base model before plait.initialize"
            if LOADED_FROM in theirs:
                remedy = f"set checkpoint_io.init_from = {theirs[LOADED_FROM]!r}, its base"
            raise CheckpointError(
                f"the checkpoint's adapters were trained on base {theirs['name']!r} "
                f"(sha256 {theirs['sha256'][:12]}…, {theirs['parameters']} frozen tensors); this "
                f"job's base is {ours['name']!r} (sha256 {ours['sha256'][:12]}…, "
                f"{ours['parameters']}): {remedy}"
            )

"""LoRA adapters on Megatron tensor-parallel linears: each factor whole or split as its layer is.

The tensor-parallel split runs before the adapter transform (`records.SHARD_ORDER`), so the
linears the adapters wrap are already shards (`TensorParallelism.linear_splits`):

- a column-parallel `W` holds its rank's output rows `W_i`: the adapter keeps `A` whole and
  `B_i`, the same rows of `B`; the rank's output shard is `W_i·x + s·B_i·(A·x)`, with `x` as the
  layer's own product takes it (after its entry collective, so the input gradient of both is
  summed over the ranks alike). `A`'s gradient `Σ_i B_iᵀ·dy_i·xᵀ` is partial on each rank;
- a row-parallel `W` holds its input columns `W_i` and takes `x_i`, the matching features: the
  adapter keeps `A_i`, the same columns of `A`, and `B` whole, and `s·B·A_i·x_i` is added to the
  layer's partial output before its reduction (`B·Σ_i A_i·x_i = Σ_i B·A_i·x_i`). `B`'s gradient
  `s·dy·(A_i·x_i)ᵀ` is partial on each rank.

The whole factor's partial gradients are summed over the tensor-parallel ranks as soon as they
are final, before data parallelism reduces them (`TensorParallelFactors`). Both factors are
drawn whole, as one process draws them, and then cut, so the random stream and the values are
one process's; checkpoints place the cut factors in their whole tensors, so they hold (and
export) whole adapters.

The base's hash (`state.AdapterState`'s record) is taken over whole tensors too, so that
`plait ckpt export --merged` can check the whole base it reads: each frozen slice is gathered
over the tensor-parallel ranks, one tensor at a time, once, when the adapters are added.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from plait.core.comm_algorithms import GENERIC, TP_GRAD
from plait.core.errors import ConfigError
from plait.core.grad_norm import mark_sharded
from plait.core.schedule import MicrobatchPosition
from plait.core.sharding import ShardContext
from plait.core.state_layout import ParameterLayout
from plait.core.transforms import TP_DIM_ATTR, TP_PARTS_ATTR
from plait.plugins.lora.config import PeftSection, lora_config
from plait.plugins.lora.state import PER_TENSOR, digests_hash, tensor_digests

TP_AXIS = "tp"
# The splits an adapter is built for (`TensorParallelism.linear_splits`' plain kinds).
COLUMN, ROW = "column", "row"
# Set on a cut factor: the dim it is cut along (0: B's output rows, 1: A's input columns).
CUT_DIM_ATTR = "_plait_lora_tp_dim"


def check_targets(section: PeftSection, *, context: ShardContext) -> None:
    """Refuse, by name, targets on tensor-parallel layers no adapter is built for."""
    from peft.tuners.tuners_utils import check_target_module_exists

    assert context.tensor_parallel is not None
    if section.target_modules == "all-linear":
        raise ConfigError(
            "[peft] target_modules = 'all-linear' with parallel.tp > 1: the tensor-parallel "
            "layers are no nn.Linear any more; name the modules to adapt"
        )
    config = lora_config(section, task_type=None)
    refused = {
        name: split
        for name, split in context.tensor_parallel.linear_splits.items()
        if split not in (COLUMN, ROW) and check_target_module_exists(config, name)
    }
    if refused:
        raise ConfigError(
            f"[peft] targets tensor-parallel layers split in ways adapters are not built for: "
            f"{refused}; adapt plain column- and row-parallel linears only (exclude_modules)"
        )


def parallel_layers(model: nn.Module, *, context: ShardContext) -> dict[type, type]:
    """peft's custom-layer mapping (`LoraConfig._register_custom_module`): the classes of
    `model`'s column- and row-parallel linears to the adapters below."""
    assert context.tensor_parallel is not None
    _, column, row = adapter_classes()
    mapping: dict[type, type] = {}
    for name, split in context.tensor_parallel.linear_splits.items():
        if split in (COLUMN, ROW):
            mapping[type(model.get_submodule(name))] = column if split == COLUMN else row
    return mapping


@functools.cache
def adapter_classes() -> tuple[type, type, type]:
    """(common base, column, row) adapter layers, built on peft's `lora.Linear` once peft is
    imported (it is optional, so not at this module's import)."""
    from peft.tuners.lora.layer import Linear

    class ParallelLora(Linear):
        """What both kinds share: a factor drawn whole, then cut like the layer's weight."""

        cut_dim: int  # 0: B's output rows (column-parallel), 1: A's input columns (row)

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            tp = self.get_base_layer().tp
            features = "out_features" if self.cut_dim == 0 else "in_features"
            local = getattr(self, features)
            setattr(self, features, local * tp.size)  # drawn whole, as one process draws it
            try:
                super().update_layer(adapter_name, *args, **kwargs)
            finally:
                setattr(self, features, local)
            factors = self.lora_B if self.cut_dim == 0 else self.lora_A
            _cut(factors[adapter_name], dim=self.cut_dim, rank=tp.rank, size=tp.size)

        def low_rank(self, adapter: str, x: torch.Tensor) -> torch.Tensor:
            a, b = self.lora_A[adapter], self.lora_B[adapter]
            return b(a(self.lora_dropout[adapter](x))) * self.scaling[adapter]

    class ColumnParallelLora(ParallelLora):
        """`A` whole, `B` cut on its output rows like the layer's weight."""

        cut_dim = 0

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = self.base_layer(x, *args, **kwargs)
            if self.disable_adapters or self.merged:
                return result
            x = self.base_layer.layer_input(x)
            for adapter in self.active_adapters:
                if adapter in self.lora_A:
                    result = result + self.low_rank(adapter, x)
            return result

    class RowParallelLora(ParallelLora):
        """`A` cut on its input columns like the layer's weight, `B` whole; the low-rank partial
        output joins the layer's before the reduction."""

        cut_dim = 1

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if self.disable_adapters or self.merged:
                return self.base_layer(x, *args, **kwargs)
            partial = [self.low_rank(a, x) for a in self.active_adapters if a in self.lora_A]
            addend = torch.stack(partial).sum(0) if partial else None
            return self.base_layer(x, *args, addend=addend, **kwargs)

    return ParallelLora, ColumnParallelLora, RowParallelLora


def _cut(linear: nn.Linear, *, dim: int, rank: int, size: int) -> None:
    """Keep this rank's contiguous 1/size of `linear`'s weight along `dim`, marked as a tp
    shard (for the gradient norm and the checkpoint layout)."""
    whole = linear.weight
    piece = whole.detach().chunk(size, dim)[rank].clone()
    cut = nn.Parameter(piece, requires_grad=whole.requires_grad)
    mark_sharded(cut, (TP_AXIS,))
    setattr(cut, CUT_DIM_ATTR, dim)
    linear.weight = cut
    linear.out_features, linear.in_features = piece.shape


class TensorParallelFactors:
    """The adapters' factors under tensor parallelism, for the adapter runtime: the whole
    factors' partial gradients summed over tp, the cut ones placed in their whole tensors."""

    def __init__(self, adapted: nn.Module, *, context: ShardContext) -> None:
        self.comm = context.comm
        self.group = context.mesh.group(TP_AXIS)
        self.rank = context.mesh.coordinate(TP_AXIS)
        self.size = self.group.size
        self._final_backward = True
        parallel, _, _ = adapter_classes()
        for module in adapted.modules():
            if not isinstance(module, parallel):
                continue
            for param in (*module.lora_A.parameters(), *module.lora_B.parameters()):
                if param.requires_grad and not hasattr(param, CUT_DIM_ATTR):
                    param.register_post_accumulate_grad_hook(self._sum_over_tp)

    def _sum_over_tp(self, param: torch.Tensor) -> None:
        # NOTE: as the tensor-parallel runtime's own sum: synchronous, registered before any
        # data-parallel hook, and on the gradient once it holds every micro-batch's part (or on
        # every micro-batch when ZeRO-2/3 takes `.grad` away each time).
        if self._final_backward and param.grad is not None:
            self.comm.all_reduce(param.grad, group=self.group, op="sum", purpose=TP_GRAD)

    def before_backward(self, position: MicrobatchPosition) -> None:
        self._final_backward = position.gradients_final

    def sync_gradients(self) -> None:
        self._final_backward = True

    def place(self, entry: ParameterLayout) -> ParameterLayout:
        """A cut factor as the block at this rank's offset of its whole tensor."""
        dim = getattr(entry.param, CUT_DIM_ATTR, None)
        if dim is None:
            return entry
        local = entry.value.global_shape
        global_shape = list(local)
        global_shape[dim] = local[dim] * self.size
        offsets = [0] * len(local)
        offsets[dim] = self.rank * local[dim]
        return entry.map_tensors(
            lambda t: t.sharded_along(TP_AXIS, global_shape=global_shape, offsets=offsets)
        )


def whole_base(adapted: nn.Module, *, name: str, context: ShardContext) -> dict[str, Any]:
    """The base's record hashed over its whole tensors, the tensor-parallel slices gathered:
    the same on every rank, and what the whole base read back at export hashes to."""
    frozen = [(n, p) for n, p in adapted.named_parameters() if not p.requires_grad]
    lines = tensor_digests((n, gathered(p, context=context)) for n, p in frozen)
    return {
        "name": name,
        "sha256": digests_hash(lines),
        "parameters": len(lines),
        "scheme": PER_TENSOR,
    }


def gathered(param: torch.Tensor, *, context: ShardContext) -> torch.Tensor:
    """`param` whole: its tensor-parallel slices (`TP_DIM_ATTR`) concatenated in rank order,
    part by part for a fused projection's (`TP_PARTS_ATTR`)."""
    dim = getattr(param, TP_DIM_ATTR, None)
    if dim is None:
        return param
    group = context.mesh.group(TP_AXIS)
    front = param.detach().movedim(dim, 0).contiguous()
    every = front.new_empty((front.shape[0] * group.size, *front.shape[1:]))
    context.comm.all_gather(every, front, group=group, purpose=GENERIC)
    parts = getattr(param, TP_PARTS_ATTR, 1)
    slices = every.chunk(group.size)
    blocks = [piece for part in range(parts) for piece in (s.chunk(parts)[part] for s in slices)]
    return torch.cat(blocks).movedim(0, dim)

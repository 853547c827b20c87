"""ZeRO stage 3 (FSDP-style): parameters, gradients and optimizer state all sharded, per unit.

The model is cut into units — by default one per entry of `model.layers` (a transformer block)
plus a root unit holding every other parameter. Each unit is one `Segment`; a rank keeps only its
chunk. Every parameter's `.data` is a view into its unit's flat full buffer, whose storage is
resized to zero when the unit is resharded, so the `nn.Parameter` objects (and their names) stay
what the user built while holding no memory.

- Forward: a pre-hook all-gathers the unit (waiting if it was prefetched) and prefetches the next
  `prefetch` units in the order recorded on the previous forward; a post-hook reshards the unit
  and hooks the outputs. The root and, when gradients are on, the last block forward ran stay
  gathered: backward needs them first.
- Backward: a hook on the unit's outputs fires when their gradient is ready, i.e. just before
  the unit's backward: the unit is gathered again and the next units in reverse order are
  prefetched. As each parameter's gradient is accumulated it is copied into the unit's gradient
  bucket and released; once the unit's last gradient arrived the unit is resharded and its bucket
  reduced (asynchronously, `plait.plugins.zero.reduction`) into this rank's gradient chunk.
- Gradient accumulation is sharded: every micro-batch's gradients are reduce-scattered and summed
  into the chunks, so no full gradient outlives its unit's backward. The chunks themselves are
  released after the optimizer step and exist again from the next backward.
- hpZ (`[zero] secondary_shard = "node"`, ZeRO++): a unit resharded after a forward that
  records gradients keeps a secondary shard, this rank's `1/k` of the gathered unit for the `k`
  dp ranks of its node, and backward all-gathers the unit from those inside the node, so only
  forward's gather crosses nodes (forward always gathers from the primary shards). The
  secondary shards are dropped when backward gathers from them and at the end of the step.
- Frozen parameters (`requires_grad=False`, e.g. a LoRA base) are sharded too, in units of
  their own beside the trainable ones of the same module, gathered and freed with them in
  forward and gathered again for backward (input gradients need them); they take no gradient
  bucket, reduction or optimizer state, and are freed once the unit before them starts its
  backward.
- HSDP (`parallel.dp_shard`): the units are sharded over the shard group, and the other
  replicas hold the same shards; the summed chunks are averaged across the replica group once,
  at the gradient-sync boundary, so the slow cross-node link carries `B / dp_shard` per step
  whatever the number of micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from plait.core.blocks import find_block_container
from plait.core.comm import Comm, Group, Work
from plait.core.comm_algorithms import PARAM_GATHER
from plait.core.errors import ConfigError
from plait.core.memory import storage_bytes
from plait.core.mesh import Mesh
from plait.core.schedule import MicrobatchPosition
from plait.core.sharding import OptimizerFactory, ParallelRuntime
from plait.core.state_layout import StateLayout
from plait.core.transforms import ExpertParallelism
from plait.plugins.zero.config import ZeroConfig
from plait.plugins.zero.flat_buffer import Segment
from plait.plugins.zero.groups import split_by_group
from plait.plugins.zero.layout import (
    frozen_shard_layout,
    regather_units,
    sharded_master_layout,
)
from plait.plugins.zero.offload import master_device
from plait.plugins.zero.optimizer import ShardedMaster, model_state_report
from plait.plugins.zero.reduction import (
    PendingReduction,
    average_across_replicas,
    codec_attributes,
    ensure_allocated,
    launch_reduction,
)
from plait.plugins.zero.stage12 import MAX_IN_FLIGHT, broadcast_module

ROOT = "<root>"


def node_group_for_secondary_shards(
    mesh: Mesh, group: Group, replicas: Group | None, experts: ExpertParallelism | None
) -> Group:
    """hpZ's group: the ranks of `group` (dp) on this rank's node, or a refusal naming why
    there is none to keep secondary shards in."""
    where = 'zero.secondary_shard = "node"'
    host_map = mesh.host_map
    hierarchy = host_map.hierarchy(group.ranks) if host_map is not None else None
    if replicas is not None and replicas.size > 1:
        raise ConfigError(f"{where} and parallel.dp_shard (HSDP) both keep backward inside nodes")
    if experts is not None and experts.degree > 1:
        raise ConfigError(f"{where} with parallel.ep > 1 is not supported yet")
    if mesh.gradient_axes() != ("dp",) or hierarchy is None:
        described = host_map.describe() if host_map is not None else "unknown"
        raise ConfigError(
            f"{where}: the {group.name} group ({list(group.ranks)}) needs several nodes of "
            f"several dp ranks each, and no context parallelism (nodes: {described})"
        )
    inner, _ = mesh.split_group("dp", hierarchy.ranks_per_node)
    if tuple(inner.ranks) != tuple(hierarchy.intra_of(mesh.rank)):
        raise ConfigError(
            f"{where}: consecutive dp ranks {list(inner.ranks)} are not the ranks of one node "
            f"{list(hierarchy.intra_of(mesh.rank))}"
        )
    return inner


def find_units(model: nn.Module, rule: str | list[str]) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) of every unit the rule selects, in registration order."""
    if rule == "block":
        # The model's repeated blocks, found as `plait.core.blocks` does for every transform
        # (`_no_split_modules`, else the longest list of one block class).
        path, container = find_block_container(model, field="[zero] unit")
        return [(f"{path}.{name}", module) for name, module in container.named_children()]
    wanted = set(rule)
    units: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or type(module).__name__ not in wanted:
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in units):
            continue  # nested inside a unit already: it belongs to that unit
        units.append((name, module))
    if not units:
        classes = sorted({type(m).__name__ for _, m in model.named_modules()} - {""})
        raise ConfigError(
            f"zero3: no module of class {sorted(wanted)} in {type(model).__name__}; "
            f"classes present: {classes}"
        )
    return units


def unit_parameters(
    model: nn.Module, units: Sequence[tuple[str, nn.Module]], *, trainable: bool = True
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable (or, `trainable=False`, frozen) parameters per unit (and `ROOT`), named as in
    `model`; a parameter shared by two units cannot be sharded by both and is an error."""
    owner: dict[int, str] = {}
    by_unit: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for unit_name, module in units:
        by_unit[unit_name] = []
        for name, p in module.named_parameters(remove_duplicate=False):
            if p.requires_grad != trainable:
                continue
            previous = owner.get(id(p))
            if previous is not None and previous != unit_name:
                raise ConfigError(
                    f"zero3: parameter {unit_name}.{name} is shared by units {previous!r} and "
                    f"{unit_name!r}; untie it or choose units (zero.unit) that contain both uses"
                )
            if previous is None:
                owner[id(p)] = unit_name
                by_unit[unit_name].append((f"{unit_name}.{name}", p))
    root: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad != trainable:
            continue
        unit_of = owner.get(id(p))
        in_a_unit = any(name == u or name.startswith(f"{u}.") for u, _ in units)
        if unit_of is None:
            owner[id(p)] = ROOT
            root.append((name, p))
        elif not in_a_unit and unit_of != ROOT:
            raise ConfigError(
                f"zero3: parameter {name} is shared between unit {unit_of!r} and the rest of the "
                "model (e.g. tied embeddings); untie it or make one unit contain both uses"
            )
    if root:
        by_unit[ROOT] = root
    return by_unit


class Unit:
    """One sharded unit: its chunk, its full buffer (storage freed when resharded), gradients."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        segment: Segment,
        *,
        shard_device: torch.device,
        trainable: bool = True,
    ) -> None:
        # A frozen unit (`requires_grad=False` parameters, e.g. a LoRA base) is sharded and
        # gathered like the others, and has no gradient chunk, reduction or optimizer state.
        self.name, self.module, self.segment = name, module, segment
        self.trainable = trainable
        device = segment.device
        self.full = torch.zeros(segment.padded_numel, dtype=segment.dtype, device=device)
        with torch.no_grad():
            segment.flatten([s.param.detach() for s in segment.slots], self.full)
        self.shard = segment.chunk_of(self.full).to(shard_device, copy=True)
        for slot, view in zip(segment.slots, segment.views(self.full), strict=True):
            slot.param.data = view
        self.grad_chunk = torch.zeros(
            segment.chunk_numel if trainable else 0, dtype=segment.dtype, device=device
        )
        self.slot_index = {id(s.param): i for i, s in enumerate(segment.slots)}
        self.gathered = True
        self.gather_work: Work | None = None
        self.gather_input: torch.Tensor | None = None
        self.grad_bucket: torch.Tensor | None = None
        self.has_grad = [False] * len(segment.slots)
        self.ready = 0
        self.reduced = False
        self.backward_prepared = False
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's node share, forward's

    @property
    def full_bytes(self) -> int:
        return self.segment.nbytes


class FullyShardedRuntime(ParallelRuntime):
    gradients_consumed_each_microbatch = True
    """The runtime of `zero3`."""

    name = "zero3"

    def __init__(
        self,
        model: nn.Module,
        *,
        comm: Comm,
        group: Group,
        mesh: Mesh,
        config: ZeroConfig,
        experts: ExpertParallelism | None = None,
        replicas: Group | None = None,
    ) -> None:
        self.comm, self.group = comm, group
        self.replicas = replicas
        self.mesh_rank = mesh.rank
        self.gradient_reduction = config.gradient_reduction
        self.weight_codec = codec_attributes(config.weight_codec, config.quantize_block)
        self.gradient_codec = codec_attributes(config.gradient_codec, config.quantize_block)
        self.prefetch = config.prefetch_count
        # hpZ: the dp ranks of this node, and this rank's index among them.
        self.node_group = (
            node_group_for_secondary_shards(mesh, group, replicas, experts)
            if config.secondary_shard == "node"
            else None
        )
        selected = find_units(model, config.unit)
        by_unit = unit_parameters(model, selected)
        # Frozen parameters (a LoRA base) are sharded in units of their own beside the
        # trainable ones of the same module, gathered and freed with them.
        frozen = unit_parameters(model, selected, trainable=False)
        empty = [u for u, _ in selected if not by_unit[u] and not frozen[u]]
        if empty:
            raise ConfigError(f"zero3: unit(s) {empty} hold no parameters")
        if config.broadcast_parameters:
            # Every replica starts from the same values: copy over all of dp (× cp).
            everyone = mesh.gradient_group()
            if everyone.size > 1:
                broadcast_module(model, comm, everyone, experts)
        if not any(by_unit.values()):
            raise ValueError("zero3: the module has no trainable parameters")
        device = next(p for params in by_unit.values() for _, p in params).device
        shard_device = master_device(config.offload.device, device)
        modules = {**dict(selected), ROOT: model}
        order = ([ROOT] if ROOT in by_unit or ROOT in frozen else []) + [u for u, _ in selected]
        # With ep > 1 a block's experts are a unit of their own on the same module (gathered
        # and resharded with it), sharded over the expert-dp group.
        parts = [
            (name, part_group, params, trainable)
            for name in order
            for trainable, named in ((True, by_unit), (False, frozen))
            for part_group, params in split_by_group(named.get(name, []), group, experts)
        ]
        self.units = [
            Unit(
                name,
                modules[name],
                Segment(
                    i,
                    params,
                    world_size=part_group.size,
                    rank=part_group.rank_of(mesh.rank),
                    group=part_group,
                ),
                shard_device=shard_device,
                trainable=trainable,
            )
            for i, (name, part_group, params, trainable) in enumerate(parts)
        ]
        self.trained = [u for u in self.units if u.trainable]
        self.roots = [u for u in self.units if u.name == ROOT]
        for unit in self.units:
            self._reshard(unit)
        self.master = ShardedMaster(
            [u.segment for u in self.trained],
            [u.shard for u in self.trained],
            [u.grad_chunk for u in self.trained],
            comm=comm,
            group=group,
            mesh=mesh,
            offload=config.offload,
        )
        self._forward_order: list[Unit] = list(self.units)
        self._last_forward_module = _last_module(self._forward_order, self.roots)
        self._recording: list[Unit] = []
        self._in_flight: list[PendingReduction] = []
        self._first_microbatch = True
        self.peak_gathered_bytes = 0
        self._gradient_bytes_at_step = self.master.gradient_bytes()
        model.register_forward_pre_hook(self._root_pre_forward)
        model.register_forward_hook(self._root_post_forward)
        for unit in self.units:
            if unit not in self.roots:
                unit.module.register_forward_pre_hook(partial(self._pre_forward, unit))
                unit.module.register_forward_hook(partial(self._post_forward, unit))
        for unit in self.trained:
            for slot in unit.segment.slots:
                slot.param.register_post_accumulate_grad_hook(partial(self._on_grad_ready, unit))

    @property
    def root(self) -> Unit | None:
        """The first unit of the parameters outside the blocks (the trainable ones when there
        are both); `roots` holds every such unit."""
        return next(iter(self.roots), None)

    # -- gathering and freeing ---------------------------------------------------------------

    def _start_gather(self, unit: Unit, backward: bool = False) -> None:
        if unit.gathered or unit.gather_work is not None:
            return
        storage = unit.full.untyped_storage()
        storage.resize_(unit.full_bytes)
        if backward and unit.secondary is not None and self.node_group is not None:
            # hpZ: forward's values, from this node's ranks only.
            source, unit.secondary = unit.secondary, None
            with torch.autograd._unsafe_preserve_version_counter(unit.full):
                unit.gather_work = self.comm.all_gather(
                    unit.full, source, group=self.node_group, async_op=True, purpose=PARAM_GATHER
                )
            unit.gather_input = source
            return
        device = unit.full.device
        source = unit.shard if unit.shard.device == device else unit.shard.to(device)
        source = source if source.dtype == unit.full.dtype else source.to(unit.full.dtype)
        # Autograd saved the parameters (views of `full`) in forward; refilling their storage is
        # not a modification it must detect.
        group = _group(unit)
        with torch.autograd._unsafe_preserve_version_counter(unit.full):
            if group.size == 1:  # a one-rank expert-dp group: the shard is the whole unit
                unit.full.copy_(source)
            else:
                unit.gather_work = self.comm.all_gather(
                    unit.full,
                    source,
                    group=group,
                    async_op=True,
                    purpose=PARAM_GATHER,
                    attributes=self.weight_codec,
                )
        unit.gather_input = source
        held = sum(u.full_bytes for u in self.units if u.gathered or u.gather_work is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)

    def _unshard(self, unit: Unit, backward: bool = False) -> None:
        self._start_gather(unit, backward)
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work, unit.gather_input = None, None
        unit.gathered = True

    def _reshard(self, unit: Unit) -> None:
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work, unit.gather_input = None, None
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False

    def _prefetch_after(self, unit: Unit, order: Sequence[Unit], backward: bool = False) -> None:
        if not self.prefetch or unit not in order:
            return
        position = order.index(unit)
        for upcoming in order[position + 1 : position + 1 + self.prefetch]:
            self._start_gather(upcoming, backward)

    # -- forward hooks -----------------------------------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        del module, args
        self._recording = []
        for root in self.roots:
            self._pre_forward(root, None, None)

    def _pre_forward(self, unit: Unit, module: nn.Module | None, args: Any) -> None:
        del module, args
        self._unshard(unit)
        self._recording.append(unit)
        self._prefetch_after(unit, self._forward_order)

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        del args
        # Backward starts (after the root's head) with the block forward ran last: keep it
        # gathered rather than free it and all-gather it again at once (what FSDP2 users get
        # with reshard_after_forward=False on the last block). Backward reshards it as usual.
        if not (torch.is_grad_enabled() and module is self._last_forward_module):
            if self.node_group is not None and torch.is_grad_enabled():
                unit.secondary = self._node_share(unit)
            self._reshard(unit)
        self._hook_outputs(unit, output)

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        del module, args
        if self._recording:
            self._forward_order = list(dict.fromkeys(self._recording))
            self._last_forward_module = _last_module(self._forward_order, self.roots)
        for root in self.roots:
            if torch.is_grad_enabled():
                self._hook_outputs(root, output)
            else:
                self._reshard(root)

    def _hook_outputs(self, unit: Unit, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        unit.backward_prepared = False
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(partial(self._pre_backward, unit))

    # -- backward hooks ----------------------------------------------------------------------

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        del grad
        if unit.backward_prepared:
            return
        unit.backward_prepared = True
        # A frozen unit gets no gradient that would say its backward is over; the gradient of
        # an earlier unit's outputs says so (the later units' backward produced it in full).
        finished = [
            u
            for u in self.units
            if u.backward_prepared and not u.trainable and u.gathered
            if u.module is not unit.module and u not in self.roots
        ]
        for done in finished:
            self._reshard(done)
        self._unshard(unit, backward=True)
        self._prefetch_after(unit, self._backward_order(), backward=True)

    def _backward_order(self) -> list[Unit]:
        # The root's outputs (the head) come first in backward, then the units in reverse.
        rest = [u for u in reversed(self._forward_order) if u not in self.roots]
        return self.roots + rest

    def _on_grad_ready(self, unit: Unit, param: nn.Parameter) -> None:
        segment = unit.segment
        if unit.grad_bucket is None:
            # Not zero-filled: every slot is overwritten by its gradient, and `_reduce` zeroes
            # the padding and the slots of parameters that got none.
            unit.grad_bucket = torch.empty(
                segment.padded_numel, dtype=segment.dtype, device=segment.device
            )
        index = unit.slot_index[id(param)]
        slot = segment.slots[index]
        assert param.grad is not None
        target = unit.grad_bucket[slot.offset : slot.offset + slot.numel]
        if unit.has_grad[index]:  # a second gradient this backward (e.g. reentrant recompute)
            target.add_(param.grad.reshape(-1))
        else:
            target.copy_(param.grad.reshape(-1))
            unit.has_grad[index] = True
            unit.ready += 1
        param.grad = None
        if unit.ready == len(segment.slots):
            self._reshard(unit)
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        segment = unit.segment
        if unit.grad_bucket is None:  # the unit got no gradient at all this backward
            unit.grad_bucket = torch.zeros(
                segment.padded_numel, dtype=segment.dtype, device=segment.device
            )
        else:
            unit.grad_bucket[segment.numel :].zero_()
            for slot, filled in zip(segment.slots, unit.has_grad, strict=True):
                if not filled:
                    unit.grad_bucket[slot.offset : slot.offset + slot.numel].zero_()
        ensure_allocated(unit.grad_chunk)
        pending = launch_reduction(
            self.comm,
            _group(unit),
            segment,
            unit.grad_bucket,
            unit.grad_chunk,
            accumulate=not self._first_microbatch,
            method=self.gradient_reduction,
            codec=self.gradient_codec,
        )
        unit.grad_bucket = None  # the pending reduction holds it until it completes
        unit.reduced = True
        self._in_flight.append(pending)
        if len(self._in_flight) > MAX_IN_FLIGHT:
            self._in_flight.pop(0).complete()

    def _finish_backward(self, keep: Sequence[Unit] = ()) -> None:
        """Reduce units whose gradients did not all arrive (unused parameters count as zero),
        in unit order so every rank agrees, wait for every reduction, free everything but
        `keep`."""
        for unit in self.trained:
            if not unit.reduced:
                self._reduce(unit)
        for pending in self._in_flight:
            pending.complete()
        self._in_flight.clear()
        for unit in self.units:
            unit.ready, unit.reduced, unit.backward_prepared = 0, False, False
            unit.has_grad = [False] * len(unit.segment.slots)
            if (unit.gathered or unit.gather_work is not None) and unit not in keep:
                self._reshard(unit)

    def _kept_for_backward(self) -> list[Unit]:
        """The units forward left gathered for the backward that follows it."""
        return [
            u
            for u in self.units
            if u.gathered and (u in self.roots or u.module is self._last_forward_module)
        ]

    # -- ParallelRuntime -----------------------------------------------------------------------

    def before_backward(self, position: MicrobatchPosition) -> None:
        if not position.first:
            # The previous micro-batch's backward is over; this one's forward already ran.
            self._finish_backward(keep=self._kept_for_backward())
        self._first_microbatch = position.first
        if position.last:
            self.master.prefetch_state()

    def _node_share(self, unit: Unit) -> torch.Tensor:
        """hpZ: this rank's `1/k` of the gathered unit, for its node's `k` dp ranks."""
        assert self.node_group is not None
        share = unit.segment.padded_numel // self.node_group.size
        start = self.node_group.rank_of(self.mesh_rank) * share
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work, unit.gather_input = None, None
        return unit.full[start : start + share].clone()

    def sync_gradients(self) -> None:
        for unit in self.units:
            unit.secondary = None  # forward's values: the optimizer step makes them stale
        self._finish_backward()
        self._average_across_replicas()
        self._gradient_bytes_at_step = self.master.gradient_bytes()

    def _average_across_replicas(self) -> None:
        # HSDP: once per step, the micro-batches already summed into the chunks.
        average_across_replicas(self.comm, self.replicas, [u.grad_chunk for u in self.trained])

    def build_optimizer(
        self, module: nn.Module, factory: OptimizerFactory
    ) -> torch.optim.Optimizer | None:
        del module
        return self.master.build_optimizer(factory)

    def clip_gradients(self, max_norm: float) -> torch.Tensor | None:
        return self.master.clip_gradients(max_norm)

    def zero_grad(self) -> bool:
        self.master.release_gradients()
        return True

    def memory_report(self) -> dict[str, int] | None:
        if self.master.files is not None:
            self.master.files.wait()  # count what is really resident, not what is in flight
        gathered = [u.full for u in self.units if u.gathered]
        report = model_state_report(
            parameters=storage_bytes([*(u.shard for u in self.units), *gathered])
            + self.master.master_bytes(),
            gradients_at_step=self._gradient_bytes_at_step,
            resident_gradients=self.master.gradient_bytes()
            + storage_bytes(u.grad_bucket for u in self.units),
            optimizer_state=self.master.optimizer_state_bytes(),
        )
        report["peak_gathered_parameters"] = self.peak_gathered_bytes
        report["largest_unit_parameters"] = max(u.full_bytes for u in self.units)
        report["frozen_parameters"] = storage_bytes(u.shard for u in self.units if not u.trainable)
        if self.master.files is not None:
            report["offloaded_optimizer_state"] = self.master.files.offloaded_bytes
        return report

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Gather every unit so the module's parameters can be read (like FSDP's
        `summon_full_params`). Between steps stage 3 holds only shards: a parameter's storage is
        released, so reading it outside this context is not allowed. Collective: call on every
        rank of the data-parallel group."""
        was_gathered = [unit.gathered for unit in self.units]
        for unit in self.units:
            self._unshard(unit)
        try:
            yield
        finally:
            for unit, keep in zip(self.units, was_gathered, strict=True):
                if not keep:
                    self._reshard(unit)

    def state_layout(self, previous: StateLayout) -> StateLayout:
        publish = partial(regather_units, self.units, self.comm)
        axes, replicas = self.master.shard_axes, self.master.replica_axes
        frozen = frozen_shard_layout(previous, self.units, axes, replicas)
        return sharded_master_layout(frozen, self.master, publish=publish)

    def state_dict(self) -> dict[str, Any]:
        return self.master.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.master.load_state_dict(state)


def _last_module(order: Sequence[Unit], roots: Sequence[Unit]) -> nn.Module | None:
    """The module of the last unit other than the roots in `order` (its experts' unit and its
    frozen unit share it)."""
    return next((u.module for u in reversed(order) if u not in roots), None)


def _group(unit: Unit) -> Group:
    assert unit.segment.group is not None, "ZeRO-3 units are built with their group"
    return unit.segment.group

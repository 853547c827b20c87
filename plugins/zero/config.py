"""The `[zero]` config section, shared by the `zero1`, `zero2` and `zero3` strategies."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from plait.core.config import Section


class OffloadConfig(Section):
    """`[zero.offload]`: where the optimizer state (and stage 3's parameter shards) live."""

    device: Literal["none", "cpu", "nvme"] = Field(
        "none",
        description="none: with the model; cpu: host memory, optimizer steps on the CPU "
        "(a no-op when training on the CPU); nvme: optimizer state in files under `path`",
    )
    path: str = Field("", description="directory for offload files (device = 'nvme')")
    io_workers: int = Field(2, gt=0, description="background threads for file reads/writes")


class ZeroConfig(Section):
    """`[zero]` section."""

    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size in MiB (stages 1 and 2)")
    prefetch: bool | int = Field(
        1,
        description="stage 3: units all-gathered ahead of the one computing (true = 1, false = 0)",
    )
    unit: str | list[str] = Field(
        "block",
        description="stage 3 units: 'block' = each of the model's repeated blocks (its "
        "`_no_split_modules`, else its longest list of one block class), or a list of module "
        "class names; parameters outside every unit form the root unit",
    )
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    broadcast_parameters: bool = Field(
        True, description="copy dp rank 0's parameters to every rank before sharding"
    )
    gradient_reduction: Literal["auto", "reduce_scatter"] = Field(
        "auto",
        description="stages 2 and 3: auto = reduce-scatter on GPU, a summing all-reduce on "
        "Gloo (faster there); reduce_scatter = always, e.g. to test the GPU path on CPU",
    )

    shard_optimizer_across_replicas: bool = Field(
        False,
        description="stages 1 and 2 under HSDP (parallel.dp_shard): shard the optimizer state "
        "over every dp rank, not only the shard group (same cross-node bytes, 1/dp_replicate "
        "of the optimizer state)",
    )

    quantize_weights: Literal["none", "int8"] = Field(
        "none",
        description="stage 3 (ZeRO++ qwZ): the parameter all-gather's cross-node hop sends "
        "block-wise int8 with one fp32 scale per block (needs the hierarchical algorithm)",
    )
    quantize_gradients: Literal["none", "int8", "int4"] = Field(
        "none",
        description="stages 2 and 3 (ZeRO++ qgZ): the gradient reduce-scatter's cross-node "
        "hop sends block-wise int8 or int4 (needs the hierarchical algorithm)",
    )
    secondary_shard: Literal["none", "node"] = Field(
        "none",
        description="stage 3 (ZeRO++ hpZ): after forward each rank keeps its node's share of "
        "the gathered unit, so backward gathers inside the node (1/ranks-per-node more memory)",
    )
    quantize_block: int = Field(
        256, ge=2, multiple_of=2, description="elements per codec block (one scale each)"
    )

    @property
    def weight_codec(self) -> str | None:
        return None if self.quantize_weights == "none" else self.quantize_weights

    @property
    def gradient_codec(self) -> str | None:
        return None if self.quantize_gradients == "none" else self.quantize_gradients

    @field_validator("prefetch")
    @classmethod
    def _prefetch_count(cls, value: bool | int) -> bool | int:
        if not isinstance(value, bool) and value < 0:
            raise ValueError(f"prefetch must be true, false or a count >= 0, got {value}")
        return value

    @field_validator("unit")
    @classmethod
    def _unit_rule(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str) and value != "block":
            raise ValueError(f"unit must be 'block' or a list of class names, got {value!r}")
        if isinstance(value, list) and not value:
            raise ValueError("unit: the list of module class names is empty")
        return value

    @property
    def prefetch_count(self) -> int:
        return int(self.prefetch)

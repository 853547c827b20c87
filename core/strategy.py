"""Declare a strategy once: name, axis and config class become its record and its name guard.

A plugin module that implements strategies writes::

    strategies = Strategies()

    @strategies.provide(name="my_dp", axis="dp", config_cls=MyDPConfig)
    def shard_my_dp(model, *, context, config):
        return Sharded(module=model, runtime=MyDataParallel(model, context, config))

    plait_register_strategies = strategies.plait_register_strategies
    plait_shard = strategies.plait_shard

`provide` builds the `StrategyRecord`; `plait_shard` answers only for the (axis, name) pairs
declared here and hands the shard function its validated config section (`None` when the
strategy has no `config_cls`). A plugin class can hold a `Strategies` and expose the same two
hook implementations the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from plait.core.hookspecs import hookimpl
from plait.core.records import ShardAxis, StrategyRecord

if TYPE_CHECKING:
    from pydantic import BaseModel
    from torch import nn

    from plait.core.sharding import ShardContext, Sharded


class ShardFunction(Protocol):
    def __call__(self, model: nn.Module, *, context: ShardContext, config: Any) -> Sharded: ...


@dataclass(frozen=True, slots=True)
class _Declared:
    record: StrategyRecord
    shard: ShardFunction


class Strategies:
    """The strategies one plugin provides, and the two hook implementations that serve them."""

    def __init__(self) -> None:
        self._declared: dict[tuple[str, str], _Declared] = {}

    def provide(
        self,
        *,
        name: str,
        axis: ShardAxis,
        config_cls: type[BaseModel] | None = None,
        config_section: str = "",
        description: str = "",
        gradient_collectives: tuple[str, ...] = ("all_reduce",),
    ) -> Callable[[ShardFunction], ShardFunction]:
        """Decorate the function that shards a model for strategy `name` on `axis`."""
        record = StrategyRecord(
            name=name,
            axis=axis,
            config_cls=config_cls,
            config_section=config_section,
            description=description,
            gradient_collectives=gradient_collectives,
        )
        if (axis, name) in self._declared:
            raise ValueError(f"strategy {name!r} is declared twice for axis {axis!r}")

        def declare(function: ShardFunction) -> ShardFunction:
            self._declared[(axis, name)] = _Declared(record=record, shard=function)
            return function

        return declare

    @property
    def records(self) -> list[StrategyRecord]:
        return [declared.record for declared in self._declared.values()]

    @hookimpl
    def plait_register_strategies(self) -> Sequence[StrategyRecord]:
        return self.records

    @hookimpl
    def plait_shard(
        self, axis: str, name: str, model: nn.Module, context: ShardContext
    ) -> Sharded | None:
        declared = self._declared.get((axis, name))
        if declared is None:
            return None
        record = declared.record
        config = (
            context.config.section(record.config_section or record.name, record.config_cls)
            if record.config_cls is not None
            else None
        )
        return declared.shard(model, context=context, config=config)

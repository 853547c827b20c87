"""Options of the parameter server: the `[comm.param_server]` table (its record's `config_cls`)::

[comm]
algorithm = "param_server"

[comm.param_server]
mode = "async"
staleness = 1
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from plait.core.config import Section


class ParamServerConfig(Section):
    """Colocated parameter server: every rank is a worker, the first `num_servers` also serve."""

    mode: Literal["sync", "async"] = Field(
        "sync", description="sync = every pull sees this step's pushes; async = bounded staleness"
    )
    staleness: int = Field(
        1, ge=0, description="async only: a pull may be this many steps behind the push"
    )
    num_servers: int = Field(
        0, ge=0, description="ranks that serve a shard of each bucket; 0 = every rank"
    )

    @property
    def effective_staleness(self) -> int:
        return self.staleness if self.mode == "async" else 0

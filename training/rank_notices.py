"""Notices every rank would print alike, printed by one rank instead.

"resumed from <checkpoint> at step N" is the same on every rank (they agree on the checkpoint
before loading it), so only global rank 0 says it. "no daemon reachable at <address>" depends on
the node (each node's ranks look for their own node's daemon), so local rank 0 of each node says
it. Everything else every rank logs is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RepeatedNotice:
    logger: str
    message_prefix: str  # of the record's unformatted message
    said_by: str  # "rank" (global rank 0 speaks) or "local_rank" (local rank 0 of each node)


REPEATED_NOTICES = (
    RepeatedNotice("plait.plugins.checkpoint.checkpointer", "resumed from ", "rank"),
    RepeatedNotice("plait.telemetry", "plait telemetry: no daemon reachable", "local_rank"),
)


class _DropRepeated(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_repeated_notices(env: Mapping[str, str]) -> None:
    """On a rank that is not the one to speak, drop the notices another rank prints alike."""
    ranks = {"rank": int(env.get("RANK", "0")), "local_rank": int(env.get("LOCAL_RANK", "0"))}
    for notice in REPEATED_NOTICES:
        logger = logging.getLogger(notice.logger)
        # Drop the filters of an earlier run in this process first (tests run several).
        for old in [f for f in logger.filters if isinstance(f, _DropRepeated)]:
            logger.removeFilter(old)
    for notice in REPEATED_NOTICES:
        if ranks[notice.said_by] != 0:
            logger = logging.getLogger(notice.logger)
            logger.addFilter(_DropRepeated((notice.message_prefix,)))

"""Where a rank or the CLI finds its node daemon: the config's address, else `$PLAIT_DAEMON`.

Imports nothing heavy, so `plait status` and the daemon itself can read it without loading
gRPC or OpenTelemetry.
"""

from __future__ import annotations

import os

DEFAULT_DAEMON_ADDRESS = "127.0.0.1:7461"
DAEMON_ENV = "PLAIT_DAEMON"


def resolve_daemon_address(configured: str = "") -> str:
    """The config's address, else `$PLAIT_DAEMON`, else the daemon's default bind address."""
    return configured or os.environ.get(DAEMON_ENV, "") or DEFAULT_DAEMON_ADDRESS

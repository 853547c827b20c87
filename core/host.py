"""This node's name, as the ranks report it and the daemon shows it.

Containers and clusters often give hosts names that mean nothing to an operator (a pod id, a
VM's internal name). `PLAIT_HOST_NAME` sets the name; otherwise OpenTelemetry's own
`host.name` from `OTEL_RESOURCE_ATTRIBUTES` (as an operator's collector setup would set it);
otherwise the hostname.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def host_name(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    explicit = env.get("PLAIT_HOST_NAME", "").strip()
    if explicit:
        return explicit
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "host.name" and value.strip():
            return value.strip()
    return socket.gethostname()

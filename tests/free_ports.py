"""Ports for tests: one nobody can take (a dead endpoint), and one for a server in another
process that must be told its port before it starts.

Port 0 is the rule wherever the server reports back the port it bound. Where it cannot
(torchrun's rendezvous store, etcd), a port from the kernel's ephemeral range would be free
when checked and could still go to any outgoing connection before the server binds it. So the
port is drawn at random below that range, which the kernel never hands out by itself, away from
the well-known defaults (torchrun's 29400 and 29500, the daemon's 7461), and checked free.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager

EXPLICIT_PORTS = range(20000, 32768)  # below Linux's default ephemeral range (32768-60999)
DEFAULTS_TO_AVOID = {29400, 29500}


def unassigned_port() -> int:
    """A port no process binds now, from the range only explicit binds use."""
    draw = random.Random()  # independent of any seed a test set
    while True:
        port = draw.choice(EXPLICIT_PORTS)
        if port in DEFAULTS_TO_AVOID:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))  # every address: free for a server on any of them
            except OSError:
                continue
        return port


@contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port that refuses connections for the whole block: bound and not listening,
    so no other process can start listening on it meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]

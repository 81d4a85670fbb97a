"""Picking a free TCP port for a service that will bind it a moment later.

Binding port 0 and closing the socket (the usual trick) returns a port from the kernel's
ephemeral range, the same range every outgoing connection takes its source port from. In the
time between the pick and the child's bind, any gRPC or Redis connection on the host may be
given that port, and the child fails with "address already in use" (seen in the test suite:
a worker of a freshly started mesh lost its port this way). The same holds when a supervisor
restarts a dead child at its old port. So ports are picked below the ephemeral range, where
only an explicit bind can take them, and checked to be free now.

Two processes that pick on one host (a test runner's parallel workers, two `llmesh up`) can
still pick the same port before either child binds it. `$LLMESH_PORT_RANGE` ("LO-HI", both
inclusive) gives a process and its children a slice of their own: `tests/conftest.py` gives
each pytest-xdist worker one.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping

_LOWEST = 20000  # above the well-known and most registered services' ports
ENV_RANGE = "LLMESH_PORT_RANGE"
_TRIES = 64
# Ports this process has handed out: a mesh picks several before any child binds its own, so
# a later pick must not return an earlier one that is still free only because it is not bound yet.
_handed: set[int] = set()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's (first, last) ephemeral port; Linux's default where it cannot be read."""
    try:
        with open(path) as f:
            first, last = (int(v) for v in f.read().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_range(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """The (lowest, highest) port `free_port` picks from: `$LLMESH_PORT_RANGE` when set, else
    `_LOWEST` up to the ephemeral range; None where that leaves fewer than 1,000 ports."""
    environ = os.environ if environ is None else environ
    spec = environ.get(ENV_RANGE)
    if spec:
        lo, sep, hi = spec.partition("-")
        if not (sep and lo.strip().isdigit() and hi.strip().isdigit()) or not 0 < int(lo) <= int(hi) < 65536:
            raise ValueError(f"${ENV_RANGE}={spec!r}: expected LO-HI, two ports with LO <= HI")
        return int(lo), int(hi)
    first, _ = ephemeral_range()
    return (_LOWEST, first - 1) if first - _LOWEST >= 1000 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing is bound to now, from `pick_range` if it has one free."""
    span = pick_range()
    if span is not None:
        for _ in range(_TRIES):
            port = random.randint(*span)
            if port not in _handed and _binds(host, port):
                _handed.add(port)
                return port
    with socket.socket() as s:  # a host with a tiny or odd range: the kernel's pick
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed.add(port)
    return port

"""Ports for the servers and nodes the tests start, and for addresses nothing answers at.

A port found free by binding port 0 lies in Linux's ephemeral range (32768-60999), where every outgoing
connection of every process on the machine takes its local port: between the check and the server binding
it (a second or more for a program that starts Python or Ray first), one of the Ray clusters and servers
other tests run beside it may take it, and the server then fails to start (a second node's `ray start`
exited 1 so in CI). These come from below that range and above Ray's worker ports (10002-19999 by default)."""

from __future__ import annotations

import random
import socket

PORTS = range(20000, 32768)
_handed_out: set[int] = set()
_choose = random.SystemRandom()   # not the `random` a test may seed: two processes would pick alike


def free_port() -> int:
    """A port no process here listens on or has bound, none handed out before by this process."""
    for _ in range(1000):
        port = _choose.choice(PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1}")

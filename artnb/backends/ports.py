"""Ports on 127.0.0.1 for the servers artnb starts (the engines, `artnb serve` in tests, the FSDP ranks).

A port the kernel hands out for a bind to port 0 comes from its ephemeral range, the same range it draws the
local port of every outgoing connection from. A server binds its port seconds after it was chosen (after loading
a model), and in between a connection from any program on the machine can be given that port: seen once in
about ten FSDP starts, and once in five clean test runs for an engine. `free_port()` picks below that range,
where a port is only taken by a program that asks for it by number. What is left of the race (such a program)
the engines handle by launching again on a new port (engines/child_process.py).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_IANA_EPHEMERAL_START = 49152  # where the kernel's range is unknown (not Linux)


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's ip_local_port_range; IANA's elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _IANA_EPHEMERAL_START


def free_port() -> int:
    """A port on 127.0.0.1 below the kernel's ephemeral range that nothing uses right now (one with a socket
    in TIME_WAIT is passed over too)."""
    low = ephemeral_start()
    candidates = list(range(max(1024, low - 8192), low))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {max(1024, low - 8192)}-{low - 1} on 127.0.0.1")


def port_free(port: int) -> bool:
    """True when nothing listens on 127.0.0.1:`port` (a socket in TIME_WAIT does not count, as for uvicorn)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True

"""Loopback addresses for the programs tests and benchmarks start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port the OS says is free now (for a program that cannot bind port 0 and say
    which it got)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

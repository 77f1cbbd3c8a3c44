"""Loopback ports for the real processes tests start (every test listens on 127.0.0.1 only)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice; the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

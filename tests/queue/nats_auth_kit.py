"""A throwaway real nats-server in decentralised-JWT mode (operator, accounts, resolver MEMORY),
configured from an installation's keys as the chart's servers are (queue/trust.py), and creds
for each role. Permission violations show in the server's log as "Violation" lines.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmendpoints_common.queue.trust import Installation, mint, server_config
from nats_kit import NATS_SERVER, free_port


@dataclass
class AuthNats:
    url: str
    log_path: Path
    installation: Installation

    def creds(self, role: str, endpoint: str | None = None) -> str:
        """A fresh creds file's text for the role (and endpoint)."""
        return mint(self.installation.signer, role, endpoint, issued_at=int(time.time()))

    def creds_file(self, tmp: Path, role: str, endpoint: str | None = None) -> str:
        path = tmp / f"{role}-{(endpoint or '').replace('/', '_')}-{time.monotonic_ns()}.creds"
        path.write_text(self.creds(role, endpoint))
        return str(path)

    def violations(self) -> list[str]:
        return [line for line in self.log_path.read_text().splitlines() if "Violation" in line]


def wait_listening(port: int, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nats-server exited:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise TimeoutError("nats-server did not listen within 60 s")


@contextlib.contextmanager
def auth_nats(tmp: Path, config: str | None = None) -> Iterator[AuthNats]:
    """``config``: the whole nats.conf (the chart's, say) to run instead of the default one.
    It is written to ``tmp/config/nats.conf`` and the installation's trust to
    ``tmp/auth/auth.conf``, laid out as in the chart's pods (``include ../auth/auth.conf``:
    nats-server resolves includes from the including file's folder)."""
    installation = Installation.generate()
    (tmp / "auth").mkdir(exist_ok=True)
    (tmp / "config").mkdir(exist_ok=True)
    (tmp / "auth" / "auth.conf").write_text(server_config(installation))
    port = free_port()
    conf = tmp / "config" / "nats.conf"
    conf.write_text(
        config
        or (
            "max_payload: 33554432\n"
            f"jetstream {{ store_dir: {tmp / 'js'} }}\n"
            "include ../auth/auth.conf\n"
        )
    )
    log_path = tmp / "nats.log"
    with log_path.open("ab") as handle:
        process = subprocess.Popen(
            [str(NATS_SERVER), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)],
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_listening(port, process, log_path)
        yield AuthNats(f"nats://127.0.0.1:{port}", log_path, installation)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)

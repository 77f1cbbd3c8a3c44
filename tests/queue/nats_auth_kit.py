"""A throwaway real nats-server in decentralised-JWT mode (operator, accounts, resolver MEMORY),
configured from an installation's keys as the chart's servers are (queue/trust.py), and creds
for each role. Permission violations show in the server's log as "Violation" lines.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from integration.nats_kit import NatsServer, running_nats
from llmendpoints_common.queue.trust import Installation, mint, server_config


@dataclass
class AuthNats:
    server: NatsServer
    installation: Installation

    @property
    def url(self) -> str:
        return self.server.url

    def violations(self) -> list[str]:
        return self.server.violations()

    def creds(self, role: str, endpoint: str | None = None) -> str:
        """A fresh creds file's text for the role (and endpoint)."""
        return mint(self.installation.signer, role, endpoint, issued_at=int(time.time()))

    def creds_file(self, tmp: Path, role: str, endpoint: str | None = None) -> str:
        path = tmp / f"{role}-{(endpoint or '').replace('/', '_')}-{time.monotonic_ns()}.creds"
        path.write_text(self.creds(role, endpoint))
        return str(path)


@contextlib.contextmanager
def auth_nats(tmp: Path, config: str | None = None) -> Iterator[AuthNats]:
    """``config``: the whole nats.conf (the chart's, say) to run instead of the default one.
    It is written to ``tmp/config/nats.conf`` and the installation's trust to
    ``tmp/auth/auth.conf``, laid out as in the chart's pods (``include ../auth/auth.conf``:
    nats-server resolves includes from the including file's folder)."""
    installation = Installation.generate()
    (tmp / "auth").mkdir(exist_ok=True)
    (tmp / "auth" / "auth.conf").write_text(server_config(installation))
    config = config or (
        "max_payload: 33554432\n"
        f"jetstream {{ store_dir: {tmp / 'js'} }}\n"
        "include ../auth/auth.conf\n"
    )
    with running_nats(
        tmp, config, config_path=tmp / "config" / "nats.conf", store_flags=False
    ) as server:
        yield AuthNats(server, installation)

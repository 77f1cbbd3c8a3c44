"""The chart's NATS, as its pods run it, on this machine: the rendered nats.conf (ConfigMap), the
keys Secret's files, and what the init container writes from them (its own command, run here
with the pod's paths moved under a folder). A test then runs nats-server on exactly that, and
mints creds the way the operator and the gateway's init container do.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integration.nats_kit import _free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NATS_SERVER = BIN / "nats-server"


@dataclass
class ChartNats:
    """The chart's NATS files laid out under ``root`` as in the pod (``/etc/nats`` -> root)."""

    root: Path
    config: Path  # root/config/nats.conf
    keys: Path  # root/keys: the keys Secret's files

    def run_init_container(self, init: dict[str, Any]) -> None:
        """The NATS pod's init container's command, with its paths moved under root."""
        command = [part.replace("/etc/nats/", f"{self.root}/") for part in init["command"]]
        assert command[0] == "llmendpoints-operator", command
        done = subprocess.run(
            [str(BIN / command[0]), *command[1:]], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr


def lay_out(docs: list[dict[str, Any]], root: Path) -> tuple[ChartNats, dict[str, Any]]:
    """Write the rendered NATS ConfigMap and keys Secret under ``root``, run the init
    container's command; returns the files and the StatefulSet's pod spec."""
    (config_map,) = [
        d for d in docs if d["kind"] == "ConfigMap" and "nats.conf" in (d.get("data") or {})
    ]
    (statefulset,) = [d for d in docs if d["kind"] == "StatefulSet"]
    pod = statefulset["spec"]["template"]["spec"]
    keys_secret = next(v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == "keys")
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == keys_secret]
    nats = ChartNats(root=root, config=root / "config" / "nats.conf", keys=root / "keys")
    for folder in ("config", "keys", "auth"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    nats.config.write_text(
        config_map["data"]["nats.conf"].replace("/data/jetstream", str(root / "js"))
    )
    for name, value in secret["data"].items():
        (nats.keys / name).write_bytes(base64.b64decode(value))
    (init,) = pod["initContainers"]
    nats.run_init_container(init)
    return nats, pod


@dataclass
class RunningNats:
    url: str
    log: Path

    def violations(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if "Violation" in line]


@contextmanager
def running(nats: ChartNats) -> Iterator[RunningNats]:
    """nats-server on the chart's configuration; only the addresses are changed (loopback,
    free ports: the client port and the monitoring port, which the chart binds to 127.0.0.1)."""
    port, monitor = _free_port(), _free_port()
    log = nats.root / "nats.log"
    with log.open("wb") as handle:
        proc = subprocess.Popen(
            [str(NATS_SERVER), "-c", str(nats.config), "-a", "127.0.0.1", "-p", str(port),
             "-m", str(monitor)],
            env={**os.environ, "POD_NAME": "llmendpoints-nats-0"},
            stdout=handle, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "Server is ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        yield RunningNats(f"nats://127.0.0.1:{port}", log)
    finally:
        proc.terminate()
        proc.wait(10)

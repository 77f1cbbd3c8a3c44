"""The chart's NATS, as its pods run it, on this machine: the rendered nats.conf (ConfigMap), the
keys Secret's files, and what the init container writes from them (its own command, run here
with the pod's paths moved under a folder). A test then runs nats-server on exactly that, and
mints creds the way the operator and the gateway's init container do.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integration.nats_kit import NatsServer, running_nats
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


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


@contextmanager
def running(nats: ChartNats) -> Iterator[NatsServer]:
    """nats-server on the chart's configuration; only the addresses are changed (loopback,
    free ports: the client port and the monitoring port, which the chart binds to 127.0.0.1)."""
    with running_nats(
        nats.root,
        nats.config.read_text(),
        config_path=nats.config,
        monitor_port=free_port(),
        env={"POD_NAME": "llmendpoints-nats-0"},
        store_flags=False,  # the chart's jetstream block, its store moved under root
    ) as server:
        yield server

"""A private network namespace for tests that aim requests at forbidden addresses.

An SSRF test must name the cloud metadata address (169.254.169.254) -- and must never send a
packet to it, or to any other real non-loopback address, if the defence under test fails. So the
server under test runs in a network namespace of its own (``unshare --net``): only a loopback
interface, with 169.254.169.254 added to it, where the test listens and counts connections.
A mount namespace as well lets the test give the server its own /etc/hosts (a host name that
resolves to the metadata address, for the after-DNS check).

The test process stays in the host's namespace. It reaches the server through `Forwarder`
(127.0.0.1:P outside -> 127.0.0.1:server-port inside), and creates sockets inside the namespace
from one thread that joined it with setns(2) (`Namespace.run`): a socket belongs to the
namespace of the thread that created it, whichever thread later uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

METADATA_ADDRESS = "169.254.169.254"
CLONE_NEWNET = 0x40000000
_T = TypeVar("_T")


def unavailable_reason() -> str | None:
    """Why private network namespaces cannot be made here (None: they can)."""
    for tool in ("unshare", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "sh", "-c", "ip link set lo up"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    if probe.returncode != 0:
        return f"`unshare --net --mount` failed (needs root or user namespaces): {probe.stderr.strip()}"
    return None


def namespaced_command(command: list[str], hosts_file: Path) -> list[str]:
    """`command` in new network + mount namespaces: loopback up, the metadata address on it,
    `hosts_file` as /etc/hosts. Exec'd, so the process id is the namespace's owner."""
    setup = (
        "set -e; ip link set lo up; "
        f"ip addr add {METADATA_ADDRESS}/32 dev lo; "
        f"mount --bind {hosts_file} /etc/hosts; "
        'exec "$@"'
    )
    return ["unshare", "--net", "--mount", "sh", "-c", setup, "sh", *command]


class Namespace:
    """Runs callables on a thread that has joined the network namespace of process `pid`."""

    def __init__(self, pid: int, timeout: float = 20.0):
        self.pid = pid
        # Right after fork the process is still in our namespace; joining it then would put
        # the "inside" thread outside. Wait until unshare has moved it.
        ours = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + timeout
        while os.readlink(f"/proc/{pid}/ns/net") == ours:
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {pid} did not enter a network namespace of its own")
            time.sleep(0.01)
        self._executor = ThreadPoolExecutor(1, initializer=self._enter)

    def _enter(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/proc/{self.pid}/ns/net", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET) failed")
        finally:
            os.close(fd)

    def run(self, fn: Callable[[], _T]) -> _T:
        return self._executor.submit(fn).result()

    def close(self) -> None:
        self._executor.shutdown(wait=False)


class ConnectionCounter:
    """A TCP listener that counts the connections it accepts (and closes them at once)."""

    def __init__(self, server: socket.socket):
        self.server = server
        self.count = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.count += 1
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()


class Forwarder:
    """127.0.0.1:`port` in this namespace -> 127.0.0.1:`target_port` inside `namespace`."""

    def __init__(self, namespace: Namespace, target_port: int):
        self.namespace = namespace
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = self.namespace.run(
                lambda: socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            )
        except OSError:
            client.close()  # not listening yet: the caller sees a dropped connection
            return
        upstream.settimeout(None)
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

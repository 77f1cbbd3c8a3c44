"""Real processes for gateway tests: the gateway (`python -m llmendpoints_gateway serve`), the
runtime on the demo model (launched by tests/runtime/runtime_process.py) and the stand-in
backend (bench/gateway_standin.py) for failures that a real engine cannot be made to have on cue
(a crash before the first byte, a cut mid-stream)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import runtime_process
import yaml
from ports import free_port
from proc_kit import wait_until
from runtime_process import RuntimeServer, ServedProcess, clean_env

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
STANDIN = REPO / "bench" / "gateway_standin.py"


@dataclass
class Process(ServedProcess):
    metrics_port: int | None = None  # the gateway's /metrics (GATEWAY_METRICS_PORT)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port or self.port}/metrics"


def _spawn(argv: list[str], env: dict[str, str], port: int, log_path: Path) -> Process:
    handle = log_path.open("wb")
    process = subprocess.Popen(
        argv, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
    )
    return Process(process, port, log_path)


def write_endpoints(path: Path, endpoints: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"endpoints": endpoints}))
    return path


def launch_gateway(log_dir: Path, port: int | None = None, **settings: str) -> Process:
    port = port or free_port()
    metrics_port = free_port()
    env = clean_env(
        **{
            "HOST": "127.0.0.1",
            "PORT": str(port),
            "GATEWAY_METRICS_PORT": str(metrics_port),
            "LOG_FORMAT": "json",
            "GATEWAY_PROBE_INTERVAL_SECONDS": "0.2",
            "GATEWAY_IDLE_PROBE_INTERVAL_SECONDS": "1.0",
            **settings,
        }
    )
    gateway = _spawn(
        [PYTHON, "-m", "llmendpoints_gateway", "serve"], env, port, log_dir / f"gateway-{port}.log"
    )
    gateway.metrics_port = metrics_port
    return gateway


@contextlib.contextmanager
def running_gateway(log_dir: Path, **settings: str) -> Iterator[Process]:
    gateway = launch_gateway(log_dir, **settings)
    try:
        gateway.wait_http("/health")
        yield gateway
    finally:
        gateway.stop()


def launch_standin(
    log_dir: Path,
    name: str,
    port: int | None = None,
    ready_after: float = 0.0,
    *,
    control_port: bool = False,
    named_control_port: int = 0,
) -> Process:
    """``control_port``: probes and /metrics on a second port too, named in the main port's
    probe answers as the runtime names its LLMEP_CONTROL_PORT; ``named_control_port``: a port
    named there that nothing listens on."""
    port = port or free_port()
    argv = [
        PYTHON,
        str(STANDIN),
        "--port",
        str(port),
        "--name",
        name,
        "--ready-after",
        str(ready_after),
        *(["--control-port", str(free_port())] if control_port else []),
        *(["--name-control-port", str(named_control_port)] if named_control_port else []),
    ]
    return _spawn(argv, clean_env(), port, log_dir / f"standin-{name}-{port}.log")


@contextlib.contextmanager
def key_counting_gateways(
    log_dir: Path,
    endpoints_file: Path,
    queue_url: str,
    ready: Callable[[Process], bool],
    what: str,
    timeout: float,
) -> Iterator[list[Process]]:
    """Two gateway processes (g1, g2) on one endpoints file and one queue, their metrics
    labelled by key (the quota and metering tests count per key), each up and ``ready``."""
    procs = [
        launch_gateway(
            log_dir,
            GATEWAY_ENDPOINTS_FILE=str(endpoints_file),
            JOBS_QUEUE_URL=queue_url,
            GATEWAY_ID=f"g{i}",
            GATEWAY_METRICS_KEY_LABELS="1",
        )
        for i in (1, 2)
    ]
    try:
        for proc in procs:
            proc.wait_http("/health")
        for proc in procs:
            wait_until(lambda proc=proc: ready(proc), timeout, what, interval=0.05)
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@contextlib.contextmanager
def running_standins(log_dir: Path, *names: str) -> Iterator[dict[str, Process]]:
    """Stand-ins by name, started together and ready."""
    procs = {name: launch_standin(log_dir, name) for name in names}
    try:
        for proc in procs.values():
            proc.wait_http("/ready")
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def metric_sum(metrics_url: str, name: str, **labels: str) -> float:
    """The sum of the series of ``name`` (exactly) whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if (
            line.startswith(name)
            and line[len(name) : len(name) + 1] in (" ", "{")
            and all(f'{k}="{v}"' in line for k, v in labels.items())
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def launch_runtime(model_path: Path, log_dir: Path, **overrides: str) -> RuntimeServer:
    """The real runtime (runtime_process's launcher); gateway tests name its models with
    SERVED_MODEL_NAME, so the launcher's default name override is left out."""
    return runtime_process.launch_runtime(
        model_path, log_dir, unset=("OPENAI_SERVED_MODEL_NAME_OVERRIDE",), **overrides
    )


@contextlib.contextmanager
def webhook_receiver(answer_after: float = 0.0) -> Iterator[tuple[str, list[dict]]]:
    """An HTTP server on 127.0.0.1 that records every JSON body POSTed to it (with the time it
    answered) and answers 200 after ``answer_after`` seconds."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            body = json.loads(self.rfile.read(length))
            time.sleep(answer_after)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()
            received.append({**body, "answered_at": time.monotonic()})

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------ clients that hang up


def chat_body(size: int, pad: int = 200_000) -> bytes:
    """A chat request of exactly ``size`` bytes for the stand-in, whose answer carries ``pad``
    bytes: more than a client that hangs up after the status line reads."""
    request = {"model": "one", "standin_pad": pad, "messages": [{"role": "user"}]}
    filler = size - len(json.dumps({**request, "messages": [{"role": "user", "content": ""}]}))
    request["messages"][0]["content"] = "x" * filler
    body = json.dumps(request).encode()
    assert len(body) == size
    return body


async def _send_and_hang_up(port: int, head: bytes, body: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    writer.write(body)
    await writer.drain()
    status = await reader.readline()
    writer.transport.abort()
    return status.split(b" ")[1] if status else b"closed"


def hang_up_round(port: int, key: str, body: bytes, clients: int) -> list[bytes]:
    """``clients`` at once each send the whole chat request, read only the answer's status
    line and close with the rest unread (the kernel resets the connection); their statuses."""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()

    async def together() -> list[bytes]:
        return await asyncio.gather(*(_send_and_hang_up(port, head, body) for _ in range(clients)))

    return asyncio.run(together())

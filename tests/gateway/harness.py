"""Real processes for gateway tests: the gateway (`python -m llmendpoints_gateway serve`), the
runtime on the demo model, and the stand-in backend (bench/gateway_standin.py) for failures that
a real engine cannot be made to have on cue (a crash before the first byte, a cut mid-stream)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
STANDIN = REPO / "bench" / "gateway_standin.py"


def load_kit(name: str):
    """A helper module of tests/runtime (``proc_kit``: the engine's processes), loaded by path:
    neither test folder is a package."""
    path = REPO / "tests" / "runtime" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**overrides: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("API_KEY", "GATEWAY_", "MAX_", "SM_VLLM_", "LLMEP_", "KUBE"))
        and k not in ("MODEL_NAME", "PORT", "HOST", "JOBS_QUEUE_URL", "DRAIN_TIMEOUT_SECONDS")
    }
    env.update(overrides)
    return env


@dataclass
class Process:
    process: subprocess.Popen
    port: int
    log_path: Path
    metrics_port: int | None = None  # the gateway's /metrics (GATEWAY_METRICS_PORT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port or self.port}/metrics"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_http(self, path: str, want: int = 200, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + path, timeout=2.0).status_code == want:
                    return
            time.sleep(0.1)
        raise TimeoutError(
            f"{path} did not answer {want} within {timeout} s:\n{self.log()[-3000:]}"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        # Each process runs in a session of its own: nothing it started (vLLM's engine core)
        # outlives it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode


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
    log_dir: Path, name: str, port: int | None = None, ready_after: float = 0.0
) -> Process:
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
    ]
    return _spawn(argv, clean_env(), port, log_dir / f"standin-{name}-{port}.log")


def runtime_env(model_path: Path, port: int, **overrides: str) -> dict[str, str]:
    env = clean_env(
        MODEL_NAME=str(model_path),
        MAX_MODEL_LEN="512",
        HOST="127.0.0.1",
        PORT=str(port),
        ENABLE_PREFIX_CACHING="true",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.update(overrides)
    return env


def launch_runtime(
    model_path: Path, log_dir: Path, port: int | None = None, **overrides: str
) -> Process:
    port = port or free_port()
    # Batch files of a pod without the queue: the test's folder, not the developer's cache.
    overrides.setdefault("LLMEP_BATCH_DIR", str(log_dir / f"batches-{port}"))
    env = runtime_env(model_path, port, **overrides)
    runtime_bin = Path(PYTHON).parent / "llmendpoints-runtime"
    return _spawn([str(runtime_bin), "serve"], env, port, log_dir / f"runtime-{port}.log")


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

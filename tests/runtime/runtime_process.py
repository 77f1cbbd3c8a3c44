"""Launching the real runtime (`llmendpoints-runtime serve`) on the demo model, as a subprocess
exactly as in a pod: real vLLM (CPU build), real uvicorn, real signals.

Shared by the runtime tests (conftest.py) and the benchmarks (bench/runsync_vs_completions.py),
so both run the server in the same clean environment: a developer's shell never leaks
MODEL_NAME, PORT, API keys, MAX_*, SM_VLLM_* or LLMEP_* settings into a run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from llmendpoints_runtime.proctree import descendants
from ports import free_port

REPO = Path(__file__).resolve().parents[2]
RUNTIME_BIN = Path(sys.executable).parent / "llmendpoints-runtime"
PY_SPY = Path(sys.executable).parent / "py-spy"
START_TIMEOUT = 480.0  # engine start on two shared cores under load


def check_model_server(url: str) -> dict[str, str]:
    """`llmendpoints-runtime check-model-server URL`: its table as check -> row; asserts exit 0."""
    result = subprocess.run(
        [str(RUNTIME_BIN), "check-model-server", url], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines()[3:] if line.strip()]
    return {row.split()[0]: row for row in rows}


@dataclass
class ServedProcess:
    """A server this test started, in a session of its own, listening on loopback ``port``."""

    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def wait_http(self, path: str, want: int = 200, timeout: float = 60.0) -> None:
        """Until ``path`` answers ``want``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + path, timeout=2.0).status_code == want:
                    return
            time.sleep(0.1)
        raise TimeoutError(
            f"{path} did not answer {want} within {timeout} s:\n{self.log()[-3000:]}"
        )

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"exited with {self.process.returncode}:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        # The server runs in a session of its own: whatever it started and left behind (a test
        # that SIGKILLs the runtime leaves vLLM's engine core) goes with it, so no engine
        # outlives its test and eats the next one's cores and memory.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode


@dataclass
class RuntimeServer(ServedProcess):
    env: dict[str, str] = field(default_factory=dict)
    statuses_before_ready: list[int] = field(default_factory=list)

    def wait_listening(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(httpx.TransportError):
                httpx.get(self.url + "/health", timeout=1.0)
                return
            time.sleep(0.1)
        raise TimeoutError(f"runtime did not listen within {timeout} s:\n{self.log()[-3000:]}")

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                status = httpx.get(self.url + "/ready", timeout=2.0).status_code
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if status == 200:
                return
            self.statuses_before_ready.append(status)
            if status == 503:
                raise RuntimeError(f"engine failed to start:\n{self.log()[-4000:]}")
            time.sleep(0.5)
        raise TimeoutError(
            f"runtime not ready within {timeout} s:\n{self.log()[-3000:]}\n{self.stacks()}"
        )

    def stacks(self) -> str:
        """Every Python stack of the server's processes (py-spy), for a start that hangs: the
        log says which process waits, the stacks say on what. Also kept beside the log."""
        dumps = []
        for pid in [self.process.pid, *(p.pid for p in descendants(self.process.pid))]:
            try:
                spy = subprocess.run(
                    [str(PY_SPY), "dump", "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                dumps.append(f"--- pid {pid}\n{spy.stdout}{spy.stderr}")
            except (OSError, subprocess.TimeoutExpired) as exc:
                dumps.append(f"--- pid {pid}: no stack ({exc})")
        text = "\n".join(dumps)
        self.log_path.with_suffix(".stacks").write_text(text)
        return text


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without the settings of ours a developer's shell may hold:
    none leaks into a server under test (runtime or gateway)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("API_KEY", "GATEWAY_", "MAX_", "SM_VLLM_", "LLMEP_", "KUBE"))
        and k
        not in (
            "MODEL_NAME",
            "PORT",
            "HOST",
            "JOBS_QUEUE_URL",
            "ENDPOINT_ID",
            "DRAIN_TIMEOUT_SECONDS",
        )
    }
    env.update(overrides)
    return env


def runtime_env(
    model_path: Path, port: int, *, unset: tuple[str, ...] = (), **overrides: str
) -> dict[str, str]:
    """The server's environment; ``unset`` names variables of this process it must not get."""
    env = clean_env()
    env.update(
        MODEL_NAME=str(model_path),
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="demo",
        MAX_MODEL_LEN="512",
        HOST="127.0.0.1",
        PORT=str(port),
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        STARTUP_LOG_INTERVAL_SECONDS="5",
    )
    env.update(overrides)
    for name in unset:
        env.pop(name, None)
    return env


def launch_runtime(
    model_path: Path, log_dir: Path, *, unset: tuple[str, ...] = (), **overrides: str
) -> RuntimeServer:
    port = free_port()
    # Batch files of a pod without the queue: the test's folder, not the developer's cache.
    overrides.setdefault("LLMEP_BATCH_DIR", str(log_dir / f"batches-{port}"))
    env = runtime_env(model_path, port, unset=unset, **overrides)
    log_path = log_dir / f"runtime-{port}.log"
    handle = log_path.open("wb")
    process = subprocess.Popen(
        [str(RUNTIME_BIN), "serve"],
        env=env,
        stdout=handle,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    return RuntimeServer(process=process, port=port, log_path=log_path, env=env)


@contextlib.contextmanager
def running_runtime(
    model_path: Path, log_dir: Path, *, unset: tuple[str, ...] = (), **overrides: str
) -> Iterator[RuntimeServer]:
    server = launch_runtime(model_path, log_dir, unset=unset, **overrides)
    try:
        server.wait_listening()
        server.wait_ready()
        yield server
    finally:
        server.stop()

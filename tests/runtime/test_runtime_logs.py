"""What a real runtime process writes to its real stdout, and how it ends when it cannot start.

The server runs as in `make serve > file`: stdout is a file, and PYTHONUNBUFFERED is not set
(the images set it; a developer's shell or another launcher may not). Every line must reach the
file when it is logged -- not when a block fills or the process ends -- and none may be lost at
the final os._exit.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from runtime_process import RuntimeServer, launch_runtime, running_runtime

pytestmark = pytest.mark.engine

WEBHOOK_ATTEMPTS = 3  # RunPod's: one attempt and two retries, 10 s apart


class _FailingReceiver(BaseHTTPRequestHandler):
    attempts: list[str] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).attempts.append(self.path)
        self.send_response(500)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FailingReceiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def server(demo_model, runtime_logs) -> Iterator[RuntimeServer]:
    with running_runtime(
        demo_model,
        runtime_logs,
        unset=("PYTHONUNBUFFERED",),
        # The retries are due 10 and 20 s after the first attempt: the drain waits for them.
        DRAIN_TIMEOUT_SECONDS="90",
    ) as running:
        yield running


def wait_for_log(server: RuntimeServer, text: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = server.log()
        if text in log:
            return log
        assert server.process.poll() is None, f"the server exited:\n{log[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in the log within {timeout} s:\n{server.log()[-3000:]}")


def test_failed_webhook_attempts_are_in_the_log_as_they_happen_and_nothing_is_lost_at_exit(
    server, receiver
):
    job = httpx.post(
        server.url + "/run",
        json={"input": {"prompt": "x", "sampling_params": {"max_tokens": 3}}, "webhook": receiver},
        timeout=60,
    ).json()
    host = receiver.rsplit("/", 1)[0]  # the log names scheme://host:port, never the path
    first = f"webhook for job {job['id']} to {host}: attempt 1/{WEBHOOK_ATTEMPTS} failed: HTTP 500"
    # In the file while the process runs: the line was not held in a buffer.
    wait_for_log(server, first)
    # SIGTERM: the drain waits for the two retries, then the process exits through os._exit.
    assert server.stop(timeout=120) == 0
    log = server.log()
    for attempt in range(1, WEBHOOK_ATTEMPTS + 1):
        assert f"attempt {attempt}/{WEBHOOK_ATTEMPTS} failed: HTTP 500" in log, log[-3000:]
    assert len(_FailingReceiver.attempts) == WEBHOOK_ATTEMPTS
    # The very last line uvicorn writes before the process ends is there.
    assert "Finished server process" in log.rstrip().splitlines()[-1], log[-2000:]
    assert "[/hook]" not in log and "/hook" not in log.split("POST /run", 1)[1]


# -- a runtime that cannot start exits ----------------------------------------------------------

GRACE_SECONDS = 15  # long enough for this test to see the 503s on a busy machine


def truncated_copy(model: Path, where: Path) -> Path:
    copy = where / "truncated-model"
    shutil.copytree(model, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return copy


@pytest.mark.parametrize("model", ["truncated weights", "missing directory"])
def test_a_runtime_whose_engine_cannot_start_answers_503_with_the_cause_then_exits_1(
    demo_model, runtime_logs, tmp_path, model
):
    path = (
        truncated_copy(demo_model, tmp_path)
        if model == "truncated weights"
        else tmp_path / "no-such-model"
    )
    server = launch_runtime(
        path,
        runtime_logs,
        unset=("PYTHONUNBUFFERED",),
        ENGINE_DEATH_EXIT_DELAY_SECONDS=str(GRACE_SECONDS),
    )
    try:
        server.wait_listening()
        answers: list[tuple[int, dict]] = []
        deadline = time.monotonic() + 300
        while server.process.poll() is None:
            assert time.monotonic() < deadline, f"still running:\n{server.log()[-3000:]}"
            try:
                response = httpx.get(server.url + "/ready", timeout=5)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            answers.append((response.status_code, response.json() if response.content else {}))
            time.sleep(0.2)
        code = server.process.wait()
    finally:
        server.stop()
    log = server.log()
    assert code == 1, log[-3000:]
    failed = [body for status, body in answers if status == 503]
    assert failed, f"never saw readiness 503; answers: {answers[-5:]}"
    assert failed[-1]["status"] == "failed" and failed[-1]["reason"], failed[-1]
    assert "engine failed to start" in log
    # The cause, as the engine's own process found it, is in the log.
    cause = "SafetensorError" if model == "truncated weights" else "there is no model directory"
    assert cause in log, log[-3000:]
    assert f"exiting in {GRACE_SECONDS} s" in log
    # The cause, then the exit, are the last lines of our own log.
    ours = [line for line in log.splitlines() if " llmendpoints." in line]
    assert "exiting with status 1" in ours[-1], ours[-3:]
    assert failed[-1]["reason"] in ours[-1]

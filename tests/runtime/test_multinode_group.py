"""A two-node replica, as a LeaderWorkerSet group runs it: a leader and a worker, each started
exactly as the operator writes their container (``llmendpoints-runtime serve`` with the
contract's environment), LeaderWorkerSet's injected variables pointing at loopback, the demo
model split in two pipeline stages across the two processes (vLLM's own multi-node launch, mp
executor, gloo over loopback).

It serves; then the worker's whole process group is SIGKILLed (a node lost) while a completion
is in flight: the leader says so (/health and /ready 503) within 60 s, the completion ends with
an error instead of hanging, and the leader exits non-zero so that LeaderWorkerSet recreates
the group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from ports import free_port
from proc_kit import engine_core_pids, wait_until
from runtime_process import REPO, RUNTIME_BIN, START_TIMEOUT, runtime_env

pytestmark = pytest.mark.engine

NODES = 2


def group_env(model: Path, rank: int, ports: dict[str, int]) -> dict[str, str]:
    """Everything a group pod's container gets, in one place: the runtime's env as the operator
    writes it for nodes: 2 (contract: docs/multinode-runtime.md), LeaderWorkerSet's injected variables,
    and what differs on one machine (each pod's control port; vLLM's advertised address)."""
    return runtime_env(
        model,
        ports["http"],
        # The operator's, on leader and worker alike.
        PIPELINE_PARALLEL_SIZE="2",
        LLMEP_NODES=str(NODES),
        LLMEP_MULTINODE_PORT=str(ports["multinode"]),
        # LeaderWorkerSet's.
        LWS_LEADER_ADDRESS="127.0.0.1",
        LWS_GROUP_SIZE=str(NODES),
        LWS_WORKER_INDEX=str(rank),
        # Two pods on one machine: their control ports differ; vLLM's message queue would
        # advertise the machine's address, not loopback.
        LLMEP_CONTROL_PORT=str(ports[f"control{rank}"]),
        VLLM_HOST_IP="127.0.0.1",
        ENGINE_DEATH_EXIT_DELAY_SECONDS="5",
    )


def _start(env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(RUNTIME_BIN), "serve"],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )


def _status(port: int, path: str) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10).status_code
    except httpx.TransportError:
        return None


@pytest.fixture(scope="module")
def group(demo_model, runtime_logs):
    ports = {name: free_port() for name in ("http", "multinode", "control0", "control1")}
    logs = [runtime_logs / f"group-{rank}.log" for rank in range(NODES)]
    procs = [_start(group_env(demo_model, rank, ports), logs[rank]) for rank in range(NODES)]

    def started() -> bool:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        return _status(ports["control0"], "/ready?strict=1") == 200

    try:
        wait_until(started, START_TIMEOUT, "the group ready")
        yield procs, ports, logs
    finally:
        for proc in procs:
            with_suppressed_kill(proc)


def with_suppressed_kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_the_group_serves_through_its_leader_and_its_worker_answers_probes(group):
    procs, ports, _ = group
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="-")
    completion = client.completions.create(model="demo", prompt="Hello", max_tokens=8)
    assert completion.usage.completion_tokens == 8
    # The worker has no HTTP server, only its control port; its readiness follows the group's.
    worker_control = ports["control1"]
    assert _status(worker_control, "/ready?strict=1") == 200
    assert _status(worker_control, "/health") == 200
    assert _status(worker_control, "/v1/models") == 404
    assert (
        "llmendpoints_engine_ready 1.0"
        in httpx.get(f"http://127.0.0.1:{worker_control}/metrics", timeout=10).text
    )
    assert all(proc.poll() is None for proc in procs)


def test_a_lost_worker_turns_the_leader_unhealthy_fails_requests_in_flight_and_ends_it(group):
    (leader, worker), ports, logs = group
    url = f"http://127.0.0.1:{ports['http']}"
    ended: dict[str, object] = {}
    first_chunk = threading.Event()

    def in_flight() -> None:
        body = {"model": "demo", "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                              timeout=httpx.Timeout(300.0)) as response:  # fmt: skip
                ended["status"] = response.status_code
                chunks = []
                for line in response.iter_lines():
                    chunks.append(line)
                    first_chunk.set()
                ended["body"] = "\n".join(chunks)
        except httpx.HTTPError as exc:  # the connection ended: an error, not a hang
            ended["error"] = repr(exc)
        finally:
            first_chunk.set()

    streaming = threading.Thread(target=in_flight, daemon=True)
    streaming.start()
    assert first_chunk.wait(120), "the stream never started"
    # Held in flight: the leader's engine core stops where it is.
    [core] = engine_core_pids(leader.pid)
    os.kill(core, signal.SIGSTOP)
    os.killpg(worker.pid, signal.SIGKILL)  # the worker pod's every process: a node lost

    wait_until(lambda: _status(ports["control0"], "/health") == 503, 60, "leader /health 503")
    assert _status(ports["control0"], "/ready") == 503
    health = httpx.get(f"http://127.0.0.1:{ports['control0']}/health", timeout=10).json()
    assert "the group lost a node: worker 1" in health["reason"], health

    streaming.join(120)
    assert not streaming.is_alive(), "the request in flight hangs"
    finished_normally = '"finish_reason":"length"' in str(ended.get("body", "")).replace(" ", "")
    assert not finished_normally, ended
    assert "error" in ended or "error" in str(ended.get("body", "")).lower(), ended

    assert leader.wait(120) != 0
    log = logs[0].read_text(errors="replace")
    assert "exiting with status 1: the group lost a node" in log
    time.sleep(0.5)
    assert _status(ports["http"], "/health") is None  # nothing of the group listens

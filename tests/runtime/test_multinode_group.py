"""A two-node replica, as a LeaderWorkerSet group runs it: a leader and a worker, each started
exactly as the operator writes their container (command and env from the operator's own pure
builder for an LLMEndpoint with nodes: 2 and pipelineParallelSize: 2, through
tests/kubelet_kit.py, so the two sides cannot drift), LeaderWorkerSet's injected variables
pointing at loopback and only the addresses and ports one machine needs changed, the demo
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
import kubelet_kit
import openai
import pytest
from kubelet_kit import Container
from llmendpoints_operator.manifests import MULTINODE_PORT
from ports import free_port
from proc_kit import engine_core_pids, wait_until
from runtime_process import REPO, RUNTIME_BIN, START_TIMEOUT, clean_env

pytestmark = pytest.mark.engine

NODES = 2
ADMIN_KEY = "group-admin-key"


def endpoint_spec(model: Path) -> dict[str, object]:
    """The LLMEndpoint: two nodes of one GPU each, a pipeline stage per node; what a CPU
    machine needs goes in spec.engine.env, as a user would put it."""
    engine_env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "STARTUP_LOG_INTERVAL_SECONDS": "5",
        "ENGINE_DEATH_EXIT_DELAY_SECONDS": "5",
    }
    return {
        "model": {"name": str(model)},
        "resources": {"gpus": 1, "nodes": NODES},
        "engine": {
            "pipelineParallelSize": 2,
            "maxModelLen": 512,
            "env": [{"name": k, "value": v} for k, v in engine_env.items()],
        },
    }


def group_container(model: Path, root: Path, rank: int, ports: dict[str, int]) -> Container:
    """A group pod's runtime container exactly as the operator writes it (its pure builder,
    through tests/kubelet_kit.py), with what LeaderWorkerSet injects, and only what must differ
    when both pods share one machine's loopback: the listening address and ports (each pod's
    control port its own; the master port free here), the leader's address and the address
    vLLM advertises."""
    role = "leader" if rank == 0 else "worker"
    written = kubelet_kit.container(
        endpoint_spec(model),
        root / role,
        secrets={("demo-admin-key", "admin-api-key"): ADMIN_KEY},
        pod_fields={"status.podIP": "127.0.0.1"},  # LLMEP_CONTROL_HOST
        role=role,
        every_volume=True,
    )
    assert written.command == ["llmendpoints-runtime", "serve"]
    assert written.env["LLMEP_NODES"] == str(NODES)
    assert written.env["PIPELINE_PARALLEL_SIZE"] == "2"
    assert written.env["LLMEP_MULTINODE_PORT"] == str(MULTINODE_PORT)
    # Only the leader serves HTTP and is the group's master.
    assert ("http" in written.ports, written.ports.get("multinode")) == (
        (True, MULTINODE_PORT) if rank == 0 else (False, None)
    )
    env = {
        **clean_env(),  # the image's environment: this checkout's Python
        **written.env,
        # LeaderWorkerSet's.
        "LWS_LEADER_ADDRESS": "127.0.0.1",
        "LWS_GROUP_SIZE": str(NODES),
        "LWS_WORKER_INDEX": str(rank),
        # One machine for two pods.
        "HOST": "127.0.0.1",
        "PORT": str(ports["http"]),
        "LLMEP_CONTROL_PORT": str(ports[f"control{rank}"]),
        "LLMEP_MULTINODE_PORT": str(ports["multinode"]),
        "VLLM_HOST_IP": "127.0.0.1",
    }
    return Container([str(RUNTIME_BIN), *written.command[1:]], env, written.ports)


def _start(container: Container, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        container.command,
        env=container.env,
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
def group(demo_model, runtime_logs, tmp_path_factory):
    ports = {name: free_port() for name in ("http", "multinode", "control0", "control1")}
    root = tmp_path_factory.mktemp("group")
    logs = [runtime_logs / f"group-{rank}.log" for rank in range(NODES)]
    procs = [
        _start(group_container(demo_model, root, rank, ports), logs[rank]) for rank in range(NODES)
    ]

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
    # The worker has no HTTP server, only its control port; its readiness follows the group's,
    # which its leader tells it in the next beat (group.beat_interval: 2 s here, more when this
    # machine is starved).
    worker_control = ports["control1"]
    wait_until(lambda: _status(worker_control, "/ready?strict=1") == 200, 60, "the worker ready")
    assert _status(worker_control, "/health") == 200
    assert _status(worker_control, "/v1/models") == 404
    # The control port renders /metrics every 0.5 s (control_listener.METRICS_EVERY), its probe
    # answers every 0.1 s: the gauge may follow /ready by one rendering.
    wait_until(
        lambda: (
            "llmendpoints_engine_ready 1.0"
            in httpx.get(f"http://127.0.0.1:{worker_control}/metrics", timeout=10).text
        ),
        10,
        "the worker's ready gauge",
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

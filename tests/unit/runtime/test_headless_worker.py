"""A group's worker pod (headless.py) against a real leader's channel, with a stand-in for
vLLM's headless engine (a sleeping child process): its readiness follows the leader's, it
exits 1 (its engine stopped) when the leader is gone, and on SIGTERM it keeps its engine up
until the leader has drained. The worker runs in a process of its own, as in its pod."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time

import httpx
import pytest
from llmendpoints_runtime.group import LeaderChannel
from ports import free_port

SPAWN = multiprocessing.get_context("spawn")
POD_IP = "127.0.0.2"  # stands for the pod's IP, where the operator has the control port listen


def _sleeping_engine(_args: object) -> multiprocessing.process.BaseProcess:
    engine = SPAWN.Process(target=time.sleep, args=(600,), name="stand-in-engine")
    engine.start()
    return engine


def _run_worker(env: dict[str, str], engines: multiprocessing.queues.Queue) -> None:
    from llmendpoints_runtime.config import load_config
    from llmendpoints_runtime.headless import HeadlessWorker

    def start(args: object) -> multiprocessing.process.BaseProcess:
        engine = _sleeping_engine(args)
        engines.put(engine.pid)
        return engine

    os._exit(HeadlessWorker(load_config(env), start_engine=start).run())


def _worker(leader_port: int, control_port: int):
    env = {
        "MODEL_NAME": "org/model",
        "PIPELINE_PARALLEL_SIZE": "2",
        "LLMEP_NODES": "2",
        "LWS_GROUP_SIZE": "2",
        "LWS_WORKER_INDEX": "1",
        "LWS_LEADER_ADDRESS": "127.0.0.1",
        "LLMEP_MULTINODE_PORT": str(leader_port - 2),
        "LLMEP_CONTROL_PORT": str(control_port),
        "LLMEP_CONTROL_HOST": POD_IP,
        "HOST": "127.0.0.1",
        "DRAIN_TIMEOUT_SECONDS": "30",
    }
    engines = SPAWN.Queue()
    process = SPAWN.Process(target=_run_worker, args=(env, engines))
    process.start()
    return process, engines.get(timeout=120)


def _status(port: int, path: str) -> int | None:
    try:
        return httpx.get(f"http://{POD_IP}:{port}{path}", timeout=5).status_code
    except httpx.TransportError:
        return None


def _until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def leader():
    state = {"value": "initializing"}
    port = free_port()
    channel = LeaderChannel(
        "127.0.0.1", port, 2, timeout=5.0, on_lost=lambda _r: None, state=lambda: state["value"]
    )
    channel.start()
    yield channel, state
    channel.stop()


def test_a_worker_follows_its_leader_and_exits_1_when_the_leader_is_gone(leader):
    channel, state = leader
    control = free_port()
    worker, engine = _worker(channel.port, control)
    _until(lambda: channel.members.complete, "the worker joins")
    assert _status(control, "/health") == 200
    assert _status(control, "/ready?strict=1") == 503  # the group's engine is loading
    state["value"] = "ready"
    _until(lambda: _status(control, "/ready?strict=1") == 200, "ready with its leader")
    # The gauge is set when /metrics is rendered, which may trail /ready by a moment.
    _until(
        lambda: (
            "llmendpoints_engine_ready 1.0" in httpx.get(f"http://{POD_IP}:{control}/metrics").text
        ),
        "the ready gauge",
    )
    with pytest.raises(ConnectionRefusedError):  # on the pod's IP only (LLMEP_CONTROL_HOST)
        socket.create_connection(("127.0.0.1", control), timeout=10).close()

    channel.stop("the leader failed")
    worker.join(60)
    assert worker.exitcode == 1
    assert not _alive(engine), "the worker's engine outlived it"


def test_on_sigterm_a_worker_keeps_its_engine_until_the_leader_is_done(leader):
    channel, state = leader
    state["value"] = "ready"
    control = free_port()
    worker, engine = _worker(channel.port, control)
    _until(lambda: _status(control, "/ready?strict=1") == 200, "ready with its leader")
    os.kill(worker.pid, signal.SIGTERM)
    _until(lambda: _status(control, "/ready?strict=1") == 503, "draining")
    time.sleep(1.0)  # the leader still drains: the worker's engine must still serve it
    assert worker.exitcode is None and _alive(engine)
    channel.stop()
    worker.join(60)
    assert worker.exitcode == 0
    assert not _alive(engine)

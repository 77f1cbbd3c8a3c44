"""What the gateway asks of the pods it routes to (issue 33): idle, nothing on their main port;
busy, engine load from their control port; one reader per gateway pod, whatever its workers.

Real gateway processes and stand-in backends (bench/gateway_standin.py) that count every request
by port, path and user agent; one stand-in has a control port (named in its main port's probe
answers, as the runtime names LLMEP_CONTROL_PORT), one has none. The gateway probes idle
backends every second (GATEWAY_IDLE_PROBE_INTERVAL_SECONDS=1 from the harness: its endpoints
stay active 2 s after their last request)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ports import free_port

from gateway.harness import Process, launch_standin, running_gateway, write_endpoints

IDLE_PROBE_SECONDS = 1.0  # the harness's GATEWAY_IDLE_PROBE_INTERVAL_SECONDS
GRACE_SECONDS = 2 * IDLE_PROBE_SECONDS  # an endpoint stays active this long after its traffic
READER = re.compile(r"llmendpoints-gateway-reader \(pid (\d+)\)")


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Iterator[dict[str, Process]]:
    log_dir = tmp_path_factory.mktemp("idle-standins")
    procs = {
        "ctl": launch_standin(log_dir, "ctl", control_port=True),
        "plain": launch_standin(log_dir, "plain"),
        "pod": launch_standin(log_dir, "pod", control_port=True),
        # names a control port nothing listens on (bound where the gateway cannot reach it)
        "lost": launch_standin(log_dir, "lost", named_control_port=free_port()),
    }
    try:
        for proc in procs.values():
            proc.wait_http("/stats")
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def stats(standin: Process) -> dict:
    return httpx.get(standin.url + "/stats", timeout=10).json()


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def chats(gateway: Process, model: str, n: int, *, fresh: bool = False) -> None:
    """``n`` streamed chats through the gateway, each on a new connection when ``fresh`` (the
    kernel spreads new connections over a pod's workers)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": True,
        "standin_chunks": 4,
    }
    client = httpx.Client(base_url=gateway.url, timeout=30)
    try:
        for _ in range(n):
            if fresh:
                client.close()
                client = httpx.Client(base_url=gateway.url, timeout=30)
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.text.rstrip().endswith("data: [DONE]")
    finally:
        client.close()


def wait_routable(gateway: Process, model: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        models = httpx.get(gateway.url + "/v1/models", timeout=5).json()["data"]
        if any(m["id"] == model and m["ready_replicas"] > 0 for m in models):
            return
        assert time.monotonic() < deadline, f"{model} never had a ready replica: {models}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def gateway(standins, tmp_path_factory) -> Iterator[Process]:
    log_dir = tmp_path_factory.mktemp("idle-gateway")
    config = write_endpoints(
        log_dir / "endpoints.yaml",
        [
            {"name": "with-control", "models": ["ctl"], "backends": [standins["ctl"].url]},
            {"name": "without", "models": ["plain"], "backends": [standins["plain"].url]},
            {"name": "unreachable", "models": ["lost"], "backends": [standins["lost"].url]},
        ],
    )
    with running_gateway(
        log_dir,
        GATEWAY_ENDPOINTS_FILE=str(config),
        GATEWAY_REQUIRE_KEYS="false",
        GATEWAY_ENGINE_LOAD_INTERVAL_SECONDS="0.2",
    ) as gw:
        wait_routable(gw, "ctl")
        wait_routable(gw, "plain")
        wait_routable(gw, "lost")
        yield gw


def idle_window(standin: Process, seconds: float) -> tuple[dict[str, int], dict[str, int], float]:
    """(main port, control port) requests received over about ``seconds`` of quiet, once the
    endpoint's activity grace has passed, and the window's length (the two reads of the
    stand-in's counts included: slow on a busy machine)."""
    time.sleep(GRACE_SECONDS + 0.5)
    started = time.monotonic()
    before = stats(standin)["seen"]
    time.sleep(seconds)
    after = stats(standin)["seen"]
    window = time.monotonic() - started
    main, control = delta(after["main"], before["main"]), delta(after["control"], before["control"])
    return main, control, window


def test_an_idle_endpoint_gets_nothing_on_its_pods_main_port(gateway, standins) -> None:
    ctl = standins["ctl"]
    chats(gateway, "ctl", 6)
    seen = stats(ctl)["seen"]
    # Busy: engine load read on the control port; the main port got the requests and one probe
    # (the first, which learned where the control port is), nothing else from the gateway.
    assert seen["control"].get("GET /metrics", 0) >= 1, seen
    assert seen["main"] == {"GET /ready": 1, "POST /v1/chat/completions": 6}, seen

    main, control, window = idle_window(ctl, 4.0)
    assert main == {}, f"the idle pod's main port was asked {main}"
    # Readiness only (no engine load), at the idle period: at most one probe a second here.
    assert set(control) == {"GET /ready"}, control
    assert 1 <= control["GET /ready"] <= window / IDLE_PROBE_SECONDS + 1, control


def test_a_pod_without_a_control_port_gets_only_readiness_probes_when_idle(
    gateway, standins
) -> None:
    plain = standins["plain"]
    chats(gateway, "plain", 6)
    seen = stats(plain)["seen"]
    assert seen["main"].get("GET /metrics", 0) >= 1, seen  # read where it can be: its main port
    main, control, window = idle_window(plain, 4.0)
    assert control == {}
    assert set(main) == {"GET /ready"}, main
    assert main["GET /ready"] <= window / IDLE_PROBE_SECONDS + 1, main


def test_a_control_port_that_cannot_be_reached_leaves_the_main_port_in_use(
    gateway, standins
) -> None:
    """A pod that names a control port the gateway cannot reach (bound to another address) is
    still probed, read and routed to -- on its main port."""
    lost = standins["lost"]
    chats(gateway, "lost", 4)
    seen = stats(lost)["seen"]
    assert seen["control"] == {}
    assert seen["main"].get("POST /v1/chat/completions") == 4, seen
    assert seen["main"].get("GET /metrics", 0) >= 1, seen  # engine load read on the main port
    assert "does not answer; its main port" in gateway.log()


def readers(agents: list[str]) -> set[int]:
    return {int(m.group(1)) for a in agents if (m := READER.fullmatch(a))}


def test_one_reader_per_gateway_pod_whatever_its_workers(standins, tmp_path: Path) -> None:
    """Two worker processes: one reads the pod (readiness, engine load), the other follows
    what it read; when the reader dies another worker takes over, and routing goes on."""
    pod = standins["pod"]
    config = write_endpoints(
        tmp_path / "endpoints.yaml", [{"name": "two", "models": ["pod"], "backends": [pod.url]}]
    )
    with running_gateway(
        tmp_path,
        GATEWAY_ENDPOINTS_FILE=str(config),
        GATEWAY_REQUIRE_KEYS="false",
        GATEWAY_ENGINE_LOAD_INTERVAL_SECONDS="0.2",
        GATEWAY_WORKERS="2",
    ) as gw:
        wait_routable(gw, "pod")
        chats(gw, "pod", 30, fresh=True)  # through both workers
        agents = stats(pod)["user_agents"]
        first = readers(agents["control"])
        assert len(first) == 1, agents  # one process reads the pod
        assert readers(agents["main"]) <= first  # and learned its control port
        (reader,) = first
        workers = {c.pid for c in _children(gw.process.pid)}
        assert reader in workers

        os.kill(reader, signal.SIGKILL)  # the supervisor restarts it; another worker leads
        deadline = time.monotonic() + 30
        while not readers(stats(pod)["user_agents"]["control"]) - first:
            chats(gw, "pod", 2, fresh=True)  # routing goes on meanwhile
            assert time.monotonic() < deadline, "no worker took over reading the pod"
            time.sleep(0.2)
        (successor,) = readers(stats(pod)["user_agents"]["control"]) - first
        assert successor != reader
        chats(gw, "pod", 6, fresh=True)


def _children(pid: int):
    import psutil

    return psutil.Process(pid).children()

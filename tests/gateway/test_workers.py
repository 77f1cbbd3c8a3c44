"""GATEWAY_WORKERS: the pod's /metrics as the sum of its workers', the pod-wide drain, the
bounds split among workers, the worker count; and a real supervisor with two workers in front
of stand-ins: every request counted once on /metrics, a killed worker restarted while the other
serves. (The behaviour tests in test_gateway_behaviour.py run with 2 workers too.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.metrics_merge import merge
from llmendpoints_gateway.workers import DrainBoard, PodDrain, WorkerSlot, pod_cpus, worker_count
from prometheus_client.parser import text_string_to_metric_families

from .harness import metric_sum, running_gateway, running_standins, write_endpoints

CHAT = "/v1/chat/completions"


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_pods_metrics_are_the_sum_of_its_workers() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    for metrics in (a, b):
        metrics.answered("ns/e", 200)
        metrics.ready_replicas.labels("ns/e").set(3)  # each worker's discovery sees all three
        metrics.ttft.labels("ns/e").observe(0.02)
    a.set_in_flight("ns/e", "pod-1", 2)
    b.set_in_flight("ns/e", "pod-1", 1)
    b.set_in_flight("ns/e", "pod-2", 4)  # a replica only worker b has sent requests to
    b.held.labels("ns/f").set(5)
    merged = merge([a.render().decode(), b.render().decode()])
    samples = _samples(merged)
    assert (
        samples[("llmendpoints_gateway_requests_total", (("code", "200"), ("endpoint", "ns/e")))]
        == 2
    )
    assert samples[("llmendpoints_gateway_ready_replicas", (("endpoint", "ns/e"),))] == 3
    in_flight = "llmendpoints_gateway_in_flight_requests"
    assert samples[(in_flight, (("endpoint", "ns/e"), ("replica", "pod-1")))] == 3
    assert samples[(in_flight, (("endpoint", "ns/e"), ("replica", "pod-2")))] == 4
    assert samples[("llmendpoints_gateway_held_requests", (("endpoint", "ns/f"),))] == 5
    bucket = (
        "llmendpoints_gateway_upstream_ttft_seconds_bucket",
        (("endpoint", "ns/e"), ("le", "0.025")),
    )
    assert samples[bucket] == 2
    # Each family once, its samples together (the text format requires it).
    assert merged.count("# TYPE llmendpoints_gateway_in_flight_requests gauge") == 1
    # A replica that left one worker's registry leaves the sum with it.
    b.forget_replica("ns/e", "pod-2")
    assert "pod-2" not in merge([a.render().decode(), b.render().decode()])
    assert merge([]) == ""


def test_a_worker_keeps_serving_until_the_whole_pod_is_idle() -> None:
    class Component:
        def __init__(self) -> None:
            self.in_flight = 0
            self.draining = False

        def start_draining(self) -> None:
            self.draining = True

        def busy(self) -> int:
            return self.in_flight

        def set_drain_deadline(self, deadline: float) -> None:
            pass

    board = DrainBoard.create(2)
    try:
        idle, streaming = Component(), Component()
        first, second = PodDrain(idle, board, 0), PodDrain(streaming, board, 1)
        first.start_draining()
        assert idle.draining
        assert first.busy() == 1  # the other worker has not reported yet: it counts as busy
        streaming.in_flight = 3
        assert second.busy() == 3 and first.busy() == 3  # idle itself, but the pod is not
        streaming.in_flight = 0
        assert second.busy() == 0 and first.busy() == 0
        # Another process maps the same page (the workers get its descriptor).
        assert DrainBoard(board.fd, 2).total() == 0
    finally:
        os.close(board.fd)


def test_pod_wide_bounds_are_split_among_workers() -> None:
    slot = WorkerSlot(0, 4, -1, -1, os.getpid())
    assert slot.share(1000) == 250 and slot.share(10) == 3 and slot.share(1) == 1
    assert slot.share(0) == 0  # 0 stays "nothing held"


def test_the_worker_count(monkeypatch: pytest.MonkeyPatch) -> None:
    def settings(**env: str) -> GatewaySettings:
        for name in ("GATEWAY_WORKERS", "JOBS_QUEUE_URL"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return GatewaySettings()

    assert worker_count(settings()) == 1  # the default: one process, as before
    assert worker_count(settings(GATEWAY_WORKERS="3")) == 3
    # Automatic: one per CPU, but only with a queue to share per-key limits through.
    assert worker_count(settings(GATEWAY_WORKERS="0")) == 1
    queued = settings(GATEWAY_WORKERS="0", JOBS_QUEUE_URL="nats://127.0.0.1:4222")
    assert worker_count(queued) == pod_cpus() >= 1
    assert pod_cpus() <= len(os.sched_getaffinity(0))


# ------------------------------------------------------------------ a real supervisor


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="module")
def standin(logs):
    with running_standins(logs, "w1") as procs:
        yield procs["w1"]


def _wait(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_two_workers_count_every_request_once_and_a_dead_worker_comes_back(logs, standin):
    endpoints = write_endpoints(
        logs / "endpoints.yaml",
        [{"name": "w", "models": ["w-model"], "backends": [standin.url]}],
    )
    with running_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=str(endpoints),
        GATEWAY_REQUIRE_KEYS="false",
        GATEWAY_WORKERS="2",
    ) as gw:
        workers = psutil.Process(gw.process.pid).children()
        assert len(workers) == 2
        _wait(lambda: metric_sum(gw.metrics_url, "llmendpoints_gateway_workers") == 2, "2 workers")
        body = {"model": "w-model", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(20):  # a connection each: the kernel spreads them over the workers
            with httpx.Client(base_url=gw.url, timeout=30) as client:
                assert client.post(CHAT, json=body).status_code == 200
        requests = "llmendpoints_gateway_requests_total"
        assert metric_sum(gw.metrics_url, requests, endpoint="default/w", code="200") == 20
        assert metric_sum(gw.metrics_url, "llmendpoints_gateway_ready_replicas") == 1
        # A worker dies: the other serves on; the supervisor starts a new one.
        workers[0].send_signal(signal.SIGKILL)
        for _ in range(10):
            with httpx.Client(base_url=gw.url, timeout=30) as client:
                assert client.post(CHAT, json=body).status_code == 200
        _wait(
            lambda: metric_sum(gw.metrics_url, "llmendpoints_gateway_worker_restarts_total") == 1,
            "the restart",
        )
        _wait(lambda: metric_sum(gw.metrics_url, "llmendpoints_gateway_workers") == 2, "2 workers")
        assert len(psutil.Process(gw.process.pid).children()) == 2
        gw.process.send_signal(signal.SIGTERM)
        assert gw.process.wait(60) == 0
    for worker in workers[1:]:
        assert not worker.is_running()

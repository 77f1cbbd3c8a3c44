"""One pod with two API processes (API_SERVER_COUNT=2) on one engine: vLLM's multi-API-server
mode with the runtime's whole edge in each process, on one port.

- 41 completions at once against MAX_CONCURRENCY=2 and MAX_QUEUE_LENGTH=38 (the engine held
  still meanwhile): exactly one is refused, wherever the connections landed -- the limits hold
  for the pod, not per process -- and the other 40 are answered, by both processes;
- a job is found, streamed and cancelled from any connection, whichever process accepted it;
- /metrics counts every request once (vLLM's counters and ours), the same on the main port and
  the control port, which the pod answers once;
- the engine can always reach each API process again: the socket files it connects to are
  there for the pod's life (vLLM unlinks them when the launcher's handle is collected; a
  connection the engine had to make again found nothing, and that process never answered);
- SIGTERM drains every process and the pod exits 0 with nothing left behind.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import re
import signal
import socket

import httpx
import pytest
from ports import free_port
from proc_kit import (
    api_process_pids,
    engines_frozen,
    group_members,
    listening_unix_paths,
    wait_until,
)
from runtime_process import running_runtime

pytestmark = pytest.mark.engine

LIMIT, QUEUE = 2, 38
COMPLETION = {"model": "demo", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
JOB = {"input": {"prompt": "Hi", "sampling_params": {"max_tokens": 8}}}
HTTP_REQUESTS = "llmendpoints_http_requests_total"
ACCESS = re.compile(r"uvicorn\.access (ApiServer_\d) .*\"(GET|POST) (\S+) HTTP/1\.1\" (\d+)")


@pytest.fixture(scope="module")
def pod(demo_model, runtime_logs):
    control = free_port()
    with running_runtime(
        demo_model,
        runtime_logs,
        API_SERVER_COUNT="2",
        MAX_CONCURRENCY=str(LIMIT),
        MAX_QUEUE_LENGTH=str(QUEUE),
        LLMEP_CONTROL_PORT=str(control),
    ) as server:
        server.control = control
        yield server


def fresh(url: str, method: str = "GET", **kwargs) -> httpx.Response:
    """On a connection of its own: it lands on whichever API process accepts it."""
    with httpx.Client(timeout=120) as client:
        return client.request(method, url, **kwargs)


def access_lines(server) -> list[tuple[str, str, str, int]]:
    """(process, method, path, status) of every request the API processes logged."""
    return [
        (m.group(1), m.group(2), m.group(3), int(m.group(4)))
        for m in map(ACCESS.search, server.log().splitlines())
        if m
    ]


def series(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metrics(server, port: int | None = None) -> str:
    return fresh(f"http://127.0.0.1:{port or server.control}/metrics").text


def test_the_limits_hold_for_the_pod_and_both_processes_answer(pod):
    # The main port renders /metrics when asked; the control port answers what the pod last
    # published (at most half a second old: x-llmep-answer-age-ms).
    before = metrics(pod, pod.port)
    url = pod.url + "/v1/completions"
    with concurrent.futures.ThreadPoolExecutor(41) as pool:
        with engines_frozen(pod.process.pid):
            sent = [pool.submit(fresh, url, "POST", json=COMPLETION) for _ in range(41)]

            def admitted() -> bool:  # 2 running, 38 waiting, 1 refused: the pod's bounds
                text = metrics(pod)
                return (
                    series(text, "llmendpoints_requests_in_flight") == LIMIT
                    and series(text, "llmendpoints_queue_depth") == QUEUE
                    and sum(f.done() for f in sent) == 1
                )

            wait_until(admitted, 120, "41 requests admitted or refused")
            [refused] = [f.result() for f in sent if f.done()]
            assert refused.status_code == 429, refused.text
            assert "MAX_QUEUE_LENGTH" in refused.json()["error"]["message"]
        # The engine goes on: the 40 admitted are answered.
        codes = collections.Counter(f.result().status_code for f in sent)
    assert codes == {200: 40, 429: 1}

    served = collections.Counter(
        process
        for process, method, path, status in access_lines(pod)
        if (method, path, status) == ("POST", "/v1/completions", 200)
    )
    assert sum(served.values()) == 40 and set(served) == {"ApiServer_0", "ApiServer_1"}, served

    # Every request counted once, the same from the main port (any process) and the control
    # port: vLLM's counters and ours, across both processes' series. (A counter moves just
    # after its response has gone: both are read once they have reached the 40.)
    def delta(now: str, name: str, **labels: str) -> float:
        return series(now, name, **labels) - series(before, name, **labels)

    success, answered = "vllm:request_success_total", {"route": "/v1/completions", "code": "200"}
    for port in (pod.port, pod.control):
        wait_until(
            lambda port=port: (now := metrics(pod, port)) and delta(now, success) >= 40
            and delta(now, HTTP_REQUESTS, **answered) >= 40,
            30,
            f"the counters settled on port {port}",
        )  # fmt: skip
        now = metrics(pod, port)
        assert delta(now, success) == 40
        assert delta(now, HTTP_REQUESTS, **answered) == 40
        # (Refused before vLLM's router saw it: its route label is "unmatched".)
        assert delta(now, HTTP_REQUESTS, method="POST", code="429") == 1
        assert delta(now, "llmendpoints_requests_rejected_total", reason="queue_full") == 1


def test_jobs_are_found_from_any_connection(pod):
    ids = [fresh(pod.url + "/run", "POST", json=JOB).json()["id"] for _ in range(6)]
    assert {job_id.rsplit("-", 1)[1] for job_id in ids} <= {"p0", "p1"}
    for job_id in ids:
        wait_until(
            lambda job_id=job_id: (
                fresh(f"{pod.url}/status/{job_id}").json()["status"] == "COMPLETED"
            ),
            120,
            f"job {job_id} completed",
        )
        for _ in range(4):
            status = fresh(f"{pod.url}/v2/demo/status/{job_id}")
            assert status.status_code == 200 and status.json()["output"], status.text
        stream = fresh(f"{pod.url}/stream/{job_id}")
        assert stream.status_code == 200 and stream.json()["status"] == "COMPLETED"
    # Some were asked of the process that does not hold them, and found.
    crossed = [
        path
        for process, method, path, status in access_lines(pod)
        if path.startswith("/v2/demo/status/") and status == 200
        and not path.endswith("-p" + process.rsplit("_", 1)[1])
    ]  # fmt: skip
    assert crossed, "no status was asked of the other process"
    assert fresh(f"{pod.url}/status/unknown-p1").status_code == 404

    counts = fresh(pod.url + "/v2/demo/health").json()["jobs"]
    assert counts["completed"] >= 6  # every process's jobs, summed

    with engines_frozen(pod.process.pid):
        held = fresh(pod.url + "/run", "POST", json=JOB).json()["id"]
        cancelled = fresh(f"{pod.url}/cancel/{held}", "POST")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "CANCELLED"
    assert fresh(f"{pod.url}/status/{held}").json()["status"] == "CANCELLED"


def test_the_engine_can_reach_every_api_process_again(pod):
    apis = api_process_pids(pod.process.pid)
    assert len(apis) == 2
    for pid in apis:
        # The engine's two connections to each process: its requests in, the answers out.
        engine_sockets = [path for path in listening_unix_paths(pid) if "llmep-pod-" not in path]
        assert len(engine_sockets) == 2, listening_unix_paths(pid)
        missing = [path for path in engine_sockets if not os.path.exists(path)]
        assert not missing, f"API process {pid} listens on unlinked paths {missing}"


def test_sigterm_drains_every_process_and_the_pod_exits_0(pod):
    members = group_members(pod.process.pid)
    assert len(members) >= 5  # supervisor, two API processes, engine core, control port

    def in_flight() -> float:  # rendered when asked (the control port's may be 0.5 s old)
        return series(metrics(pod, pod.port), "llmendpoints_requests_in_flight")

    # Nothing left of the last test (its cancelled job): else its 1 is taken for the request
    # below, and SIGTERM goes before the request has reached the pod (CI, and a run here).
    wait_until(lambda: in_flight() == 0, 60, "nothing in flight")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with engines_frozen(pod.process.pid) as cores:
            held = pool.submit(fresh, pod.url + "/v1/completions", "POST", json=COMPLETION)
            wait_until(lambda: in_flight() == 1, 60, "a request in flight")
            pod.process.send_signal(signal.SIGTERM)
            # Every process says so at once (the control port, and the main port of any).
            wait_until(lambda: fresh(f"http://127.0.0.1:{pod.control}/ready").status_code
                       == 503, 30, "draining")  # fmt: skip
            assert pod.process.poll() is None and all(p in group_members(pod.process.pid)
                                                     for p in cores)  # fmt: skip
        # The engine goes on: the request in flight is answered before the pod ends.
        try:
            answered = held.result(timeout=120)
        except httpx.TransportError as exc:
            raise AssertionError(
                f"no answer ({exc!r}); the pod's log:\n{pod.log()[-8000:]}"
            ) from exc
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["completion_tokens"] == COMPLETION["max_tokens"]
    # Once the API processes are gone the port refuses: nothing waits to be reset at the end
    # (the engine takes a few seconds more to stop).
    wait_until(lambda: not api_process_pids(pod.process.pid), 60, "the API processes gone")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", pod.port), timeout=5).close()
    assert pod.process.wait(120) == 0, pod.log()[-3000:]
    wait_until(lambda: not group_members(pod.process.pid), 30, "nothing of the pod left")

"""A dead engine stops taking traffic: the engine core is killed by its pid (SIGKILL, as the
kernel's OOM killer would) while one job runs and one waits. Readiness, liveness and every
route answer 503 in their own shape (no Python text); both jobs fail naming the engine; after
ENGINE_DEATH_EXIT_DELAY_SECONDS the process exits non-zero and nothing of its group survives."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from proc_kit import engine_core_pids, group_members, wait_until
from runtime_process import running_runtime

pytestmark = pytest.mark.engine

LONG_JOB = {"input": {"prompt": "Hi", "sampling_params": {"max_tokens": 480, "ignore_eos": True}}}
EXIT_DELAY = 20  # long enough to look at every answer before the process goes


def _status(server, job_id: str) -> dict:
    return httpx.get(f"{server.url}/status/{job_id}", timeout=30).json()


def test_a_dead_engine_answers_503_everywhere_fails_its_jobs_and_exits_non_zero(
    demo_model, runtime_logs
):
    with running_runtime(
        demo_model,
        runtime_logs,
        MAX_CONCURRENCY="1",  # the second job waits in the queue
        ENGINE_DEATH_EXIT_DELAY_SECONDS=str(EXIT_DELAY),
    ) as server:
        url = server.url
        [core] = engine_core_pids(server.process.pid)
        # The demo model finishes a job in a fraction of a second: freeze the engine core first,
        # so that one job is surely running (sent to the engine) and the next one waiting.
        os.kill(core, signal.SIGSTOP)
        running = httpx.post(url + "/run", json=LONG_JOB, timeout=30).json()["id"]
        queued = httpx.post(url + "/run", json=LONG_JOB, timeout=30).json()["id"]
        wait_until(lambda: _status(server, running)["status"] == "IN_PROGRESS", 120, "job running")
        assert _status(server, queued)["status"] == "IN_QUEUE"
        os.kill(core, signal.SIGKILL)

        wait_until(lambda: httpx.get(url + "/ping").status_code == 503, 30, "/ping 503")
        for probe in ("/ping", "/ready", "/ready?strict=1", "/health"):
            assert httpx.get(url + probe).status_code == 503, probe
        assert "engine core" in httpx.get(url + "/health").json()["reason"]

        for path, body in [
            ("/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 2}),
            (
                "/v1/chat/completions",
                {"model": "demo", "messages": [{"role": "user", "content": "x"}]},
            ),
            ("/invocations", {"inputs": "Hi"}),
            ("/run", LONG_JOB),
            ("/runsync", LONG_JOB),
        ]:
            response = httpx.post(url + path, json=body, timeout=30)
            assert response.status_code == 503, (path, response.text)
            error = response.json()["error"]
            assert error["type"] == "ServiceUnavailableError", (path, error)
            assert "Traceback" not in error["message"] and "Error:" not in error["message"]

        for job in (running, queued):
            status = wait_until(
                lambda job=job: (s := _status(server, job))["status"] == "FAILED" and s,
                30,
                f"job {job} FAILED",
            )
            assert "engine" in status["error"]["message"].lower(), status

        # Then the process goes, by itself, with a status that makes Kubernetes restart it.
        assert server.process.wait(EXIT_DELAY + 90) != 0
        assert "exiting with status 1" in server.log()
        wait_until(lambda: not group_members(server.process.pid), 10, "no process of its group")

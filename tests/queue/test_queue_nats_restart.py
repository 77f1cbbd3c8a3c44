"""A NATS restart keeps queued and finished jobs: two real runtime processes (vLLM on the demo
model) on one real nats-server, started for this module alone -- test_queue_runtime.py's pods
and server, fresh: that module's last test kills one of its pods and leaves long jobs behind.
One of the two is stopped before the test: one pod serves the queue, as there."""

from __future__ import annotations

import time

import proc_kit
import pytest
from test_queue_runtime import (
    LONG,
    client,
    demo_model,  # noqa: F401 (imported fixtures: this module gets its own instances)
    nats,  # noqa: F401
    pods,  # noqa: F401
    wait_status,
)

pytestmark = pytest.mark.engine


def test_nats_restart_keeps_queued_and_finished_jobs(pods, nats) -> None:  # noqa: F811
    # One pod takes every job, so where the short job waits is known: with both up, the other
    # pod's slots freed as its long jobs ended and it took the short job (a fresh-clone CI run).
    survivor, other = pods
    other.stop()
    with client(survivor) as http:
        answer = http.post(
            "/runsync", json={"input": {"prompt": "x", "sampling_params": {"max_tokens": 3}}}
        )
        finished = answer.json()
        assert finished.get("status") == "COMPLETED", (answer.status_code, finished)
        # Two slots, both taken by long jobs, and two more long jobs queued behind them: the
        # short job stays queued even if a running job ends before it is submitted.
        with proc_kit.engines_frozen(survivor.process.pid):  # the long jobs stay running
            busy = [http.post("/run", json={"input": LONG}).json()["id"] for _ in range(4)]
            for job_id in busy[:2]:
                wait_status(http, job_id, {"IN_PROGRESS"})
            # ignore_eos: the demo model's random weights may end a sequence after one token.
            queued = http.post(
                "/run",
                json={
                    "input": {
                        "prompt": "q",
                        "sampling_params": {"max_tokens": 4, "ignore_eos": True},
                    }
                },
            ).json()["id"]
            state = http.get(f"/status/{queued}").json()
            assert state.get("status") == "IN_QUEUE", state

        nats.stop()
        refused = http.post("/run", json={"input": {"prompt": "x"}})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert "id" not in refused.json()
        # The pod keeps serving OpenAI requests without its queue.
        completion = http.post(
            "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2}
        )
        assert completion.status_code == 200

        nats.start()  # same storage directory
        deadline = time.monotonic() + 60
        while True:
            answer = http.get(f"/status/{finished['id']}")
            if answer.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert answer.json()["output"] == finished["output"]
        assert (
            wait_status(http, queued, {"COMPLETED"}, timeout=180)["output"][0]["usage"]["output"]
            == 4
        )
        for job_id in busy:
            http.post(f"/cancel/{job_id}")

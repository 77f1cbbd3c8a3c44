"""Start-up, configuration errors, engine failure and graceful drain of the real process."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import pytest
from held_stream import HeldStream
from runtime_process import RUNTIME_BIN, free_port, launch_runtime, runtime_env

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"MAX_MODEL_LEN": "lots"}, "MAX_MODEL_LEN"),
        ({"SM_VLLM_NOT_A_FLAG": "1"}, "SM_VLLM_NOT_A_FLAG"),
        ({"PORT": "eighty"}, "PORT"),
        ({"ROPE_SCALING": '{"type": "linear"}'}, "ROPE_SCALING"),
        ({"MODEL_NAME": ""}, "MODEL_NAME"),
    ],
)
def test_configuration_errors_exit_2_with_one_line_naming_the_variable(
    demo_model, overrides, variable
):
    env = runtime_env(demo_model, free_port(), **overrides)
    result = subprocess.run(
        [str(RUNTIME_BIN), "serve"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"llmendpoints-runtime: configuration error: {variable}: "), (
        result.stderr
    )


def test_engine_failure_is_reported_by_ready_and_health(demo_model, runtime_logs, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    server = launch_runtime(broken, runtime_logs)
    try:
        server.wait_listening()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready = httpx.get(server.url + "/ready")
            if ready.status_code == 503:
                break
            time.sleep(0.5)
        assert ready.status_code == 503
        assert ready.json()["status"] == "failed"
        assert ready.json()["reason"]
        assert httpx.get(server.url + "/health").status_code == 503
        models = httpx.get(server.url + "/v1/models")
        assert models.status_code == 503
        assert "not available" in models.json()["error"]["message"]
    finally:
        server.stop()


def test_http_first_then_ready_then_drain_on_sigterm(demo_model, runtime_logs):
    server = launch_runtime(
        demo_model, runtime_logs, DRAIN_TIMEOUT_SECONDS="60", MAX_MODEL_LEN="2048"
    )
    try:
        server.wait_listening()
        # The engine is still loading: the server answers, and says so.
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/ready").status_code == 204
        assert httpx.get(server.url + "/ready?strict=1").status_code == 503
        loading = httpx.get(server.url + "/v1/models")
        assert loading.status_code == 503
        assert loading.headers["retry-after"]
        assert "still loading" in loading.json()["error"]["message"]
        server.wait_ready()

        # A long stream is in flight when SIGTERM arrives (its client has not read it yet):
        # it must finish.
        held = HeldStream(server.url)
        assert held.status == 200
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while (draining := httpx.get(server.url + "/ready")).status_code != 503:
            assert time.monotonic() < deadline, "never started draining"
            time.sleep(0.1)
        assert draining.json()["status"] == "draining"

        assert held.finish() == HeldStream.TOKENS
        assert held.events[-1] == b"[DONE]"
        finished = [json.loads(e)["choices"] for e in held.events[:-1]]
        indexes = {c["index"] for cs in finished for c in cs if c["finish_reason"] == "length"}
        assert indexes == set(range(HeldStream.BODY["n"]))
        assert server.process.wait(60) == 0
        assert "drained: nothing in flight" in server.log()
    finally:
        server.stop()

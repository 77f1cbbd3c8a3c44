"""A Hub model: downloaded once into BASE_PATH with visible progress, then served from there."""

from __future__ import annotations

import re

import httpx
import pytest
from fake_hub import FakeHub
from runtime_process import launch_runtime

pytestmark = pytest.mark.engine


def test_model_is_downloaded_into_base_path_with_progress_then_served(
    demo_model, runtime_logs, tmp_path
):
    base_path = tmp_path / "model-cache"
    # ~1.6 MB of weights at 400 KB/s: a few seconds, several progress lines at 0.5 s.
    with FakeHub(demo_model, "acme/tiny-llama", bytes_per_second=400_000) as hub:
        server = launch_runtime(
            demo_model,
            runtime_logs,
            MODEL_NAME="acme/tiny-llama",
            BASE_PATH=str(base_path),
            HF_ENDPOINT=hub.url,
            HF_HUB_OFFLINE="0",
            HF_HUB_DISABLE_TELEMETRY="1",
            STARTUP_LOG_INTERVAL_SECONDS="0.5",
        )
        try:
            server.wait_listening()
            server.wait_ready()
            models = httpx.get(server.url + "/v1/models").json()
            assert models["data"][0]["id"] == "demo"
            reply = httpx.post(
                server.url + "/v1/completions",
                json={"model": "demo", "prompt": "Hi", "max_tokens": 3},
            )
            assert reply.status_code == 200
            metrics = httpx.get(server.url + "/metrics").text
        finally:
            server.stop()

    log = server.log()
    progress = re.findall(r"downloading acme/tiny-llama: ([\d.]+)/([\d.]+) GiB \((\d+)%", log)
    assert len(progress) >= 3, log[-3000:]
    assert progress[-1][2] == "100"
    assert [int(p[2]) for p in progress] == sorted(
        int(p[2]) for p in progress
    )  # never goes backwards
    download_seconds = float(
        re.search(
            r'llmendpoints_startup_phase_seconds\{phase="download"\} ([\d.e+-]+)', metrics
        ).group(1)
    )
    assert download_seconds > 1.0
    # The weights landed in the Hugging Face cache under BASE_PATH, fetched once.
    snapshot = base_path / "hub" / "models--acme--tiny-llama" / "snapshots"
    fetched = {p.name for p in snapshot.glob("*/*")}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= fetched
    weight_gets = [
        r for r in hub.requests if r.startswith("GET") and r.endswith("/model.safetensors")
    ]
    assert len(weight_gets) == 1

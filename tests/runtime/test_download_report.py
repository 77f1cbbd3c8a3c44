"""`llmendpoints-runtime download --report PATH`, as the operator's download Job runs it
(PATH: the container's termination message): the outcome as JSON -- the model's bytes in the
cache, what this run fetched of them, the seconds -- or the error. A real process against a
stand-in Hub; no engine."""

from __future__ import annotations

import json
import subprocess

from fake_hub import FakeHub
from runtime_process import RUNTIME_BIN, clean_env


def _download(hub_url: str, base, report, model: str = "acme/tiny-llama"):
    env = clean_env(
        MODEL_NAME=model,
        BASE_PATH=str(base),
        HF_ENDPOINT=hub_url,
        HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    return subprocess.run(
        [str(RUNTIME_BIN), "download", "--report", str(report)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_report_says_what_was_downloaded_and_a_second_run_fetches_nothing(demo_model, tmp_path):
    base, report = tmp_path / "cache", tmp_path / "termination-log"
    weights = (demo_model / "model.safetensors").stat().st_size
    with FakeHub(demo_model, "acme/tiny-llama", bytes_per_second=50_000_000) as hub:
        first = _download(hub.url, base, report)
        assert first.returncode == 0, first.stderr
        done = json.loads(report.read_text())
        again = _download(hub.url, base, report)
        assert again.returncode == 0, again.stderr
        cached = json.loads(report.read_text())
    assert set(done) == {"bytes", "fetchedBytes", "seconds"}
    assert done["bytes"] >= weights and done["fetchedBytes"] == done["bytes"]
    assert done["seconds"] >= 0
    assert cached["bytes"] == done["bytes"] and cached["fetchedBytes"] == 0


def test_a_failed_download_reports_why(demo_model, tmp_path):
    report = tmp_path / "termination-log"
    with FakeHub(demo_model, "acme/tiny-llama") as hub:
        result = _download(hub.url, tmp_path / "cache", report, model="acme/missing")
    assert result.returncode == 1
    error = json.loads(report.read_text())["error"]
    assert error.startswith("MODEL_NAME 'acme/missing'") and "download failed" in result.stderr

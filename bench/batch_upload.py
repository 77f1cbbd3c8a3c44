"""A large batch file uploaded and validated through the gateway: what it costs everyone else.

    .venv/bin/python bench/batch_upload.py                 # both files, ~2 minutes
    .venv/bin/python bench/batch_upload.py --only lines    # the 95 MB, 50,000-line file

Goals (issues 28 and 29; DESIGN.md, fourth round): while a 95 MB file of 50,000 requests is
uploaded through the gateway and its batch validated, no `/v1/models` answer slower than 250 ms
and no interactive stream gap more than 250 ms above the baseline; the gateway's RSS grows by at
most 64 MiB. The same for one 190 MiB line (a file that is one unterminated JSON text).

The stack: a real `nats-server -js`, the stand-in backend (bench/gateway_standin.py: streams an
event every 20 ms, costs nothing) and the real gateway (`llmendpoints-gateway serve`, batches on
the shared queue). The watching is tests/gateway/upload_load.py's: `/v1/models` every 50 ms and a
chat stream's gaps from two processes of their own (each subtracting its own CPU wait), the RSS
of the gateway's whole process tree sampled every 100 ms. Phases: 5 s of baseline, the upload,
the batch's validation (created, then polled until it is no longer `validating`).

Results: Markdown on stdout, JSON in bench/out/batch_upload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from gateway.harness import launch_gateway, launch_standin  # noqa: E402
from gateway.upload_load import (  # noqa: E402
    MiB,
    Watching,
    upload,
    validate,
    write_one_line_file,
    write_requests_file,
)
from integration.nats_kit import NatsServer  # noqa: E402

KEY = "sk-bench"
MODEL = "standin"
GOAL_MS = 250.0
GOAL_RSS_MIB = 64.0


def run(kind: str, path: Path, gateway, logs: Path) -> dict:
    watch = Watching(gateway.port, gateway.process.pid, KEY, MODEL, logs / kind)
    watch.out_dir.mkdir(exist_ok=True)
    outcome: dict = {}
    with watch.running():
        with watch.phase("baseline"):
            time.sleep(5)
        with watch.phase("upload"):
            began = time.monotonic()
            response = upload(gateway.url, KEY, path)
            outcome["upload_seconds"] = round(time.monotonic() - began, 2)
            outcome["upload_status"] = response.status_code
        if response.status_code == 200:
            with watch.phase("validate"):
                began = time.monotonic()
                batch = validate(gateway.url, KEY, response.json()["id"])
                outcome["validate_seconds"] = round(time.monotonic() - began, 2)
                outcome["batch_status"] = batch["status"]
                outcome["batch_errors"] = [
                    e["code"] for e in (batch.get("errors") or {}).get("data", [])
                ]
        else:
            outcome["upload_answer"] = response.text[:300]
        time.sleep(1)
    outcome.update(watch.summary("baseline", ("upload", "validate")))
    outcome["file_mib"] = round(path.stat().st_size / MiB, 1)
    return outcome


def table(results: dict[str, dict]) -> str:
    rows = [
        ("file (MiB)", "file_mib", "{:.1f}"),
        ("upload (s)", "upload_seconds", "{}"),
        ("validation (s)", "validate_seconds", "{}"),
        ("batch status after validation", "batch_status", "{}"),
        ("/v1/models probes during", "models_probes", "{}"),
        ("/v1/models max (ms) [goal <= 250]", "models_max_ms", "{:.0f}"),
        ("/v1/models max, the loop's CPU wait taken off (ms)", "models_max_net_ms", "{:.0f}"),
        ("/v1/models p99 (ms)", "models_p99_ms", "{:.0f}"),
        ("stream gap, baseline median (ms)", "stream_baseline_gap_ms", "{:.0f}"),
        ("stream gap max during (ms) [goal <= baseline + 250]", "stream_max_gap_ms", "{:.0f}"),
        ("stream gap max, the loop's CPU wait taken off (ms)", "stream_max_gap_net_ms", "{:.0f}"),
        ("stream gap p99 during (ms)", "stream_p99_gap_ms", "{:.0f}"),
        ("gateway RSS baseline (MiB)", "rss_baseline_mib", "{:.0f}"),
        ("gateway RSS growth (MiB) [goal <= 64]", "rss_growth_mib", "{:.0f}"),
        ("gateway processes' CPU wait during (ms)", "gateway_cpu_wait_ms", "{:.0f}"),
    ]
    names = list(results)
    out = ["| | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for label, key, fmt in rows:
        cells = []
        for name in names:
            value = results[name].get(key)
            cells.append("-" if value is None else fmt.format(value))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=("lines", "one-line"), default=None)
    parser.add_argument("--workers", default="1", help="GATEWAY_WORKERS")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="batch-upload-"))
    files = {}
    if args.only in (None, "lines"):
        files["95 MB, 50,000 lines"] = write_requests_file(
            logs / "requests.jsonl", 50_000, 1_900, MODEL
        )
    if args.only in (None, "one-line"):
        files["190 MiB, one line"] = write_one_line_file(logs / "one-line.jsonl", 190 * MiB)
    nats = NatsServer(store_dir=logs / "nats", log_path=logs / "nats.log")
    nats.start()
    standin = launch_standin(logs, "s1")
    endpoints = logs / "endpoints.yaml"
    endpoints.write_text(
        yaml.safe_dump(
            {
                "endpoints": [{"name": "bench", "models": [MODEL], "backends": [standin.url]}],
                "apiKeys": [{"name": "bench", "key": KEY}],
            }
        )
    )
    gateway = launch_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=str(endpoints),
        JOBS_QUEUE_URL=nats.url,
        GATEWAY_WORKERS=args.workers,
        # 50,000 requests of ~450 prompt tokens pass the default 20,000,000 enqueued tokens.
        LLMEP_BATCH_MAX_ENQUEUED_TOKENS="100000000",
    )
    results: dict[str, dict] = {}
    try:
        standin.wait_http("/ready")
        gateway.wait_http("/health")
        time.sleep(3)  # discovery's first probe, the queue's streams
        for name, path in files.items():
            results[name] = run(name.split(",")[0].replace(" ", "-"), path, gateway, logs)
            path.unlink()
    finally:
        gateway.stop()
        standin.stop()
        nats.stop()
    print(f"load average before the run ends: {os.getloadavg()}")
    print(table(results))
    out = REPO / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "batch_upload.json").write_text(json.dumps(results, indent=2, default=str))
    for name, result in results.items():
        print(f"\n{name}: peak RSS by process (MiB): {result['rss_peak_by_process_mib']}")


if __name__ == "__main__":
    main()

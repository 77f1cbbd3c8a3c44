"""An interactive stream watched from a process of its own: streamed chat completions sent back
to back through the gateway until stdin closes, every gap between two events recorded, then
written as JSON.

    python tests/gateway/stream_prober.py --port 8080 --key sk-x --model m --out gaps.json \\
        [--chunks 100] [--interval 0.02]

With the stand-in backend (bench/gateway_standin.py) each stream has ``--chunks`` events
``--interval`` seconds apart, so a gap well above the interval is time the gateway (or the
machine) held the stream. Each record: wall time of the event, ``gap_ms`` since the previous
event of its stream (the first: since the request was sent), and ``wait_ms``: how long this
prober was runnable but waiting for a CPU during that gap (its schedstat, as
tests/runtime/prober.py records), so a reader can tell a slow gateway from a prober that was not
running.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from prober import run_delay_ms  # tests/runtime/prober.py


def stream_once(
    conn: http.client.HTTPConnection, key: str, body: bytes, records: list[dict]
) -> str | None:
    """One stream; its events' gaps appended to ``records``; an error's text, or None."""
    began, waited = time.monotonic(), run_delay_ms()
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body,
            {"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        response = conn.getresponse()
        if response.status != 200:
            return f"status {response.status}: {response.read()[:200]!r}"
        while line := response.readline():
            if not line.startswith(b"data: "):
                continue
            now, wait = time.monotonic(), run_delay_ms()
            records.append(
                {"t": time.time(), "gap_ms": (now - began) * 1000, "wait_ms": wait - waited}
            )
            began, waited = now, wait
            if line.strip() == b"data: [DONE]":
                response.read()
                return None
        return "the stream ended before [DONE]"
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    body = json.dumps(
        {
            "model": args.model,
            "messages": [{"role": "user", "content": "hello"}],
            "stream": True,
            "standin_chunks": args.chunks,
            "standin_interval": args.interval,
        }
    ).encode()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    records: list[dict] = []
    errors: list[dict] = []
    waited_before = run_delay_ms()
    conn = http.client.HTTPConnection(args.host, args.port, timeout=30)
    while not stop.is_set():
        error = stream_once(conn, args.key, body, records)
        if error is not None:
            errors.append({"t": time.time(), "error": error})
            stop.wait(0.1)
    args.out.write_text(
        json.dumps(
            {
                "records": records,
                "errors": errors,
                "prober_run_delay_ms": run_delay_ms() - waited_before,
            }
        )
    )


if __name__ == "__main__":
    main()

"""The gateway's SSE meter on its own: CPU per relayed event, this code next to an older
checkout's (the reader every streamed answer's bytes pass through; issue 28 rewrote it).

    .venv/bin/python bench/stream_meter.py --before /path/to/old/checkout   # ~30 s

Each reader is fed one vLLM-shaped chat chunk (compact JSON, one token of content) per call,
as the replica's writes arrive, ``--events`` times, with the usage chunk stripped (the client did
not ask for it: the usual case) and not; best of ``--repeat`` runs of process CPU time. Each
checkout is measured in a process of its own, its packages first on PYTHONPATH (before
stream_meter.py existed, ``StreamUsage`` was in metering.py). Results: Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVENT = (
    b"data: "
    + json.dumps(
        {
            "id": "chatcmpl-0123456789abcdef",
            "object": "chat.completion.chunk",
            "created": 1_800_000_000,
            "model": "demo",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": " token"},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        },
        separators=(",", ":"),
    ).encode()
    + b"\n\n"
)


def reader_class():
    """``StreamUsage`` of the code on this process's path (stream_meter.py, or metering.py in a
    checkout from before it)."""
    try:
        from llmendpoints_gateway.stream_meter import StreamUsage
    except ImportError:
        from llmendpoints_gateway.metering import StreamUsage
    return StreamUsage


def per_event_us(cls, strip: bool, events: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        reader = cls(strip)
        started = time.process_time()
        for _ in range(events):
            reader.feed(EVENT)
        best = min(best, time.process_time() - started)
    return best / events * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="an older checkout, measured too")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # in a process whose path holds one checkout's packages
        cls = reader_class()
        rows = [
            (strip, per_event_us(cls, strip, args.events, args.repeat)) for strip in (True, False)
        ]
        print(json.dumps(rows))
        return 0
    trees = ([("before", args.before.resolve())] if args.before else []) + [("after", REPO)]
    rows = []
    for label, code in trees:
        path = os.pathsep.join(str(code / f) for f in ("gateway", "common", "edge"))
        done = subprocess.run(
            [sys.executable, __file__, "--measure", "--events", str(args.events),
             "--repeat", str(args.repeat)],
            env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows += [(label, strip, us) for strip, us in json.loads(done.stdout)]
    command = " ".join([".venv/bin/python", "bench/stream_meter.py", *sys.argv[1:]])
    print(f"Command: `{command}`  ")
    print(f"Machine: {os.cpu_count()} CPU cores; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}. Event: {len(EVENT)} bytes.\n")  # fmt: skip
    print("| code | usage chunk stripped | CPU per event, µs (best of runs) |")
    print("| --- | --- | --- |")
    for label, strip, us in rows:
        print(f"| {label} | {'yes (usual)' if strip else 'no'} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

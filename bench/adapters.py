"""LoRA adapters at run time: how soon a declared adapter serves, and what a pending one costs.

    .venv/bin/python bench/adapters.py                      # ~2 minutes on 2 cores
    .venv/bin/python bench/adapters.py --cycles 10 --requests 300

One `llmendpoints-runtime serve` on the demo model with LLMEP_ADAPTERS_FILE (polled every 0.5 s).

1. Declare -> serving: a fresh demo adapter (a local path) is added to the list; the clock runs
   until `/v1/completions` with `model: <adapter>` answers 200. Then it is removed; the clock runs
   until the answer is 404. Repeated `--cycles` times. Both include up to one poll interval.
2. The gate's cost on other requests: while some declared adapter is not loaded, every POST body
   is read once more and searched for that adapter's name (adapters/gate.py). Sequential
   one-token requests to the base model, alternating rounds with and without a pending adapter
   (a declared path that does not exist: it fails and stays pending); median latency per side.

Results: a Markdown section on stdout (for bench/RESULTS.md) and bench/out/adapters.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POLL_SECONDS = 0.5


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def declare(path: Path, adapters: list[dict]) -> None:
    staged = path.with_suffix(".tmp")
    staged.write_text(json.dumps({"adapters": adapters}))
    os.replace(staged, path)


def status_of(client: httpx.Client, model: str) -> int:
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    return client.post("/v1/completions", json=body).status_code


def wait_status(client: httpx.Client, model: str, wanted: int, timeout: float = 60) -> float:
    began = time.perf_counter()
    while time.perf_counter() - began < timeout:
        if status_of(client, model) == wanted:
            return time.perf_counter() - began
        time.sleep(0.02)
    raise TimeoutError(f"{model} never answered {wanted}")


def base_latencies(client: httpx.Client, n: int) -> list[float]:
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    out = []
    for _ in range(n):
        began = time.perf_counter()
        client.post("/v1/completions", json=body).raise_for_status()
        out.append(time.perf_counter() - began)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="per side and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = root / "demo-model"
        subprocess.run([BIN / "llmendpoints-runtime", "demo-model", model], check=True)
        listing = root / "adapters.json"
        declare(listing, [])
        port = free_port()
        env = {
            **os.environ,
            "MODEL_NAME": str(model),
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "demo",
            "MAX_MODEL_LEN": "512",
            "HOST": "127.0.0.1",
            "PORT": str(port),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "ENABLE_LORA": "1",
            "MAX_LORA_RANK": "8",
            "LLMEP_ADAPTERS_FILE": str(listing),
            "LLMEP_ADAPTERS_POLL_SECONDS": str(POLL_SECONDS),
            "LLMEP_LOG_LEVEL": "warning",
        }
        log = (REPO / "bench" / "out").resolve()
        log.mkdir(parents=True, exist_ok=True)
        with (log / "adapters-server.log").open("wb") as out:
            server = subprocess.Popen(
                [BIN / "llmendpoints-runtime", "serve"], env=env, stdout=out, stderr=out
            )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    try:
                        if client.get("/ready").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.5)
                else:
                    raise TimeoutError("the runtime did not become ready")

                served, gone = [], []
                for i in range(args.cycles):
                    path = root / f"a{i}"
                    subprocess.run(
                        [BIN / "llmendpoints-runtime", "demo-adapter", path, "--seed", str(i + 1)],
                        check=True,
                        capture_output=True,
                    )
                    declare(listing, [{"name": f"a{i}", "source": str(path)}])
                    served.append(wait_status(client, f"a{i}", 200))
                    declare(listing, [])
                    gone.append(wait_status(client, f"a{i}", 404))

                pending = [{"name": "pending", "source": str(root / "missing")}]
                base_latencies(client, 20)  # warm-up
                sides: dict[str, list[float]] = {"none pending": [], "one pending": []}
                for _ in range(args.rounds):
                    for side, listed in (("none pending", []), ("one pending", pending)):
                        declare(listing, listed)
                        time.sleep(POLL_SECONDS * 3)
                        want = 503 if listed else 404
                        assert status_of(client, "pending") == want, side
                        sides[side] += base_latencies(client, args.requests)
        finally:
            server.terminate()
            server.wait(60)

    result = {
        "declare_to_served_s": served,
        "remove_to_404_s": gone,
        "base_latency_median_ms": {k: statistics.median(v) * 1000 for k, v in sides.items()},
        "poll_seconds": POLL_SECONDS,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    (REPO / "bench" / "out" / "adapters.json").write_text(json.dumps(result, indent=2))
    lat = result["base_latency_median_ms"]
    print(
        f"""
## LoRA adapters at run time (bench/adapters.py)

`{" ".join(sys.argv)}` on {result["machine"]}, poll interval {POLL_SECONDS} s.

| | median | max |
| --- | --- | --- |
| declared -> served (s) | {statistics.median(served):.2f} | {max(served):.2f} |
| removed -> 404 (s) | {statistics.median(gone):.2f} | {max(gone):.2f} |

Base-model one-token requests, median latency: {lat["none pending"]:.2f} ms with no adapter
pending, {lat["one pending"]:.2f} ms with one declared adapter pending (ratio
{lat["one pending"] / lat["none pending"]:.3f}; {args.rounds} alternating rounds of {args.requests}).
"""
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

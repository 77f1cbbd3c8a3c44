"""A large batch upload through a real gateway, watched from outside: what it costs everyone else.

Shared by tests/gateway/test_batch_load.py (the goals as assertions) and bench/batch_upload.py
(the numbers for bench/RESULTS.md). While something is done to the gateway (``Watching.phase``):

- ``tests/runtime/prober.py`` asks ``/v1/models`` every 50 ms, in a process of its own;
- ``stream_prober.py`` streams chat completions back to back through the gateway (from the
  stand-in backend: an event every ``STREAM_INTERVAL`` s) and records every gap, in another;
- a thread here samples the RSS of the gateway's processes (the whole tree: supervisor, workers,
  batch driver host) every 100 ms, and every 20 ms how long each one's main thread -- a serving
  worker's event loop -- has waited for a CPU (schedstat).

Both probers record how long they themselves waited for a CPU during each probe or gap, and the
summary subtracts it (``*_ms``): what is left is the time the gateway (or the stand-in) took.
It also subtracts how long the serving worker's loop waited for a CPU in that span
(``*_net_ms``): what is left then is time the loop was running or blocked on its own -- what an
upload or a validation holding it would show -- not time a loaded machine kept it off the CPU.
A failure says who was slow: the gateway's own work, its CPU wait, or the prober.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent
PROBER = HERE.parent / "runtime" / "prober.py"
STREAM_PROBER = HERE / "stream_prober.py"
STREAM_INTERVAL = 0.02
MiB = 1024 * 1024


def write_requests_file(path: Path, lines: int, line_bytes: int, model: str) -> Path:
    """``lines`` chat requests of about ``line_bytes`` each (OpenAI's batch input format)."""
    with path.open("wb") as out:
        for i in range(lines):
            head = {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": model, "max_tokens": 16, "messages": [{"role": "user"}]},
            }
            pad = max(0, line_bytes - len(json.dumps(head)) - len(', "content": ""') - 1)
            head["body"]["messages"][0]["content"] = ("lorem ipsum " * (pad // 12 + 1))[:pad]
            out.write(json.dumps(head).encode() + b"\n")
    return path


def write_one_line_file(path: Path, size: int) -> Path:
    """One line of ``size`` bytes and no line end (JSON text that never closes), written in
    pieces so this process does not hold it either."""
    piece = b"x" * MiB
    with path.open("wb") as out:
        out.write(b'{"custom_id": "one", "body": "')
        left = size - 30
        while left > 0:
            out.write(piece[: min(left, MiB)])
            left -= MiB
    return path


def upload(base_url: str, key: str, path: Path, timeout: float = 600) -> httpx.Response:
    """``POST /v1/files`` with the file streamed from disk (httpx reads it in pieces)."""
    with path.open("rb") as handle:
        return httpx.post(
            base_url + "/v1/files",
            headers={"authorization": f"Bearer {key}"},
            data={"purpose": "batch"},
            files={"file": (path.name, handle, "application/jsonl")},
            timeout=timeout,
        )


def validate(base_url: str, key: str, file_id: str, timeout: float = 600) -> dict:
    """A batch on ``file_id``, waited for until its driver has read the file (its status is
    no longer ``validating``)."""
    auth = {"authorization": f"Bearer {key}"}
    created = httpx.post(
        base_url + "/v1/batches",
        headers=auth,
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        timeout=60,
    )
    created.raise_for_status()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = httpx.get(
            base_url + f"/v1/batches/{created.json()['id']}", headers=auth, timeout=60
        ).json()
        if batch["status"] != "validating":
            return batch
        time.sleep(0.25)
    raise AssertionError(f"batch {created.json()['id']} still validating after {timeout} s")


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _cpu_wait_ms(pid: int, thread: int | None = None) -> float:
    """How long ``pid``'s threads (or its ``thread``) have been runnable but not running
    (schedstat field 2)."""
    total = 0.0
    tasks = Path(f"/proc/{pid}/task")
    with contextlib.suppress(OSError):
        for task in [tasks / str(thread)] if thread else tasks.iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += int((task / "schedstat").read_text().split()[1]) / 1e6
    return total


def _serving(procs: list[psutil.Process]) -> list[int]:
    """The pids that answer requests: the workers, or the one process when there are none."""
    workers = [p.pid for p in procs if "--worker" in p.cmdline()]
    return workers or [procs[0].pid]


@dataclass
class Watching:
    port: int
    pid: int  # the gateway's (its process tree is sampled)
    key: str
    model: str
    out_dir: Path
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    models: list[dict] = field(default_factory=list)
    gaps: list[dict] = field(default_factory=list)
    prober_waits: dict[str, float] = field(default_factory=dict)
    stream_errors: list[dict] = field(default_factory=list)
    # (wall time, {serving pid: its main thread's CPU wait in ms}) every 20 ms
    loop_waits: list[tuple[float, dict[int, float]]] = field(default_factory=list)

    @contextlib.contextmanager
    def running(self) -> Iterator[Watching]:
        stop = threading.Event()
        sampler = threading.Thread(target=self._sample, args=(stop,), daemon=True)
        models_out, gaps_out = self.out_dir / "models.json", self.out_dir / "gaps.json"
        probers = [
            subprocess.Popen(
                [sys.executable, str(PROBER), "--port", str(self.port), "--paths", "/v1/models",
                 "--interval", "0.05", "--timeout", "10", "--out", str(models_out),
                 "--header", f"authorization: Bearer {self.key}"],
                stdin=subprocess.PIPE,
            ),
            subprocess.Popen(
                [sys.executable, str(STREAM_PROBER), "--port", str(self.port), "--key", self.key,
                 "--model", self.model, "--interval", str(STREAM_INTERVAL), "--out",
                 str(gaps_out)],
                stdin=subprocess.PIPE,
            ),
        ]  # fmt: skip
        sampler.start()
        try:
            yield self
        finally:
            stop.set()
            sampler.join()
            for proc in probers:
                assert proc.stdin is not None
                proc.stdin.close()
            for proc in probers:
                proc.wait(60)
            models = json.loads(models_out.read_text())
            gaps = json.loads(gaps_out.read_text())
            self.models, self.gaps = models["records"], gaps["records"]
            self.stream_errors = gaps["errors"]
            self.prober_waits = {
                "models": models["prober_run_delay_ms"],
                "stream": gaps["prober_run_delay_ms"],
            }

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.time()
        try:
            yield
        finally:
            self.phases[name] = (began, time.time())

    def _sample(self, stop: threading.Event) -> None:
        procs: list[psutil.Process] = []
        serving: list[int] = []
        looked = rss_at = 0.0
        while not stop.wait(0.02):
            now = time.time()
            with contextlib.suppress(psutil.Error):
                if now - looked >= 1.0:  # a restarted worker is a new process
                    procs, looked = _tree(self.pid), now
                    serving = _serving(procs)
                self.loop_waits.append((now, {pid: _cpu_wait_ms(pid, pid) for pid in serving}))
                if now - rss_at >= 0.1:
                    rss_at = now
                    self.samples.append(
                        {
                            "t": now,
                            "rss": {p.pid: p.memory_info().rss for p in procs},
                            "names": {p.pid: " ".join(p.cmdline()[2:5]) for p in procs},
                            "cpu_wait_ms": sum(_cpu_wait_ms(p.pid) for p in procs),
                        }
                    )

    def loop_wait_ms(self, start: float, end: float) -> float:
        """How long the serving loop waited for a CPU between ``start`` and ``end`` (wall
        times), from the samples around them (the least of the workers': which one served a
        probe is not known)."""
        times = [t for t, _ in self.loop_waits]
        i = max(0, bisect.bisect_right(times, start) - 1)
        j = min(len(times) - 1, bisect.bisect_left(times, end))
        if j <= i:
            return 0.0
        before, after = self.loop_waits[i][1], self.loop_waits[j][1]
        deltas = [after[pid] - before[pid] for pid in after if pid in before]
        return max(0.0, min(deltas)) if deltas else 0.0

    # ---- what it found -----------------------------------------------------------------------

    def _within(self, records: list[dict], names: tuple[str, ...]) -> list[dict]:
        spans = [self.phases[n] for n in names if n in self.phases]
        return [r for r in records if any(a <= r["t"] <= b for a, b in spans)]

    def summary(self, baseline: str, during: tuple[str, ...]) -> dict:
        """The probes' and samples' numbers in ``baseline`` and in the ``during`` phases."""
        base_rss = [sum(s["rss"].values()) for s in self._within(self.samples, (baseline,))]
        busy = self._within(self.samples, during)
        peak = max(busy, key=lambda s: sum(s["rss"].values()), default=None)
        models = self._within(self.models, during)
        base_gaps = self._within(self.gaps, (baseline,))
        gaps = self._within(self.gaps, during)

        def own(record: dict, key: str) -> float:
            return record.get(key, 0.0) - record.get("wait_ms", 0.0)

        def net(record: dict, key: str, ended: float) -> float:
            span = record[key] / 1000
            return own(record, key) - self.loop_wait_ms(ended - span, ended)

        model_own = [own(m, "total_ms") for m in models]
        model_net = [net(m, "total_ms", m["t"] + m.get("total_ms", 0) / 1000) for m in models]
        gap_own = [own(g, "gap_ms") for g in gaps]
        gap_net = [net(g, "gap_ms", g["t"]) for g in gaps]
        base_gap = statistics.median(own(g, "gap_ms") for g in base_gaps) if base_gaps else 0.0
        waits = [s["cpu_wait_ms"] for s in busy]
        return {
            "models_probes": len(models),
            "models_failed": [m for m in models if m.get("status") != 200],
            "models_max_ms": max(model_own, default=0.0),
            "models_max_net_ms": max(model_net, default=0.0),
            "models_p99_ms": _quantile(model_own, 0.99),
            "models_prober_wait_max_ms": max((m.get("wait_ms", 0.0) for m in models), default=0),
            "stream_events": len(gaps),
            "stream_baseline_gap_ms": base_gap,
            "stream_max_gap_ms": max(gap_own, default=0.0),
            "stream_max_gap_net_ms": max(gap_net, default=0.0),
            "stream_p99_gap_ms": _quantile(gap_own, 0.99),
            "stream_errors": self._within(self.stream_errors, during),
            "rss_baseline_mib": statistics.median(base_rss) / MiB if base_rss else 0.0,
            "rss_peak_mib": sum(peak["rss"].values()) / MiB if peak else 0.0,
            "rss_growth_mib": (
                (sum(peak["rss"].values()) - statistics.median(base_rss)) / MiB
                if peak and base_rss
                else 0.0
            ),
            "rss_peak_by_process_mib": {
                peak["names"].get(pid, str(pid)): round(rss / MiB, 1)
                for pid, rss in (peak["rss"].items() if peak else ())
            },
            "gateway_cpu_wait_ms": (waits[-1] - waits[0]) if len(waits) > 1 else 0.0,
            "phase_seconds": {n: round(b - a, 2) for n, (a, b) in self.phases.items()},
        }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

"""What a busy event loop does to a probe listener in the same process, and what a child process
avoids: the GIL, measured without an engine (so without the engine's CPU starvation).

The API process under load is one thread that holds the GIL nearly all the time (the event loop
turning engine outputs into responses). Here that is a CPU-bound Python thread; a separate
prober process asks /ready?strict=1 of

- ``thread``: control_listener.ControlListener in this process (the first design), and
- ``process``: control_listener.start(): the child process serving what this process publishes,

200 times each (5 ms apart), with and without the busy thread.

    .venv/bin/python bench/control_port_gil.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from llmendpoints_runtime import control_listener
from llmendpoints_runtime.health import Health

PROBER = """
import json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
times = []
for _ in range(n):
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET /ready?strict=1 HTTP/1.1\\r\\n\\r\\n")
        while conn.recv(65536):
            pass
    times.append((time.monotonic() - began) * 1000)
    time.sleep(0.005)
print(json.dumps(sorted(times)))
"""


def probe(port: int, n: int = 200) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBER, str(port), str(n)], capture_output=True, text=True
    )
    times = json.loads(out.stdout)
    return {
        "p50_ms": round(times[len(times) // 2], 2),
        "p99_ms": round(times[int(len(times) * 0.99) - 1], 2),
        "max_ms": round(times[-1], 2),
    }


def _spin(stop: threading.Event) -> None:
    """Holds the GIL but for the interpreter's switch intervals, as a busy event loop does."""
    while not stop.is_set():
        sum(range(1000))


def main() -> None:
    health = Health()
    health.engine_ready()
    surface = control_listener.ControlSurface(
        liveness=health.liveness,
        readiness=lambda strict: health.readiness(strict=strict),
        metrics=lambda: (b"x 1\n" * 2000, "text/plain"),
    )
    thread_listener = control_listener.ControlListener(surface, "127.0.0.1", 0).start()
    child = control_listener.start(surface, "127.0.0.1", 0)
    rows = []
    try:
        for busy in (False, True):
            stop = threading.Event()
            spinner = threading.Thread(target=_spin, args=(stop,))
            if busy:
                spinner.start()
            for name, port in (("thread", thread_listener.port), ("process", child.port)):
                rows.append({"listener": name, "busy_thread": busy, **probe(port)})
                print(json.dumps(rows[-1]), flush=True)
            stop.set()
            if busy:
                spinner.join()
    finally:
        thread_listener.close()
        child.close()
    print("\n| listener | a CPU-bound thread in the API process | p50 ms | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['listener']} | {'yes' if row['busy_thread'] else 'no'} | {row['p50_ms']} | "
            f"{row['p99_ms']} | {row['max_ms']} |"
        )


if __name__ == "__main__":
    main()

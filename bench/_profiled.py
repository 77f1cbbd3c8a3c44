"""Run a Python module under cProfile, profiling only while asked, on the process's CPU clock.

    python bench/_profiled.py OUT.prof -m llmendpoints_gateway serve

SIGUSR1 starts the profiler, SIGUSR2 stops it and writes the stats to OUT.prof (pstats format),
so a benchmark profiles its measured phase alone: no start-up imports, no warm-up. The clock is
``time.process_time`` (CPU time), not wall time: on a shared machine a function's wall time
includes the moments the process was not scheduled. Used by bench/gateway_streams.py
(``--profile``); files starting with "_" are not benchmarks of their own.
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
import time


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        sys.exit(__doc__)
    out, module = sys.argv[1], sys.argv[3]
    profiler = cProfile.Profile(time.process_time)

    def start(*_) -> None:
        profiler.enable()

    def stop(*_) -> None:
        profiler.disable()
        profiler.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""`make bench`: run the benchmark scripts in bench/, one subprocess each, and report.

    .venv/bin/python bench/run_all.py                      # every bench/*.py
    .venv/bin/python bench/run_all.py runtime_vs_vllm      # just these (with or without .py)
    .venv/bin/python bench/run_all.py --exclude operator_scale
    .venv/bin/python bench/run_all.py --list
    .venv/bin/python bench/run_all.py runtime_vs_vllm -- --rounds 2   # arguments for one script

Every script is a benchmark except this driver and files starting with "_" (helpers). Each runs
with this interpreter from the repository root; its output goes to the terminal and to
bench/out/<name>.log. A script that exits non-zero does not stop the others; the driver reports
it at the end and exits 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


@dataclass(frozen=True)
class Outcome:
    name: str
    returncode: int
    seconds: float


def discover(folder: Path) -> list[str]:
    """Benchmark names (file stems) in `folder`, sorted."""
    this = Path(__file__).name
    return sorted(
        p.stem for p in folder.glob("*.py") if p.name != this and not p.name.startswith("_")
    )


def select(available: list[str], wanted: list[str], excluded: list[str]) -> list[str]:
    """The benchmarks to run, in `available` order (pure). Raises ValueError for unknown names."""

    def stem(name: str) -> str:
        return Path(name).stem

    unknown = [n for n in [*wanted, *excluded] if stem(n) not in available]
    if unknown:
        raise ValueError(
            f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(available)}"
        )
    chosen = {stem(n) for n in wanted} or set(available)
    skipped = {stem(n) for n in excluded}
    return [n for n in available if n in chosen and n not in skipped]


def run(name: str, log_dir: Path, extra: list[str], folder: Path = BENCH) -> Outcome:
    """Run <folder>/<name>.py, copying its output to the terminal and to <log_dir>/<name>.log."""
    print(f"=== {' '.join([name, *extra])} ===", flush=True)
    started = time.monotonic()
    with (log_dir / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(folder / f"{name}.py"), *extra],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            log.write(line)
        returncode = process.wait()
    outcome = Outcome(name, returncode, time.monotonic() - started)
    state = "ok" if returncode == 0 else f"FAILED (exit {returncode})"
    print(f"=== {name}: {state} in {outcome.seconds:.0f} s ===\n", flush=True)
    return outcome


def report(outcomes: list[Outcome]) -> str:
    """One line per benchmark (pure)."""
    width = max(len(o.name) for o in outcomes)
    return "\n".join(
        f"{o.name:<{width}}  {'ok' if o.returncode == 0 else f'FAILED (exit {o.returncode})':<16}"
        f"{o.seconds:6.0f} s"
        for o in outcomes
    )


def main(argv: list[str] | None = None) -> int:
    available = discover(BENCH)
    parser = argparse.ArgumentParser(description="Run the benchmarks in bench/.")
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {available})")
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME")
    parser.add_argument("--list", action="store_true", help="print the benchmark names and exit")
    parser.add_argument("--out", type=Path, default=BENCH / "out", help="where the logs go")
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(available))
        return 0
    try:
        chosen = select(available, args.names, args.exclude)
    except ValueError as exc:
        parser.error(str(exc))
    if not chosen:
        parser.error("nothing to run")
    if extra and len(chosen) != 1:
        parser.error("arguments after -- go to one benchmark: name exactly one")
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = [run(name, args.out, extra) for name in chosen]
    print(report(outcomes))
    print(f"logs in {args.out}; record results in bench/RESULTS.md")
    failed = [o.name for o in outcomes if o.returncode != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

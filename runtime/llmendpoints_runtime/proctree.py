"""The runtime's child processes, and stopping all of them (Linux, from /proc).

vLLM runs its engine core in a child process, which may start workers of its own (tensor
parallelism) and torch's compile workers. When the runtime stops -- above all when it stops while
the model is still loading, before vLLM has a client that knows how to shut them down -- every one
of them must stop too: an orphan keeps its GPU memory and its CPU, and the next pod cannot start.

A process is known by its pid and its start time together, so a pid reused by an unrelated process
after ours exited is never signalled. Descendants are collected before any is signalled: once a
parent dies, its children are re-parented to init and can no longer be found from us.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

_PROC = "/proc"


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks since boot (field 22 of /proc/<pid>/stat)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of ``pid``, or None when it is gone."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as handle:
            raw = handle.read().decode("latin-1")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def children_map() -> dict[int, list[Proc]]:
    """ppid -> its live child processes, for the whole system (one pass over /proc)."""
    tree: dict[int, list[Proc]] = {}
    try:
        names = os.listdir(_PROC)
    except OSError:
        return tree
    for name in names:
        if not name.isdigit():
            continue
        stat = _stat(int(name))
        if stat is None or stat[0] in ("Z", "X"):
            continue
        tree.setdefault(stat[1], []).append(Proc(int(name), stat[2]))
    return tree


def descendants(pid: int | None = None) -> list[Proc]:
    """Every live descendant of ``pid`` (default: this process), parents before children."""
    root = os.getpid() if pid is None else pid
    tree = children_map()
    found: list[Proc] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop(0)
        for child in tree.get(parent, ()):
            found.append(child)
            frontier.append(child.pid)
    return found


def _is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker: it ignores SIGTERM, exits by itself when this process
    does (its pipe closes), and is relaunched -- with warnings -- if killed before."""
    try:
        with open(f"{_PROC}/{pid}/cmdline", "rb") as handle:
            return b"multiprocessing.resource_tracker" in handle.read()
    except OSError:
        return False


def alive(proc: Proc) -> bool:
    stat = _stat(proc.pid)
    return stat is not None and stat[0] not in ("Z", "X") and stat[2] == proc.start


def ignores_sigterm(pid: int) -> bool:
    """The process ignores SIGTERM (multiprocessing's resource tracker does): only SIGKILL ends
    it, so waiting for it to stop would only spend the grace period."""
    try:
        with open(f"{_PROC}/{pid}/status", encoding="latin-1") as handle:
            for line in handle:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _signal(procs: Iterable[Proc], sig: int) -> None:
    for proc in procs:
        if alive(proc):
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to signal
                os.kill(proc.pid, sig)


_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make orphaned descendants this process's children instead of init's (Linux prctl).

    vLLM's workers are the engine core's children: if the engine core dies first, they would be
    re-parented out of our reach. As a subreaper we keep them as descendants, so shutdown still
    stops them. False where the kernel does not offer it (nothing else changes then)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """``sig`` to this process when its parent ``parent`` dies, however it dies (Linux prctl);
    False when the parent is gone already (the caller should end)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    return os.getppid() == parent


def terminate_descendants(
    grace: float = 3.0, *, root: int | None = None, poll: float = 0.05
) -> int:
    """SIGTERM every descendant of ``root`` (default: this process), SIGKILL what is left after
    ``grace`` seconds.

    Processes that appear meanwhile (a worker started just now) are caught by re-scanning; those
    that ignore SIGTERM get SIGKILL at once. Blocks
    for at most about ``grace`` seconds plus a moment for SIGKILL to land; returns how many
    processes were signalled. Zombies (dead children not yet reaped) count as gone.
    """
    seen: dict[int, Proc] = {}

    def scan() -> list[Proc]:
        new = [
            p
            for p in descendants(root)
            if (p.pid not in seen or seen[p.pid] != p) and not _is_resource_tracker(p.pid)
        ]
        for proc in new:
            seen[proc.pid] = proc
        _signal([p for p in new if ignores_sigterm(p.pid)], signal.SIGKILL)
        return new

    _signal(scan(), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _signal(scan(), signal.SIGTERM)
        if not any(alive(p) for p in seen.values()):
            return len(seen)
        time.sleep(poll)
    scan()
    _signal(seen.values(), signal.SIGKILL)
    # SIGKILL cannot be caught; give the kernel a moment to take them down.
    until = time.monotonic() + 1.0
    while time.monotonic() < until and any(alive(p) for p in seen.values()):
        time.sleep(poll)
    return len(seen)

"""The runtime's processes as the kernel sees them (/proc): its engine core, its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from llmendpoints_runtime.proctree import descendants


def _read(pid: int, name: str) -> str:
    try:
        return (Path("/proc") / str(pid) / name).read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rss_mib(pid: int) -> float:
    """Resident memory of one process, MiB."""
    for line in _read(pid, "status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads) so far."""
    fields = _read(pid, "stat").rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_core_pids(runtime_pid: int) -> list[int]:
    """vLLM's engine-core processes under the runtime (vLLM titles them VLLM::EngineCore)."""
    return [
        p.pid
        for p in descendants(runtime_pid)
        if "EngineCore" in _read(p.pid, "cmdline") or "EngineCor" in _read(p.pid, "comm")
    ]


def api_process_pids(pgid: int) -> list[int]:
    """The API processes of a pod (API_SERVER_COUNT > 1) whose process group is ``pgid``."""
    return [p for p in group_members(pgid) if "APIServer" in _read(p, "cmdline")]


def listening_unix_paths(pid: int) -> list[str]:
    """The filesystem paths of the Unix sockets ``pid`` listens on (abstract ones left out)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    paths = []
    # /proc/net/unix: Num RefCount Protocol Flags Type St Inode [Path]; Flags 00010000 is
    # __SO_ACCEPTCON, a listening socket.
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        listening = len(fields) == 8 and fields[3] == "00010000" and fields[6] in inodes
        if listening and not fields[7].startswith("@"):
            paths.append(fields[7])
    return paths


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(int(name), "stat")
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] not in ("Z", "X") and fields[2] == str(pgid):
            members.append(int(name))
    return members


def wait_until(condition, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout} s")


def stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in the stopped state: a SIGSTOP has taken effect. On a loaded
    machine it takes a while (each thread stops when it next gets a CPU), and until then a
    thread of the "frozen" process can still answer."""
    states = [_read_state(task) for task in (Path("/proc") / str(pid) / "task").glob("*")]
    return bool(states) and all(state == "T" for state in states)


def _read_state(task: Path) -> str:
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return "T"  # a thread that ended answers nothing either
    return stat[stat.rfind(")") + 2 :].split(maxsplit=1)[0]


@contextlib.contextmanager
def engines_frozen(*runtime_pids: int) -> Iterator[list[int]]:
    """Stop the runtimes' engine cores (SIGSTOP) for the block, then let them go on.

    Work sent to a frozen engine stays running (the API process counts it, nothing finishes):
    the demo model would otherwise end a job before a test sees it running -- and on these
    machines a process can be held off its CPU for seconds.
    """
    pids = [pid for runtime_pid in runtime_pids for pid in engine_core_pids(runtime_pid)]
    assert pids, "no engine core found"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def run_in_slices(
    pids: list[int], until: Callable[[], bool], *, slice_seconds: float = 0.05, settle: float = 0.3
) -> float:
    """Let frozen engine cores run ``slice_seconds`` at a time, frozen again after each (and
    ``settle`` seconds for their API processes to pass on what they sent), until ``until()``.
    Returns the longest slice, as run.

    A test that lets an engine go at once and watches for a moment to stop it again races it:
    the demo model ends a request in a second or two, and on a loaded machine the watcher can
    be held off its CPU for longer. In slices, it sees the moment with the engine stopped. The
    engines' sessions are niced meanwhile: a spinning engine core would otherwise hold this
    process off its CPU when it should stop it, and one such slice can run a whole request."""
    deadline = time.monotonic() + 120
    longest = 0.0
    with contextlib.ExitStack() as niced:
        for pid in pids:
            if os.getsid(pid) != os.getsid(0):  # never this process's own session
                niced.enter_context(session_niced(pid))
        while not until():
            assert time.monotonic() < deadline, "not within 120 s of engine slices"
            began = time.monotonic()
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            time.sleep(slice_seconds)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            longest = max(longest, time.monotonic() - began)
            time.sleep(settle)
    return longest


@contextlib.contextmanager
def session_niced(pid: int, nice: int = 19) -> Iterator[None]:
    """Give the session of ``pid`` (a runtime started in a session of its own: its API process,
    engine core and worker) the CPU only when nothing else wants it, for the block.

    The kernel shares CPU time between sessions (autogroups), so renicing the engine's threads
    does little (bench/RESULTS.md, "Probes under load"): the session's own nice is what counts.
    A test whose operator and cluster emulator must keep up with a loaded pod on these two cores
    stands in for a cluster, where they run on other machines."""
    path = Path("/proc") / str(pid) / "autogroup"
    before = path.read_text().split("nice")[-1].strip()
    with contextlib.suppress(OSError):  # without autogroups or the right: as it is
        path.write_text(str(nice))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.write_text(before)

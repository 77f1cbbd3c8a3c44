"""The runtime's processes as the kernel sees them (/proc): its engine core, its process group."""

from __future__ import annotations

import os
import time
from pathlib import Path

from llmendpoints_runtime.proctree import descendants


def _read(pid: int, name: str) -> str:
    try:
        return (Path("/proc") / str(pid) / name).read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def engine_core_pids(runtime_pid: int) -> list[int]:
    """vLLM's engine-core processes under the runtime (vLLM titles them VLLM::EngineCore)."""
    return [
        p.pid
        for p in descendants(runtime_pid)
        if "EngineCore" in _read(p.pid, "cmdline") or "EngineCor" in _read(p.pid, "comm")
    ]


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

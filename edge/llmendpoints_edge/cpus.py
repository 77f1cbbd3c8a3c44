"""How many CPUs a pod may use: what both front doors size their process counts by (the
gateway's GATEWAY_WORKERS=0, the runtime's API_SERVER_COUNT default)."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path


def pod_cpus() -> int:
    """The CPUs this process may use: its cgroup's CPU limit (rounded up) when it has one,
    else the CPUs it may run on."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
    with contextlib.suppress(OSError, ValueError):
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota_us > 0:
            return max(1, math.ceil(quota_us / period_us))
    return max(1, len(os.sched_getaffinity(0)))

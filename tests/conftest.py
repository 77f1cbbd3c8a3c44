"""The test tree's shared kits, importable from every folder (and from bench/, which puts the
same two folders on its path): ``ports``, ``integration.nats_kit`` (the one nats-server
launcher) and ``gateway.harness`` from tests/; ``runtime_process`` (the one runtime launcher),
``proc_kit`` and ``held_stream`` from tests/runtime, which is not a package."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS, _TESTS / "runtime"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

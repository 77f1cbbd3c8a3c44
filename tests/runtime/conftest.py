"""Fixtures that run the real runtime on the demo model (the launcher is runtime_process.py,
which test modules import by that name: a module named ``conftest`` is not theirs to import).

An engine takes ~25 s to start on two cores, so each test module shares one server (a
module-scoped fixture) and only modules that need a different configuration start their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_process import RuntimeServer, running_runtime


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    from llmendpoints_runtime.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="module")
def runtime_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runtime-logs")


@pytest.fixture(scope="module")
def runtime(demo_model, runtime_logs) -> Iterator[RuntimeServer]:
    """One open (no API keys) runtime with default settings, shared by a test module."""
    with running_runtime(demo_model, runtime_logs) as server:
        yield server

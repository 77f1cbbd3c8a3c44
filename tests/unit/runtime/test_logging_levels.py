"""Our log lines survive what libraries do to the root logger.

vLLM's app imports model_hosting_container_standards, which sets the root logger to ERROR at
import time; the job API's failed webhook attempts (logger ``llmendpoints_common.webhooks``, a
warning) then vanished from a real runtime's log (tests/runtime/test_runtime_logs.py shows it
end to end).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
from llmendpoints_runtime import logs


@pytest.fixture
def configured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    names = (*logs.OWN_LOGGERS, "uvicorn", "uvicorn.error", "uvicorn.access")
    levels = {name: logging.getLogger(name).level for name in names}
    logs.configure("text", "info")
    out = io.StringIO()
    root.handlers[0].setStream(out)  # the handler configure made, writing here, not to stdout
    try:
        yield out
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize(
    "name",
    [
        "llmendpoints_common.webhooks",
        "llmendpoints_common.queue.worker",
        "llmendpoints_runtime.jobs.executor",
        "llmendpoints.app",
    ],
)
def test_our_module_loggers_keep_their_level_when_a_library_raises_the_roots(configured, name):
    logging.getLogger().setLevel(logging.ERROR)  # what the SageMaker package does at import
    logging.getLogger(name).warning("webhook for job %s: attempt 1/3 failed: HTTP 500", "j1")
    logging.getLogger(name).info("an info line")
    out = configured.getvalue()
    assert f"WARNING {name} [-] webhook for job j1: attempt 1/3 failed: HTTP 500" in out
    assert f"INFO {name} [-] an info line" in out


def test_the_engine_puts_the_roots_level_back_after_building_vllms_app(configured):
    from llmendpoints_runtime.engine.serving import _root_log_level_kept

    root = logging.getLogger()
    assert root.level == logging.WARNING
    with _root_log_level_kept():
        root.setLevel(logging.ERROR)
    assert root.level == logging.WARNING


def test_importing_the_sagemaker_package_really_does_raise_the_roots_level(configured):
    """The reason for the two guards above; fails (and they can go) once the package stops."""
    import importlib
    import sys

    sys.modules.pop("model_hosting_container_standards.logging_config", None)
    importlib.import_module("model_hosting_container_standards.logging_config")
    assert logging.getLogger().level == logging.ERROR

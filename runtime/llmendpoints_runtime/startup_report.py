"""What vLLM's engine processes say about the start-up, brought back to the runtime's /metrics.

The model is compiled in vLLM's worker process, which tells nobody but its log how long that
took. So our vLLM plugin (vllm_plugin.py, run in every vLLM process) puts an observing filter on
the loggers that report it, and the filter appends what they said, as JSON lines, to the file
named by ``LLMEP_STARTUP_REPORT`` (set by the runtime for its own engine processes). Once the
engine is ready the runtime reads the file:

* ``compile``: vLLM's own figure where it reports one (``init engine ... (compilation: X s)``,
  the GPU path); on the CPU build, which reports none, the span of the worker's "Warming up
  model for the compilation" -- the compile (or the load of a compiled artifact) and one
  forward pass;
* whether the compiled model came from the compile cache (``Directly load AOT compilation``)
  or was compiled (``saved AOT compiled function``), and a failed load of a cached one.

The message templates are vLLM 0.32's; tests/contract/test_vllm_log_templates.py checks they
are still in the installed vLLM, so an upgrade that changes them is noticed (the phase would
only go missing: nothing here can fail a start-up).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "LLMEP_STARTUP_REPORT"

# logger -> (message template prefix, event): what each record we watch means.
WATCHED: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm.v1.worker.cpu_model_runner": (
        ("Warming up model for the compilation", "compile_begin"),
        ("Warming up done", "compile_end"),
    ),
    "vllm.compilation.decorators": (
        ("%sDirectly load AOT compilation", "cache_hit"),
        ("%ssaved AOT compiled function", "compiled"),
        ("%sCompiling model again due to a load failure", "cache_load_failed"),
    ),
    "vllm.v1.engine.core": (("init engine (profile, create kv cache, warmup model) took", "init"),),
}


def interpret(logger: str, template: Any, args: Any, created: float) -> dict[str, Any] | None:
    """One log record -> the event it reports, or None (pure)."""
    for prefix, event in WATCHED.get(logger, ()):
        if isinstance(template, str) and template.startswith(prefix):
            out: dict[str, Any] = {"event": event, "at": created}
            if event == "init" and "compilation:" in template and isinstance(args, tuple):
                out["compile_seconds"] = float(args[1])
            return out
    return None


@dataclass(frozen=True)
class StartupReport:
    compile_seconds: float | None = None
    # "cache": loaded from the compile cache; "compiled"; "reload_failed": a cached artifact
    # would not load and the model was compiled again; None: vLLM said nothing (no compile).
    compile_source: str | None = None


def summarize(events: list[dict[str, Any]]) -> StartupReport:
    """The events of one start-up -> its report (pure)."""
    seconds = next((e["compile_seconds"] for e in events if "compile_seconds" in e), None)
    if seconds is None:
        begins = [e["at"] for e in events if e["event"] == "compile_begin"]
        ends = [e["at"] for e in events if e["event"] == "compile_end"]
        if begins and ends and max(ends) >= min(begins):
            seconds = max(ends) - min(begins)
    kinds = {e["event"] for e in events}
    source = None
    if "cache_load_failed" in kinds:
        source = "reload_failed"
    elif "cache_hit" in kinds:
        source = "cache"
    elif "compiled" in kinds:
        source = "compiled"
    return StartupReport(seconds, source)


# --- in vLLM's processes (the plugin) --------------------------------------------------------


class _Observer(logging.Filter):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        event = interpret(record.name, record.msg, record.args, record.created)
        if event is not None:
            try:  # one short append per event: O_APPEND keeps concurrent writers' lines whole
                with open(self.path, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(event) + "\n")
            except OSError:
                pass  # a report only: never in the way of the start-up
        return True


def observe_vllm_logs(env: dict[str, str] | os._Environ = os.environ) -> None:
    """Watch the loggers in WATCHED (this process: one of vLLM's); nothing without ENV."""
    path = env.get(ENV)
    if not path:
        return
    for name in WATCHED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Observer) for f in logger.filters):
            logger.addFilter(_Observer(path))


# --- in the runtime's process -----------------------------------------------------------------


def prepare(env: dict[str, str] | os._Environ) -> str:
    """Name this process's report file in ``env`` (before vLLM's processes start)."""
    handle, path = tempfile.mkstemp(prefix="llmep-startup-", suffix=".jsonl")
    os.close(handle)
    env[ENV] = path
    return path


def read(path: str | None) -> StartupReport:
    if not path:
        return StartupReport()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return StartupReport()
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return summarize(events)


def discard(path: str | None) -> None:
    """The report has been read (once the engine is ready): its file goes."""
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), or None."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))

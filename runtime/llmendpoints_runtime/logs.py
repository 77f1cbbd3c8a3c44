"""Logging: text or JSON lines (LOG_FORMAT), with the request id on every line of a request.

Client text (paths, job ids, query strings in uvicorn's access log) reaches log lines only as
arguments of a message, never as its format; in text lines every argument is escaped (control
characters, quotes, backslashes), so no client can break a line or forge one. JSON lines are
escaped by JSON itself. Request ids are safe by construction (llmendpoints_common.request_ids).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import time

from llmendpoints_runtime.middleware import request_id_var


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id and request_id != "-":
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"

_UNSAFE = re.compile(r'[\x00-\x1f\x7f-\x9f"\\\u2028\u2029]')
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\\": "\\\\"}


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    return _ESCAPES.get(char) or f"\\u{ord(char):04x}"


def escape_log_text(text: str) -> str:
    """``text`` safe inside one line and inside double quotes (pure)."""
    return _UNSAFE.sub(_escape_char, text)


def _escaped(value: object) -> object:
    if isinstance(value, str):
        return escape_log_text(value)
    return value


class TextFormatter(logging.Formatter):
    """The text format, with every string argument of a message escaped."""

    def format(self, record: logging.LogRecord) -> str:
        args = record.args
        if isinstance(args, tuple) and args:
            record.args = tuple(_escaped(arg) for arg in args)
        elif isinstance(args, dict) and args:
            record.args = {key: _escaped(value) for key, value in args.items()}
        try:
            return super().format(record)
        finally:
            record.args = args


# Our loggers by the roots of their names: "llmendpoints.*" ones, and the module loggers
# (``getLogger(__name__)``) of our packages. Each gets the level itself rather than inheriting
# the root logger's: a library may change that (vLLM's app imports model_hosting_container_
# standards, which sets the root logger to ERROR at import), and our warnings must not vanish.
OWN_LOGGERS = ("llmendpoints", "llmendpoints_common", "llmendpoints_runtime", "llmendpoints_edge")


def configure(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in (*OWN_LOGGERS, "uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def prepare_vllm_logging(log_format: str) -> None:
    """In JSON mode, make vLLM (in this process and its engine processes) log JSON lines too.

    vLLM reads VLLM_LOGGING_CONFIG_PATH when it is first imported, in every process, so this
    must run before anything imports vllm. A user's own VLLM_LOGGING_CONFIG_PATH wins.
    """
    if log_format != "json" or os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "llmendpoints_runtime.logs.JsonFormatter"}},
        "handlers": {
            "stdout": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {"vllm": {"handlers": ["stdout"], "level": "INFO", "propagate": False}},
    }
    with tempfile.NamedTemporaryFile(
        "w", prefix="llmep-vllm-logging-", suffix=".json", delete=False
    ) as handle:
        json.dump(config, handle)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = handle.name

"""Log lines: text or JSON (LOG_FORMAT), the request id on every line of a request, nothing lost.

Client text (paths, job ids, query strings, model names) reaches a line only as an argument of
a message or as a field, never as its format; in text lines every argument and field is escaped
(control characters, quotes, backslashes), so no client can break a line or forge one. JSON
lines are escaped by JSON itself. Request ids are safe by construction
(``llmendpoints_common.request_ids``).

stdout is line-buffered whatever it is (a pipe, a file): a process that ends with ``os._exit``
(the runtime does, to skip torch's teardown) or is killed loses no line it logged.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)

# Fields a record may carry (``extra=``): the access line's, in this order.
FIELDS = (
    "request_id",
    "method",
    "path",
    "status",
    "endpoint",
    "model",
    "replica",
    "routing",
    "key",
    "duration_ms",
)

# Loggers whose level LLMEP_LOG_LEVEL sets; every other library logs warnings and above.
# Module loggers of the shared packages are named after their modules (llmendpoints_common...).
OWN_LOGGERS = (
    "llmendpoints",
    "llmendpoints_common",
    "llmendpoints_edge",
    "llmendpoints_runtime",
    "llmendpoints_gateway",
    "uvicorn",
    "uvicorn.error",
    "uvicorn.access",
)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get() or "-"
        return True


def _timestamp(record: logging.LogRecord) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z"
    )


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is None and name == "request_id":
                value = request_id_var.get()
            if value is not None and value != "-":
                entry[name] = value
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
    """The text format, every string argument escaped, fields appended as ``name=value``."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def format(self, record: logging.LogRecord) -> str:
        args = record.args
        if isinstance(args, tuple) and args:
            record.args = tuple(_escaped(arg) for arg in args)
        elif isinstance(args, dict) and args:
            record.args = {key: _escaped(value) for key, value in args.items()}
        try:
            line = super().format(record)
        finally:
            record.args = args
        extra = [
            f"{name}={_field_text(value)}"
            for name in FIELDS[1:]
            if (value := getattr(record, name, None)) is not None
        ]
        return f"{line} {' '.join(extra)}" if extra else line


def _field_text(value: object) -> str:
    if isinstance(value, str):
        text = escape_log_text(value)
        return f'"{text}"' if (" " in text or not text) else text
    return str(value)


def configure(log_format: str, level: str) -> None:
    """One handler on the root logger, writing ``log_format`` lines to a line-buffered stdout;
    our loggers (and uvicorn's) at ``level``, everything else at WARNING."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(line_buffering=True)
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True

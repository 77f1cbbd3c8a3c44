"""Logging: the edge's formats (``llmendpoints_edge.logs``: text with every client-supplied
value escaped, or JSON lines; the request id on every line of a request), and vLLM's own lines
in the same format, in every process vLLM starts.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

from llmendpoints_edge.logs import OWN_LOGGERS, TEXT_FORMAT, JsonFormatter, TextFormatter, configure

__all__ = ["OWN_LOGGERS", "configure", "configure_api_process", "prepare_vllm_logging"]


class _ProcessJsonFormatter(JsonFormatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = json.loads(super().format(record))
        entry["process"] = record.processName
        return json.dumps(entry, ensure_ascii=False)


def configure_api_process(log_format: str, level: str) -> None:
    """The edge's logging, each line naming the API process that wrote it (vLLM names them
    ``ApiServer_<i>``): in a pod of several, which one served a request."""
    configure(log_format, level)
    handler = logging.getLogger().handlers[0]
    if log_format == "json":
        handler.setFormatter(_ProcessJsonFormatter())
    else:
        handler.setFormatter(
            TextFormatter(TEXT_FORMAT.replace("%(name)s", "%(name)s %(processName)s"))
        )


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
        "formatters": {"json": {"()": "llmendpoints_edge.logs.JsonFormatter"}},
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

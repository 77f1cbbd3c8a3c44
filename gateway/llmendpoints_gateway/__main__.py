"""CLI: ``llmendpoints-gateway serve`` (also ``python -m llmendpoints_gateway serve``), and
``llmendpoints-gateway usage --since T [--until T] [--format csv|json]``: the usage records in
the shared queue (JOBS_QUEUE_URL), one row per key, endpoint and model, for chargeback.

Settings come from the environment (see config.py and docs/gateway.md; `serve --help` lists
them). A bad one stops either subcommand with exit status 2 and the variable's name."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import UTC, datetime

from llmendpoints_common.settings_doc import help_text, setting_rows
from llmendpoints_edge.logs import configure
from pydantic import ValidationError

from llmendpoints_gateway import __version__
from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.metering import summarize, usage_csv
from llmendpoints_gateway.workers import (
    Supervisor,
    WorkerSlot,
    die_with_supervisor,
    wants_batch_host,
    worker_count,
)

# server.py (the whole gateway: discovery, NATS, the Kubernetes client) and usage.py are imported
# where they are used: a supervisor of worker processes runs none of it (~100 MB less).


def _settings_help() -> str:
    return 'settings (environment variables; table in docs/gateway.md, "Settings"):\n' + (
        help_text(setting_rows(GatewaySettings))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmendpoints-gateway",
        description="The front door across LLM endpoints: routes OpenAI requests by model, "
        "keeps prefix caches warm, holds requests while an endpoint starts.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command")
    serve_cmd = commands.add_parser(
        "serve",
        help="run the gateway (settings from the environment)",
        description="Run the gateway. Configuration comes from the environment.",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # A worker of several, or the pod's batch driver host, as the supervisor starts them
    # (workers.py).
    for option in (
        "--worker", "--listen-fd", "--metrics-fd", "--supervisor-pid", "--drain-fd",
        "--board-fd", "--wake-fd",
    ):  # fmt: skip
        serve_cmd.add_argument(option, help=argparse.SUPPRESS)
    serve_cmd.add_argument("--batch-drivers", action="store_true", help=argparse.SUPPRESS)
    usage = commands.add_parser(
        "usage",
        help="export usage per key, endpoint and model from the shared queue (JOBS_QUEUE_URL)",
    )
    usage.add_argument(
        "--since", required=True, type=_when, help="ISO 8601 time, e.g. 2026-11-23T04:00:00Z"
    )
    usage.add_argument("--until", type=_when, help="ISO 8601 time (default: now)")
    usage.add_argument("--format", choices=("csv", "json"), default="csv")
    args = parser.parse_args(argv)
    if args.command == "usage":
        return _usage(args.since, args.until, args.format)
    if args.command not in (None, "serve"):
        parser.error(f"unknown command {args.command}")

    try:
        settings = GatewaySettings()
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"])
            print(f"llmendpoints-gateway: {where}: {error['msg']}", file=sys.stderr)
        return 2
    configure(settings.log_format, settings.log_level)
    return _serve(args, settings)


def _serve(args: argparse.Namespace, settings: GatewaySettings) -> int:
    """This process's part of the pod: the batch driver host, a worker of several, the
    supervisor of them, or the one process that serves."""
    if getattr(args, "batch_drivers", False):
        die_with_supervisor(int(args.supervisor_pid))
        from llmendpoints_gateway.server import serve_batch_host

        return serve_batch_host(settings)
    worker = None
    if getattr(args, "worker", None):
        index, _, count = args.worker.partition("/")
        worker = WorkerSlot(
            int(index), int(count), int(args.listen_fd), int(args.metrics_fd),
            int(args.supervisor_pid), int(args.drain_fd),
            int(args.board_fd or -1), int(args.wake_fd or -1),
        )  # fmt: skip
        die_with_supervisor(worker.supervisor_pid)
    elif (count := worker_count(settings)) > 1 or wants_batch_host(settings):
        return Supervisor(settings, count, batch_host=wants_batch_host(settings)).run()
    from llmendpoints_gateway.server import serve

    serve(settings, worker)
    return 0


def _when(text: str) -> float:
    """An ISO 8601 time as epoch seconds; a time without a zone is UTC."""
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO 8601 time (e.g. 2026-11-23T04:00:00Z)"
        ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def _usage(since: float, until: float | None, fmt: str) -> int:
    url = os.environ.get("JOBS_QUEUE_URL", "").strip()
    if not url:
        print("llmendpoints-gateway usage: JOBS_QUEUE_URL: is not set", file=sys.stderr)
        return 2
    if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
        print(
            "llmendpoints-gateway usage: JOBS_QUEUE_URL: expected a NATS URL "
            "(nats://host:4222, tls://..., ws://...)",
            file=sys.stderr,
        )
        return 2
    if until is not None and until <= since:
        print("llmendpoints-gateway usage: --until must be after --since", file=sys.stderr)
        return 2
    from llmendpoints_gateway.usage import read_usage

    try:
        records = asyncio.run(
            read_usage(url, since, until, os.environ.get("JOBS_QUEUE_CREDS_FILE") or None)
        )
    except Exception as exc:
        detail = str(exc) or type(exc).__name__
        print(
            f"llmendpoints-gateway usage: cannot read usage records from JOBS_QUEUE_URL: {detail}",
            file=sys.stderr,
        )
        return 1
    rows = summarize(records)
    if fmt == "json":
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(usage_csv(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

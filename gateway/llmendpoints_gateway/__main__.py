"""CLI: ``llmendpoints-gateway serve`` (also ``python -m llmendpoints_gateway serve``).

Settings come from the environment (see config.py and docs/gateway.md)."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmendpoints-gateway",
        description="The front door across LLM endpoints: routes OpenAI requests by model, "
        "keeps prefix caches warm, holds requests while an endpoint starts.",
    )
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("serve", help="run the gateway (settings from the environment)")
    args = parser.parse_args(argv)
    if args.command not in (None, "serve"):
        parser.error(f"unknown command {args.command}")

    from llmendpoints_gateway.config import GatewaySettings
    from llmendpoints_gateway.logs import configure

    try:
        settings = GatewaySettings()
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"])
            print(f"llmendpoints-gateway: {where}: {error['msg']}", file=sys.stderr)
        return 2
    configure(settings.log_format, settings.log_level)

    from llmendpoints_gateway.server import serve

    serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())

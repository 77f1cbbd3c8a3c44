"""`llmendpoints-operator` CLI: runs the kopf operator for LLMEndpoint resources.

    llmendpoints-operator run [--standalone] [-A|--all-namespaces] [-n NS ...]
                              [--liveness URL] [--verbose]
    llmendpoints-operator --version

Credentials come from KUBECONFIG when it is set, else from the in-cluster service account.
Operator settings come from LLMEP_OPERATOR_* variables (see config.py and docs/operator.md;
`run --help` lists them). A bad setting, or an explicit KUBECONFIG that cannot be read, stops
the process at once with exit status 2 and the variable's name (kopf itself would retry its
login forever).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys

from pydantic import ValidationError

from llmendpoints_operator import __version__


def _settings_help() -> str:
    from llmendpoints_common.settings_doc import help_text, setting_rows

    from llmendpoints_operator.config import OperatorSettings

    return (
        'settings (environment variables; table in docs/operator.md, "Operator settings"):\n'
        + help_text(setting_rows(OperatorSettings))
        + "\n\ncredentials: KUBECONFIG when set, else the pod's ServiceAccount."
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmendpoints-operator",
        description="Reconcile LLMEndpoint resources into vLLM serving workloads.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run the operator until interrupted",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    scope = run.add_mutually_exclusive_group()
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="serve LLMEndpoints in every namespace (the default when no -n is given)",
    )
    scope.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        metavar="NS",
        help="serve only this namespace (repeatable; glob patterns such as 'team-*' work)",
    )
    run.add_argument(
        "--standalone",
        action="store_true",
        help="do not coordinate with other operator replicas (kopf peering); use with one replica",
    )
    run.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8081/healthz",
    )
    run.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    # Settings are validated before anything starts: a bad LLMEP_OPERATOR_* value names itself.
    from llmendpoints_operator.config import OperatorSettings

    try:
        settings = OperatorSettings()
    except ValidationError as exc:
        first = exc.errors()[0]
        variable = "LLMEP_OPERATOR_" + "_".join(str(p) for p in first["loc"]).upper()
        print(f"llmendpoints-operator: {variable}: {first['msg']}", file=sys.stderr)
        return 2
    from llmendpoints_operator.kubeconfig import kubeconfig_problem

    problem = kubeconfig_problem(os.environ.get("KUBECONFIG"))
    if problem is not None:
        print(f"llmendpoints-operator: KUBECONFIG: {problem}", file=sys.stderr)
        return 2

    import kopf
    import prometheus_client

    kopf.configure(verbose=args.verbose, log_prefix=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # Registers the handlers with kopf's default registry.
    import llmendpoints_operator.handlers  # noqa: F401

    if settings.metrics_port:
        prometheus_client.start_http_server(settings.metrics_port)
    clusterwide = args.all_namespaces or not args.namespaces
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        kopf.run(
            standalone=args.standalone,
            clusterwide=clusterwide,
            namespaces=args.namespaces,
            liveness_endpoint=args.liveness,
            # What the startup handler builds the operator's state from (handlers.start).
            memo=kopf.Memo(settings=settings, registry=prometheus_client.REGISTRY),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

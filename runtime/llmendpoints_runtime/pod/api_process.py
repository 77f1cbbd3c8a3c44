"""One API process of a pod with several: the runtime's whole app on the pod's listening socket,
a client of the engine its supervisor started.

Spawned by vLLM's ``APIServerProcessManager`` (engine/launch.py) with the listening socket,
vLLM's parsed arguments and this process's ``client_config``; the supervisor binds the rest
(``functools.partial``): the runtime's configuration, the pod's board, its private directory
and secret. It serves until SIGTERM (the supervisor passes the pod's on) and exits 1 when its
engine died, as a single runtime does.
"""

from __future__ import annotations

import logging
import os
import socket
from argparse import Namespace
from pathlib import Path
from typing import Any

from llmendpoints_runtime import logs
from llmendpoints_runtime.compose import build_runtime, create_app
from llmendpoints_runtime.config import RuntimeConfig
from llmendpoints_runtime.engine import EngineLink
from llmendpoints_runtime.engine.launch import name_api_process
from llmendpoints_runtime.health import EngineState
from llmendpoints_runtime.pod.board import PodBoard, PodSeat
from llmendpoints_runtime.pod.forward import http_socket_path
from llmendpoints_runtime.server import serve

logger = logging.getLogger("llmendpoints.pod")


def api_process_main(
    config: RuntimeConfig,
    supervisor: int,
    board: PodBoard,
    directory: Path,
    token: str,
    _listen_address: str,
    sock: socket.socket,
    _args: Namespace,
    client_config: dict[str, Any],
) -> None:
    settings = config.settings
    logs.configure_api_process(settings.log_format, settings.log_level)
    index, count = int(client_config["client_index"]), int(client_config["client_count"])
    name_api_process(index)
    # vLLM's own API servers accept on the least loaded of them (its uvicorn hook); this one
    # is served by the edge's server, which accepts as every process does.
    client_config.pop("api_server_loads", None)
    seat = PodSeat(board, index, directory, token, supervisor)
    runtime = build_runtime(config, seat=seat, link=EngineLink(client_config, index, count))
    app = create_app(runtime, seat=seat)
    sockets = [sock]
    if index == 0 and settings.batch_enabled and settings.jobs_queue_url is None:
        sockets.append(_unix_listener(http_socket_path(directory, 0)))  # the batch routes
    logger.info("API process %d of %d (pid %d) serving", index, count, os.getpid())
    serve(runtime, app, sockets=sockets)
    code = 1 if runtime.health.state is EngineState.FAILED else 0
    if code:
        logger.error("API process %d exiting with status 1: %s", index, runtime.health.reason)
    logging.shutdown()
    os._exit(code)


def _unix_listener(path: Path) -> socket.socket:
    """The pod's other API processes pass requests here."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock

"""The supervisor of a pod with several API processes (API_SERVER_COUNT > 1).

``llmendpoints-runtime serve`` becomes what ``vllm serve --api-server-count N`` is: a process
that takes no request itself. It binds PORT (one listening socket, which every API process
accepts on, and which it lets go of once they have it), answers the control port for the whole
pod (LLMEP_CONTROL_PORT: the pod's probes and /metrics, from the board), downloads the model,
starts the engine core(s) and spawns the N API processes (engine/launch.py). (Not in a
multi-node group: its leader runs one API process, config.check_api_servers says why.)

Its control port is fresh whatever the API processes do (this process is idle): each probe
says how every API process is doing (a row not refreshed for 30 s makes the pod unhealthy).

How it ends:
- SIGTERM (or SIGINT): the pod drains -- readiness 503 at once from every process, each API
  process finishes what it has in flight (its own drain, DRAIN_TIMEOUT_SECONDS) -- then the
  engine stops; exit 0. A second signal is passed on: the API processes exit at once.
- the engine dies, an API process dies, or the engine fails to start:
  the pod has failed (the board says why); every API process fails its requests in flight,
  answers 503 for ENGINE_DEATH_EXIT_DELAY_SECONDS and stops; then the engine; exit 1.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

from llmendpoints_runtime import control_listener
from llmendpoints_runtime.config import ConfigError, RuntimeConfig
from llmendpoints_runtime.engine.launch import PodEngine, mark_process_dead, prometheus_multiprocess
from llmendpoints_runtime.engine.serving import describe_failure, download_weights
from llmendpoints_runtime.metrics import CONTENT_TYPE
from llmendpoints_runtime.pod.api_process import api_process_main
from llmendpoints_runtime.pod.board import PodBoard
from llmendpoints_runtime.pod.metrics import PodView
from llmendpoints_runtime.proctree import become_subreaper, terminate_descendants

logger = logging.getLogger("llmendpoints.pod")

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 10.0  # beyond the API processes' own drain, before they are killed
ENGINE_STOP_SECONDS = 5.0


class PodSupervisor:
    def __init__(self, config: RuntimeConfig, count: int) -> None:
        self.config = config
        self.count = count
        self.board = PodBoard.create(count, multiprocessing.get_context("spawn"))
        self.view = PodView(self.board)
        self.engine = PodEngine(config.engine_args, count)
        self.signals = 0
        self.failed_at: float | None = None
        self._start_error: BaseException | None = None
        self._started = threading.Event()
        self._reaped: set[int] = set()

    # -- start-up --

    def _listen(self) -> socket.socket:
        settings = self.config.settings
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        try:
            return socket.create_server((settings.host, settings.port), family=family, backlog=4096)
        except OSError as exc:
            raise ConfigError(
                "PORT", f"cannot listen on {settings.host}:{settings.port}: {exc}"
            ) from None

    def _control_port(self) -> control_listener.ControlPort | None:
        settings = self.config.settings
        if settings.control_port is None:
            return None
        surface = control_listener.ControlSurface(
            liveness=self.view.liveness,
            readiness=self.view.readiness,
            metrics=lambda: (self.view.metrics(), CONTENT_TYPE),
        )
        host, setting = settings.control_address
        try:
            return control_listener.start(surface, host, settings.control_port)
        except OSError as exc:
            raise ConfigError(setting, str(exc)) from None

    def _start(self, sock: socket.socket, directory: Path, token: str) -> None:
        """In a thread: download, then the engine and the API processes."""
        settings = self.config.settings
        target = functools.partial(
            api_process_main, self.config, os.getpid(), self.board, directory, token
        )
        try:
            self.board.set_phase_all("download")
            download_weights(self.config.engine_args, settings.startup_log_interval_seconds)
            self.board.set_phase_all("load")
            address = f"http://{settings.host}:{settings.port}"
            self.engine.start(sock, address, target)
        except BaseException as exc:  # handed to the main thread
            self._start_error = exc
        finally:
            self._started.set()

    # -- running --

    def run(self) -> int:
        settings = self.config.settings
        prometheus_multiprocess()  # before any process of the pod starts
        become_subreaper()  # whatever the engine leaves behind stays ours to stop
        sock = self._listen()
        directory = Path(tempfile.mkdtemp(prefix="llmep-pod-"))  # 0700: the pod's sockets
        control = self._control_port()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        logger.info(
            "serving %s on %s:%d with %d API processes (%s)",
            self.config.engine_args.model,
            settings.host,
            settings.port,
            self.count,
            self.config.topology.describe(),
        )
        threading.Thread(
            target=self._start, args=(sock, directory, secrets.token_urlsafe(24)), daemon=True
        ).start()
        try:
            self._watch()
            self._stop()
        finally:
            if control is not None:
                control.close()
            terminate_descendants(ENGINE_STOP_SECONDS)
            shutil.rmtree(directory, ignore_errors=True)
        if (failure := self.board.failure) is not None:
            logger.error("exiting with status 1: %s", failure)
            return 1
        return 0

    def _on_signal(self, sig: int, _frame: object) -> None:
        self.signals += 1
        if self.signals == 1:
            logger.info(
                "%s received: draining %d API processes", signal.Signals(sig).name, self.count
            )
            self.board.start_draining()
        self._pass_on(signal.SIGTERM)

    def _pass_on(self, sig: int) -> None:
        for process in self.engine.api_processes:
            if process.pid is not None and process.exitcode is None:
                os.kill(process.pid, sig)

    def fail(self, reason: str) -> None:
        if self.board.failure is None:
            logger.error("the pod failed: %s", reason)
        self.board.fail(reason)

    def _watch(self) -> None:
        """Until a signal, or a failure the API processes have had time to answer."""
        settings = self.config.settings
        give_up = settings.engine_death_exit_delay_seconds + settings.drain_timeout_seconds
        while not self.signals:
            time.sleep(POLL_SECONDS)
            self._check()
            if self.board.failure is not None:
                self.failed_at = self.failed_at or time.monotonic()
                apis = self.engine.api_processes
                if all(p.exitcode is not None for p in apis) or (
                    time.monotonic() - self.failed_at > give_up + STOP_GRACE_SECONDS
                ):
                    return

    def _check(self) -> None:
        if self._started.is_set() and self._start_error is not None:
            error, self._start_error = self._start_error, None
            self.fail(f"the engine failed to start: {describe_failure(error)}")
        if finished := self.engine.finished_engines():
            procs = ", ".join(f"{name} exit code {code}" for name, code in finished.items())
            self.fail(f"the engine core process died ({procs})")
        for index, process in enumerate(self.engine.api_processes):
            if process.exitcode is not None and process.pid not in self._reaped:
                self._reaped.add(process.pid)
                mark_process_dead(process.pid)
                if self.board.failure is None and not self.signals:
                    self.fail(f"API process {index} exited with status {process.exitcode}")

    def _stop(self) -> None:
        """Every API process drains and exits (killed past its time), then the engine. After
        a signal they have it already (a second one would end their drain)."""
        if not self.signals:
            self._pass_on(signal.SIGTERM)
        deadline = (
            time.monotonic() + self.config.settings.drain_timeout_seconds + STOP_GRACE_SECONDS
        )
        while time.monotonic() < deadline:
            if all(p.exitcode is not None for p in self.engine.api_processes):
                break
            time.sleep(POLL_SECONDS)
        else:
            logger.warning("API processes still running after the drain: stopping them")
        self.engine.shutdown(ENGINE_STOP_SECONDS)


def serve_pod(config: RuntimeConfig, count: int) -> int:
    """Run a pod of ``count`` API processes until it ends; its exit status."""
    return PodSupervisor(config, count).run()

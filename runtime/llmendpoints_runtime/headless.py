"""A group's worker pod (``LWS_WORKER_INDEX`` > 0): its engine processes, headless.

No HTTP server: the leader serves every route. This process starts vLLM's headless launch in a
child (``engine.headless``), answers the kubelet on the control port (LLMEP_CONTROL_PORT:
/health, /ready, /ping, /metrics), and keeps the group's liveness channel to its leader
(``group.WorkerChannel``). Its readiness follows the leader's engine (the leader's beats say
it), its liveness its own sound state.

How it ends:
- its engine child exits (a crash, an OOM kill): 503, the channel closes (the leader stops the
  group at once), exit 1;
- its leader is gone (the channel closes or falls silent for LLMEP_GROUP_TIMEOUT_SECONDS): the
  engine child is stopped, exit 1 -- LeaderWorkerSet then recreates the group;
- SIGTERM: the group is being taken down (Kubernetes signals all its pods at once). The worker
  keeps its engine up while the leader drains -- until the leader closes the channel, or
  DRAIN_TIMEOUT_SECONDS -- then stops it and exits 0. A second SIGTERM stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from argparse import Namespace
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from llmendpoints_runtime import control_listener
from llmendpoints_runtime.config import ConfigError, RuntimeConfig
from llmendpoints_runtime.engine.headless import start_headless
from llmendpoints_runtime.group import WorkerChannel
from llmendpoints_runtime.health import EngineState, Health, Probe
from llmendpoints_runtime.metrics import CONTENT_TYPE, RuntimeMetrics
from llmendpoints_runtime.proctree import become_subreaper, terminate_descendants

logger = logging.getLogger("llmendpoints.headless")

POLL_SECONDS = 0.2
_CHILD_STOP_GRACE_SECONDS = 5.0


# Starts this node's engine processes (vLLM's headless launch), returning its process.
EngineStarter = Callable[[Namespace], BaseProcess]


class HeadlessWorker:
    def __init__(self, config: RuntimeConfig, start_engine: EngineStarter = start_headless) -> None:
        self.config = config
        self.start_engine = start_engine
        self.health = Health()
        self.metrics = RuntimeMetrics()
        self.signals = 0
        self.draining_since: float | None = None
        self._wake = threading.Event()
        topology, settings = config.topology, config.settings
        assert topology.leader_address is not None
        self.channel = WorkerChannel(
            topology.leader_address,
            topology.group_port,
            topology.rank,
            timeout=settings.group_timeout_seconds,
            on_lost=lambda _reason: self._wake.set(),
        )
        self.engine: BaseProcess | None = None
        self.control: control_listener.ControlPort | None = None

    # -- what the control port answers --

    def readiness(self, strict: bool) -> Probe:
        return self.health.readiness(strict=strict)

    def _metrics(self) -> tuple[bytes, str]:
        self.metrics.engine_ready.set(1 if self.health.ready else 0)
        return self.metrics.render(), CONTENT_TYPE

    def start_control_port(self) -> None:
        settings = self.config.settings
        if settings.control_port is None:
            return
        surface = control_listener.ControlSurface(
            liveness=self.health.liveness, readiness=self.readiness, metrics=self._metrics
        )
        host, setting = settings.control_address
        try:
            self.control = control_listener.start(surface, host, settings.control_port)
        except OSError as exc:
            raise ConfigError(setting, str(exc)) from None
        logger.info("probes and /metrics on %s:%d", host, self.control.port)

    # -- running --

    def run(self) -> int:
        self.start_control_port()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        become_subreaper()  # the engine's workers stay ours to stop, whatever dies first
        self.health.set_phase("load")
        logger.info("%s: starting the engine's workers, headless", self.config.topology.describe())
        self.engine = self.start_engine(self.config.engine_args)
        self.channel.start()
        reason = None
        try:
            code = self._watch()
            reason = self.health.reason
        finally:
            self.channel.stop(reason)
            self._stop_engine()
            if self.control is not None:
                self.control.close()
        return code

    def _on_signal(self, sig: int, _frame: object | None = None) -> None:
        self.signals += 1
        if self.draining_since is None:
            logger.info(
                "%s received: the engine stays up while the leader drains", signal.Signals(sig).name
            )
            self.draining_since = time.monotonic()
            self.health.start_draining()
        self._wake.set()

    def _watch(self) -> int:
        """Until the engine child ends, the leader is gone, or a signal's drain is over."""
        assert self.engine is not None
        drain = self.config.settings.drain_timeout_seconds
        while True:
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()
            if self.draining_since is not None and (
                self.signals > 1
                or self.channel.lost is not None
                or time.monotonic() - self.draining_since > drain
                or not self.engine.is_alive()
            ):
                return 0
            if not self.engine.is_alive():
                return self._failed(f"the engine's workers exited (status {self.engine.exitcode})")
            if self.channel.lost is not None:
                return self._failed(self.channel.lost)
            if (
                self.channel.leader_state == "ready"
                and self.health.state is EngineState.INITIALIZING
            ):
                self.health.engine_ready()
                logger.info("the group's engine is ready")

    def _failed(self, reason: str) -> int:
        self.health.engine_failed(reason)
        logger.error("exiting with status 1: %s", reason)
        return 1

    def _stop_engine(self) -> None:
        stopped = terminate_descendants(_CHILD_STOP_GRACE_SECONDS)
        if stopped:
            logger.info("stopped %d engine process(es)", stopped)
        self.health.engine_stopped()


def serve_headless(config: RuntimeConfig) -> int:
    """Run this group worker until it ends; its exit status."""
    return HeadlessWorker(config).run()

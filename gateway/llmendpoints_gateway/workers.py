"""A gateway pod of several processes: a supervisor, N worker processes serving one port
(GATEWAY_WORKERS > 1), and, with batches on the shared queue, the pod's batch driver host.

One Python process relays at most one core's worth of streams (the event loop is single
threaded). With N workers the pod uses N cores: the supervisor opens N listening sockets on the
gateway's port with SO_REUSEPORT -- the kernel spreads incoming connections over them by a hash
of the connection -- and starts one worker per socket (``llmendpoints-gateway serve`` with the
socket inherited). The supervisor holds the sockets, so a worker that dies and is restarted
finds the connections that queued meanwhile; it takes no request itself.

What the workers share, they share as separate gateway replicas do: through the shared queue
(JOBS_QUEUE_URL) -- per-key limits, usage records, the job API; each publishes its own
held-request count (``held.<endpoint>.<pod>-<worker>``), which the autoscaler sums. What is per
process: the routing state (each worker's prefix index knows what it sent), holds (GATEWAY_HOLD_QUEUE_LENGTH and GATEWAY_HOLD_MAX_BYTES are
divided among the workers, so the pod's bounds stay what they say), discovery (each worker
watches on its own). What the pod reads of its replicas -- static backends' readiness, engine
load -- one worker reads and the others follow (pod_board.py: the supervisor's shared page). /metrics: each worker serves its registry on a loopback socket
the supervisor gives it; the supervisor serves their sum on GATEWAY_METRICS_PORT
(metrics_merge.py).

The batch driver host (batch_host.py): with JOBS_QUEUE_URL and LLMEP_BATCH_ENABLED, the
supervisor also keeps one process that moves the pod's batches along (reads and validates their
input files, hands their requests to the queue, writes their results) and serves nothing, so no
serving worker ever parses a 200 MB input file. It runs even with one worker: the supervisor
is then the pod's first process whatever GATEWAY_WORKERS says. Why a process of its own rather
than one worker elected to drive: an elected worker would still relay streams on the loop that
parses the files, and a worker restarted for any reason would take the pod's batches with it.

Signals: SIGTERM (or SIGINT) to the supervisor is passed to every worker, which drains as a
single gateway does (/ready 503, held requests answered, streams finished) -- and keeps
accepting connections until the whole pod has nothing in flight (``DrainBoard``: each worker's
outstanding work in a shared memory page), because a worker that left early would leave the
connections the kernel still hashes to its socket unanswered; the supervisor exits when all
workers have, with status 0 if all did. A second signal is passed on too (the workers exit at
once). Workers run in their own process groups (a terminal's Ctrl-C reaches the supervisor
only, which passes it on once) and get SIGTERM if the supervisor dies (PR_SET_PDEATHSIG). A
worker that exits on its own is restarted (after 0.5 s, doubling to 30 s while it keeps failing
within 10 s of its start); five quick failures in a row stop the pod (exit 1: the kubelet
restarts it, and says so). The batch driver host is kept the same way; on SIGTERM it stops its
drivers (their leases stay, for it or another pod to take up) and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import mmap
import os
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from llmendpoints_common.waiting import wait_until_set
from llmendpoints_edge.cpus import pod_cpus
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.metrics import CONTENT_TYPE
from llmendpoints_gateway.metrics_merge import merge
from llmendpoints_gateway.pod_board import PodBoard

logger = logging.getLogger("llmendpoints.gateway.workers")

QUICK_EXIT_SECONDS = 10.0
QUICK_EXITS_TO_GIVE_UP = 5
SCRAPE_TIMEOUT_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSlot:
    """What a worker is told by its supervisor (hidden ``serve`` options)."""

    index: int
    count: int
    listen_fd: int
    metrics_fd: int
    supervisor_pid: int
    drain_fd: int = -1
    board_fd: int = -1  # the pod board (pod_board.PodBoard) and its wake-up eventfd
    wake_fd: int = -1

    def share(self, total: int) -> int:
        """This worker's part of a pod-wide bound (at least 1 when the bound is not 0)."""
        return 0 if total <= 0 else max(1, math.ceil(total / self.count))


class DrainBoard:
    """Each worker's outstanding work (Drainable.busy), one int64 per worker in a memory page
    the supervisor shares with its workers (memfd); a worker not heard from counts as busy."""

    def __init__(self, fd: int, count: int) -> None:
        self.fd = fd
        self.count = count
        self._map = mmap.mmap(fd, 8 * count)

    @classmethod
    def create(cls, count: int) -> DrainBoard:
        fd = os.memfd_create("llmep-gateway-drain")
        os.ftruncate(fd, 8 * count)
        board = cls(fd, count)
        for index in range(count):
            board.set(index, 1)
        return board

    def set(self, index: int, busy: int) -> None:
        struct.pack_into("q", self._map, 8 * index, busy)

    def total(self) -> int:
        return sum(struct.unpack_from(f"{self.count}q", self._map))


class PodDrain:
    """A worker's component as the edge server's drain sees it: busy until the whole pod is
    idle (every worker's count in the DrainBoard at 0), not only this worker."""

    def __init__(self, component: Any, board: DrainBoard, index: int) -> None:
        self.component = component
        self.board = board
        self.index = index

    def start_draining(self) -> None:
        self.component.start_draining()

    def set_drain_deadline(self, deadline: float) -> None:
        self.component.set_drain_deadline(deadline)

    def busy(self) -> int:
        self.board.set(self.index, self.component.busy())
        return self.board.total()


def worker_count(settings: GatewaySettings) -> int:
    """GATEWAY_WORKERS resolved: 0 means one per CPU of the pod -- but one without a shared
    queue, where per-key limits could not be shared among processes."""
    if settings.workers > 0:
        if settings.workers > 1 and settings.queue_url is None:
            logger.warning(
                "GATEWAY_WORKERS=%d without JOBS_QUEUE_URL: per-key limits are enforced per "
                "worker process (the pod admits up to %d times a key's limit)",
                settings.workers,
                settings.workers,
            )
        return settings.workers
    if settings.queue_url is None:
        logger.info("GATEWAY_WORKERS=0 without JOBS_QUEUE_URL: one process (limits unshared)")
        return 1
    return pod_cpus()


def wants_batch_host(settings: GatewaySettings) -> bool:
    """Whether the pod runs a batch driver host: batches on, on the shared queue."""
    return settings.batch_enabled and settings.queue_url is not None


def die_with_supervisor(supervisor_pid: int) -> None:
    """In a worker: SIGTERM when the supervisor dies (Linux), and exit now if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != supervisor_pid:
        sys.exit(0)


def listening_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening socket on host:port that shares the port (SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


class SupervisorMetrics:
    """The supervisor's own series, served after the workers' sum."""

    def __init__(self) -> None:
        disable_created_metrics()  # as the workers' (metrics.py)
        self.registry = CollectorRegistry(auto_describe=True)
        self.running = Gauge(
            "llmendpoints_gateway_workers",
            "Worker processes of this gateway pod running now (GATEWAY_WORKERS).",
            registry=self.registry,
        )
        self.restarts = Counter(
            "llmendpoints_gateway_worker_restarts",
            "Worker processes restarted after exiting on their own.",
            registry=self.registry,
        )

    def render(self) -> str:
        return generate_latest(self.registry).decode()


@dataclass(frozen=True)
class _Child:
    """A process the supervisor keeps running: a worker (``index``) or the batch driver host."""

    name: str
    argv: list[str]
    fds: tuple[int, ...] = field(default=())
    index: int | None = None


class Supervisor:
    def __init__(self, settings: GatewaySettings, count: int, *, batch_host: bool = False) -> None:
        self.settings = settings
        self.count = count
        self.batch_host = batch_host
        self.stopping = False
        self.exit_code = 0
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._listen: list[socket.socket] = []
        self._metrics: list[socket.socket] = []
        self._signals = 0
        self.metrics = SupervisorMetrics()
        self._wake: asyncio.Event | None = None

    def run(self) -> int:
        try:
            self._listen = [
                listening_socket(self.settings.host, self.settings.port) for _ in range(self.count)
            ]
        except OSError as exc:
            logger.error("cannot listen on %s:%d: %s", self.settings.host, self.settings.port, exc)
            return 1
        self._metrics = [listening_socket("127.0.0.1", 0, 64) for _ in range(self.count)]
        self._board = DrainBoard.create(self.count)
        self._pods = PodBoard.create(self.count)
        logger.info(
            "gateway: %d worker processes on port %d (SO_REUSEPORT)%s",
            self.count,
            self.settings.port,
            " and a batch driver host" if self.batch_host else "",
        )
        return asyncio.run(self._main())

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        runner = await self._serve_metrics()
        children = [self._worker(i) for i in range(self.count)]
        if self.batch_host:
            children.append(self._driver_host())
        try:
            await asyncio.gather(*(self._keep(child) for child in children))
        finally:
            if runner is not None:
                await runner.cleanup()
            for sock in (*self._listen, *self._metrics):
                sock.close()
        return self.exit_code

    # -- the workers --

    def _worker(self, index: int) -> _Child:
        argv = [
            sys.executable, "-m", "llmendpoints_gateway", "serve",
            "--worker", f"{index}/{self.count}",
            "--listen-fd", str(self._listen[index].fileno()),
            "--metrics-fd", str(self._metrics[index].fileno()),
            "--supervisor-pid", str(os.getpid()),
            "--drain-fd", str(self._board.fd),
            "--board-fd", str(self._pods.fd),
            "--wake-fd", str(self._pods.wake_fd),
        ]  # fmt: skip
        fds = (
            self._listen[index].fileno(),
            self._metrics[index].fileno(),
            self._board.fd,
            self._pods.fd,
            self._pods.wake_fd,
        )
        return _Child(f"worker {index}", argv, fds, index)

    def _driver_host(self) -> _Child:
        argv = [
            sys.executable, "-m", "llmendpoints_gateway", "serve",
            "--batch-drivers", "--supervisor-pid", str(os.getpid()),
        ]  # fmt: skip
        return _Child("batch driver host", argv)

    async def _keep(self, child: _Child) -> None:
        """Run ``child`` until the pod stops; restart it when it exits on its own."""
        loop = asyncio.get_running_loop()
        quick = 0
        while not self.stopping:
            started = loop.time()
            code = await self._run(child)
            if self.stopping:
                if code != 0:
                    logger.warning("%s exited with status %d while stopping", child.name, code)
                    self.exit_code = 1
                if child.index is not None:
                    # Connections that would wait for it in its socket's queue get refused now.
                    self._listen[child.index].close()
                return
            quick = quick + 1 if loop.time() - started < QUICK_EXIT_SECONDS else 1
            if quick >= QUICK_EXITS_TO_GIVE_UP:
                logger.error(
                    "%s exited %d times in a row within %.0f s of starting (status %d): "
                    "stopping the gateway",
                    child.name,
                    quick,
                    QUICK_EXIT_SECONDS,
                    code,
                )
                self.exit_code = 1
                self._stop()
                return
            delay = min(30.0, 0.5 * 2 ** (quick - 1))
            logger.warning(
                "%s exited with status %d; restarting in %.1f s", child.name, code, delay
            )
            self.metrics.restarts.inc()
            assert self._wake is not None
            await wait_until_set(self._wake, delay)

    async def _run(self, child: _Child) -> int:
        """Start ``child`` once and wait for it to exit; its status."""
        proc = await asyncio.create_subprocess_exec(
            *child.argv, pass_fds=child.fds, process_group=0
        )
        self._procs[child.name] = proc
        if child.index is not None:
            self.metrics.running.inc()
            self._board.set(child.index, 1)  # busy until it says otherwise
        logger.info("%s started (pid %d)", child.name, proc.pid)
        if self.stopping:  # the signal came while it was being started
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        code = await proc.wait()
        del self._procs[child.name]
        if child.index is not None:
            self.metrics.running.dec()
            self._board.set(child.index, 0)  # gone: nothing of the pod's waits on it
        return code

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info("%s received: draining %d workers", signal.Signals(sig).name, self.count)
        self._stop()

    def _stop(self) -> None:
        """Every worker gets SIGTERM (each drains; a second one makes it exit at once)."""
        self.stopping = True
        if self._wake is not None:
            self._wake.set()
        for proc in list(self._procs.values()):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    # -- /metrics: the workers' sum --

    async def _serve_metrics(self) -> web.AppRunner | None:
        if not self.settings.metrics_port:
            return None
        app = web.Application()
        app.router.add_get("/metrics", self._metrics_handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host = self.settings.metrics_host or self.settings.host
        await web.TCPSite(runner, host, self.settings.metrics_port).start()
        return runner

    async def _metrics_handler(self, _: web.Request) -> web.Response:
        ports = [sock.getsockname()[1] for sock in self._metrics]
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            texts = await asyncio.gather(*(self._scrape(session, port) for port in ports))
        body = merge([t for t in texts if t is not None]) + self.metrics.render()
        return web.Response(body=body.encode(), headers={"content-type": CONTENT_TYPE})

    @staticmethod
    async def _scrape(session: aiohttp.ClientSession, port: int) -> str | None:
        try:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                return await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None  # a worker restarting: the others' series are still served

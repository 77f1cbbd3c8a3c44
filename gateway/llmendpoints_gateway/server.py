"""The composition root: the gateway's parts built from its settings, each given what it needs
when it is built, and served under the edge's server (``llmendpoints_edge.server``: bounded
headers, the drain).

The one NATS connection of the process (queue.py) is made here and handed to every part that
uses it. Parts are built in dependency order -- what a part calls exists before it -- and that
is their start order; stop order is its reverse, so no part outlives what it uses.

Two kinds of process run from here: a serving process (``serve``: one, or each of
GATEWAY_WORKERS) and the pod's batch driver host (``serve_batch_host``, batch_host.py: started
by the supervisor when batches are on), which serves no request.

On SIGTERM (or SIGINT): /ready turns 503, held requests are answered 503 with Retry-After at
once, the listener stays open (a Service takes a moment to stop sending), and the process exits
when nothing is in flight and no job webhook is still being delivered, or after
DRAIN_TIMEOUT_SECONDS. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket

from llmendpoints_common.gateway_token import read_secret
from llmendpoints_edge.memory import HeapTrimmer
from llmendpoints_edge.server import serve as serve_edge

from llmendpoints_gateway.access import Access
from llmendpoints_gateway.app import Gateway, Part
from llmendpoints_gateway.batch_host import BatchHost
from llmendpoints_gateway.batches import BatchGateway
from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.discovery.kube import KubeDiscovery
from llmendpoints_gateway.discovery.static import StaticDiscovery
from llmendpoints_gateway.jobs import JobGateway
from llmendpoints_gateway.keys import KeyRing
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.metrics_server import MetricsServer
from llmendpoints_gateway.pod_board import Activity, PodBoard
from llmendpoints_gateway.pod_reader import PodReader
from llmendpoints_gateway.queue import SharedQueue
from llmendpoints_gateway.registry import Registry
from llmendpoints_gateway.route_sharing import RouteSharing
from llmendpoints_gateway.signals import SignalPublisher
from llmendpoints_gateway.usage import JobUsageMeter, Metering, UsagePublisher
from llmendpoints_gateway.workers import DrainBoard, PodDrain, WorkerSlot

logger = logging.getLogger("llmendpoints.gateway.server")

# The batch driver host's CPU priority below the serving workers' (nice 0): it does background
# work, and when the pod's CPU is short the workers relaying interactive streams go first.
BATCH_HOST_NICE = 10


def _keys(settings: GatewaySettings) -> KeyRing:
    return KeyRing.from_settings(
        settings.api_keys.get_secret_value() if settings.api_keys else None,
        settings.api_keys_file,
        settings.endpoints_file,
        require_keys=settings.require_keys,
        secrets=not settings.endpoints_file,
    )


def _queue(settings: GatewaySettings) -> SharedQueue | None:
    if settings.queue_url is None:
        return None
    return SharedQueue(settings.queue_url, settings.gateway_id, settings.jobs_queue_creds_file)


def _discovery(
    settings: GatewaySettings, registry: Registry, keys: KeyRing, reader: PodReader
) -> StaticDiscovery | KubeDiscovery:
    if settings.endpoints_file:
        return StaticDiscovery(settings.endpoints_file, registry, reader)
    return KubeDiscovery(
        registry,
        keys,
        namespace=settings.namespace,
        keys_namespace=settings.keys_namespace,
        endpoint_keys=settings.endpoint_keys,
    )


def _process_name(settings: GatewaySettings, worker: WorkerSlot | None) -> str:
    """This process among the pod's (its held counts and shared routes are its own)."""
    return f"{settings.gateway_id}-{worker.index}" if worker else settings.gateway_id


def _registry(
    settings: GatewaySettings,
    metrics: GatewayMetrics,
    worker: WorkerSlot | None,
    signals: SignalPublisher | None,
    activity: Activity,
) -> Registry:
    """What this process knows of the endpoints: the pod's hold bounds shared among its
    workers, the engines' own counters reported once (worker 0), held counts published,
    which endpoints have work (``activity``: their engines are read)."""
    return Registry(
        metrics,
        worker.share(settings.hold_queue_length) if worker else settings.hold_queue_length,
        settings.load_factor,
        on_held=signals.held_changed if signals is not None else lambda endpoint, n: None,
        hold_key_share=settings.hold_key_share,
        hold_max_bytes=worker.share(settings.hold_max_bytes) if worker else settings.hold_max_bytes,
        count_engine_hits=worker is None or worker.index == 0,
        share_routes=signals is not None and settings.share_prefix_index,
        activity=activity,
    )


def _pod_reader(
    settings: GatewaySettings,
    registry: Registry,
    activity: Activity,
    board: PodBoard | None,
    load_interval: float,
) -> PodReader:
    """Each pod's readiness and engine load (every ``load_interval`` s; 0: never), from its
    control port, once per gateway pod (``board``: shared with the pod's other workers). It
    feeds the registry it reads for, so it is given to the registry once both exist."""
    reader = PodReader(
        registry,
        activity,
        load_interval=load_interval,
        probe_interval=settings.probe_interval_seconds,
        idle_interval=settings.idle_probe_interval_seconds,
        board=board,
    )
    if load_interval > 0:
        registry.feed = reader
    return reader


def _queue_parts(
    settings: GatewaySettings,
    queue: SharedQueue,
    signals: SignalPublisher,
    registry: Registry,
    metrics: GatewayMetrics,
    worker: WorkerSlot | None,
) -> list[Part]:
    """The parts that live on the shared queue besides the job and batch APIs."""
    parts: list[Part] = [queue, signals]
    if registry.routed is not None:
        # What each process routed reaches every other's prefix index (a random suffix: two
        # gateways on one host share a host name).
        parts.append(
            RouteSharing(
                queue,
                f"{settings.gateway_id}-{worker.index if worker else 0}-{os.urandom(3).hex()}",
                registry.routed,
                registry.apply_shared,
                metrics,
            )
        )
    return parts


def build(settings: GatewaySettings, worker: WorkerSlot | None = None) -> Gateway:
    """The gateway's parts; ``worker``: this process is one of several (workers.py), which
    share the pod's hold bounds and its pod reader (pod_board.py) and report the engines' own
    counters once (worker 0)."""
    metrics = GatewayMetrics(key_labels=settings.metrics_key_labels)
    queue = _queue(settings)
    signals = SignalPublisher(queue, _process_name(settings, worker)) if queue else None
    # An endpoint stays "active" (its engines read) this long after its last request.
    grace = 2 * settings.idle_probe_interval_seconds
    board = (
        PodBoard(worker.board_fd, worker.count, worker.wake_fd)
        if worker is not None and worker.board_fd >= 0
        else None
    )
    activity = board.activity(worker.index, grace) if board and worker else Activity.private(grace)
    registry = _registry(settings, metrics, worker, signals, activity)
    reader = _pod_reader(settings, registry, activity, board, settings.engine_load_interval_seconds)
    keys = _keys(settings)
    access = Access(keys, registry)
    # Per-key limits: shared by every replica through NATS when there is one, else this
    # replica's own; usage records and the job API need NATS too.
    limiter = Limiter(settings.gateway_id, queue)
    publisher = UsagePublisher(queue) if queue is not None else None
    metering = Metering(settings.gateway_id, metrics, limiter, keys, registry, publisher)
    parts: list[Part] = []
    jobs = batches = None
    if queue is not None and signals is not None and publisher is not None:
        parts += _queue_parts(settings, queue, signals, registry, metrics, worker)
        jobs = JobGateway(
            queue,
            limiter,
            webhook_policy=settings.webhook_policy,
            webhook_timeout_seconds=settings.webhook_timeout_seconds,
            webhook_max_concurrency=settings.webhook_max_concurrency,
            nudge=signals.nudge_soon,
        )
        meter = JobUsageMeter(queue, metering.job_usage, on_refused=metering.job_unbilled)
        parts += [jobs, publisher, meter]
        if settings.batch_enabled:
            batches = BatchGateway(queue, registry, settings, nudge=signals.nudge_soon)
    parts += [limiter, _discovery(settings, registry, keys, reader), reader]
    if worker is not None:
        sock = socket.socket(fileno=worker.metrics_fd)
        parts.append(MetricsServer(metrics, "127.0.0.1", sock.getsockname()[1], sock))
    elif settings.metrics_port:
        parts.append(
            MetricsServer(metrics, settings.metrics_host or settings.host, settings.metrics_port)
        )
    return Gateway(
        settings,
        access,
        registry,
        metrics,
        limiter,
        metering,
        jobs=jobs,
        batches=batches,
        parts=parts,
        token_secret=read_secret(settings.token_secret_file)
        if settings.token_secret_file
        else None,
    )


def serve(settings: GatewaySettings, worker: WorkerSlot | None = None) -> None:
    """Serve until drained, as the one process or as ``worker`` of several (the CLI runs
    workers.Supervisor instead when the pod has several processes, which starts them)."""
    gateway = build(settings, worker)
    drain = gateway
    if worker is not None and worker.drain_fd >= 0:
        drain = PodDrain(gateway, DrainBoard(worker.drain_fd, worker.count), worker.index)
    serve_edge(
        gateway,
        drain,
        settings,
        loop="uvloop",
        access_log=False,  # the gateway writes its own access line with routing fields
        proxy_headers=False,  # it logs no client address: no X-Forwarded-* layer per request
        backlog=4096,
        sockets=[socket.socket(fileno=worker.listen_fd)] if worker else None,
        # Bodies of 10 MB by the dozen come and go here: their memory goes back when they do.
        trimmer=HeapTrimmer(),
    )


# ---------------------------------------------------------------- the batch driver host


def build_batch_host(settings: GatewaySettings) -> list[Part]:
    """The driver host's parts, in start order: the queue, its own view of the endpoints and
    keys (to resolve a batch's model), the nudges, the drivers."""
    queue = _queue(settings)
    if queue is None or not settings.batch_enabled:
        raise ValueError("the batch driver host needs JOBS_QUEUE_URL and LLMEP_BATCH_ENABLED")
    name = f"{settings.gateway_id}-batches"
    signals = SignalPublisher(queue, name)
    registry = Registry(GatewayMetrics(), 0, settings.load_factor)  # routes no request
    keys = _keys(settings)
    host = BatchHost(
        queue, Access(keys, registry), registry, settings, holder=name, nudge=signals.nudge_soon
    )
    # Static backends' readiness (a batch for an endpoint with none ready nudges); no engine
    # load: the host routes no request.
    activity = Activity.private(2 * settings.idle_probe_interval_seconds)
    reader = _pod_reader(settings, registry, activity, None, load_interval=0.0)
    return [queue, signals, _discovery(settings, registry, keys, reader), reader, host]


def serve_batch_host(settings: GatewaySettings) -> int:
    """Run the pod's batch drivers, below the serving workers' CPU priority, until SIGTERM or
    SIGINT (then stop them and exit 0)."""
    with contextlib.suppress(OSError):
        os.nice(BATCH_HOST_NICE)
    return asyncio.run(_run_parts(build_batch_host(settings)))


async def _run_parts(parts: list[Part]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started: list[Part] = []
    try:
        for part in parts:
            await part.start()
            started.append(part)
        await stop.wait()
    finally:
        for part in reversed(started):
            try:
                await part.stop()
            except Exception:
                logger.exception("stopping %s failed", type(part).__name__)
    return 0

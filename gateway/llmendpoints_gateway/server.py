"""The composition root: the gateway's parts built from its settings, plugged together, and
served under the edge's server (``llmendpoints_edge.server``: bounded headers, the drain).

The one NATS connection of the process (queue.py) is made here and handed to every part that
uses it. Start order is dependency order; stop order is its reverse, so no part outlives what
it uses.

On SIGTERM (or SIGINT): /ready turns 503, held requests are answered 503 with Retry-After at
once, the listener stays open (a Service takes a moment to stop sending), and the process exits
when nothing is in flight and no job webhook is still being delivered, or after
DRAIN_TIMEOUT_SECONDS. A second signal exits at once.
"""

from __future__ import annotations

import os
import socket

from llmendpoints_common.gateway_token import read_secret
from llmendpoints_edge.memory import HeapTrimmer
from llmendpoints_edge.server import serve as serve_edge

from llmendpoints_gateway.access import Access
from llmendpoints_gateway.app import Gateway
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


def build(settings: GatewaySettings, worker: WorkerSlot | None = None) -> Gateway:
    """The gateway's parts; ``worker``: this process is one of several (workers.py), which
    share the pod's hold bounds and its pod reader (pod_board.py) and report the engines' own
    counters once (worker 0)."""
    metrics = GatewayMetrics(key_labels=settings.metrics_key_labels)
    # An endpoint stays "active" (its engines read) this long after its last request.
    grace = 2 * settings.idle_probe_interval_seconds
    board = (
        PodBoard(worker.board_fd, worker.count, worker.wake_fd)
        if worker is not None and worker.board_fd >= 0
        else None
    )
    activity = board.activity(worker.index, grace) if board and worker else Activity.private(grace)
    registry = Registry(
        metrics,
        worker.share(settings.hold_queue_length) if worker else settings.hold_queue_length,
        settings.load_factor,
        hold_key_share=settings.hold_key_share,
        hold_max_bytes=worker.share(settings.hold_max_bytes) if worker else settings.hold_max_bytes,
        count_engine_hits=worker is None or worker.index == 0,
        activity=activity,
    )
    # Each pod's readiness and engine load, from its control port, once per gateway pod.
    reader = PodReader(
        registry,
        activity,
        load_interval=settings.engine_load_interval_seconds,
        probe_interval=settings.probe_interval_seconds,
        idle_interval=settings.idle_probe_interval_seconds,
        board=board,
    )
    if settings.engine_load_interval_seconds > 0:
        registry.feed = reader
    keys = KeyRing.from_settings(
        settings.api_keys.get_secret_value() if settings.api_keys else None,
        settings.api_keys_file,
        settings.endpoints_file,
        require_keys=settings.require_keys,
        secrets=not settings.endpoints_file,
    )
    token_secret = read_secret(settings.token_secret_file) if settings.token_secret_file else None
    queue = (
        SharedQueue(settings.queue_url, settings.gateway_id, settings.jobs_queue_creds_file)
        if settings.queue_url is not None
        else None
    )
    # Per-key limits: shared by every replica through NATS when there is one, else this
    # replica's own; usage records and the job API need NATS too.
    limiter = Limiter(settings.gateway_id, queue)
    publisher = UsagePublisher(queue) if queue is not None else None
    metering = Metering(settings.gateway_id, metrics, limiter, keys, registry, publisher)
    if settings.endpoints_file:
        discovery = StaticDiscovery(settings.endpoints_file, registry, reader)
    else:
        discovery = KubeDiscovery(
            registry,
            keys,
            namespace=settings.namespace,
            keys_namespace=settings.keys_namespace,
            endpoint_keys=settings.endpoint_keys,
        )
    gateway = Gateway(
        settings,
        Access(keys, registry),
        registry,
        metrics,
        limiter,
        metering,
        token_secret=token_secret,
    )
    parts: list = []
    if queue is not None:
        # Each process publishes its own held count (the autoscaler sums the gateways').
        signals = SignalPublisher(
            queue, f"{settings.gateway_id}-{worker.index}" if worker else settings.gateway_id
        )
        registry.on_held = signals.held_changed
        gateway.jobs = JobGateway(
            queue,
            limiter,
            webhook_policy=settings.webhook_policy,
            webhook_timeout_seconds=settings.webhook_timeout_seconds,
            webhook_max_concurrency=settings.webhook_max_concurrency,
            nudge=signals.nudge_soon,
        )
        meter = JobUsageMeter(queue, metering.job_usage, on_refused=metering.job_unbilled)
        parts += [queue, signals, gateway.jobs, publisher, meter]
        if settings.batch_enabled:
            gateway.batches = BatchGateway(
                queue,
                gateway.access,
                registry,
                settings,
                holder=f"{settings.gateway_id}-{worker.index}" if worker else None,
                nudge=signals.nudge_soon,
            )
            parts.append(gateway.batches)
        if settings.share_prefix_index:
            # What each process routed reaches every other's prefix index (a random suffix:
            # two gateways on one host share a host name).
            sharing = RouteSharing(
                queue,
                f"{settings.gateway_id}-{worker.index if worker else 0}-{os.urandom(3).hex()}",
                registry.apply_shared,
                metrics,
            )
            registry.on_record = sharing.record
            parts.append(sharing)
    parts += [limiter, discovery, reader]
    if worker is not None:
        sock = socket.socket(fileno=worker.metrics_fd)
        parts.append(MetricsServer(metrics, "127.0.0.1", sock.getsockname()[1], sock))
    elif settings.metrics_port:
        parts.append(
            MetricsServer(metrics, settings.metrics_host or settings.host, settings.metrics_port)
        )
    gateway.started.extend(part.start for part in parts)
    gateway.stopped.extend(part.stop for part in reversed(parts))
    return gateway


def serve(settings: GatewaySettings, worker: WorkerSlot | None = None) -> None:
    """Serve until drained, as the one process or as ``worker`` of several (GATEWAY_WORKERS > 1:
    the CLI runs workers.Supervisor instead, which starts them)."""
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

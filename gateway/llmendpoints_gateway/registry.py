"""What the gateway knows: endpoints, the models they serve, their ready replicas, and the
gateway's own in-flight count per replica. Discovery (static file or Kubernetes) writes it; the
request path reads it. Single event loop: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from llmendpoints_common.identity import DEFAULT_NAMESPACE

from llmendpoints_gateway.holding import HoldBudget, HoldQueue
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.routing import Outcome, Router, Strategy

logger = logging.getLogger("llmendpoints.gateway.registry")

# How long a replica that refused a connection is routed around.
SUSPEND_SECONDS = 2.0


@dataclass
class Endpoint:
    name: str
    models: tuple[str, ...]
    router: Router
    hold: HoldQueue
    namespace: str = DEFAULT_NAMESPACE
    ready: tuple[str, ...] = ()  # what requests are routed to: discovered, not suspended
    discovered: frozenset[str] = frozenset()
    suspended: set[str] = field(default_factory=set)
    loads: dict[str, int] = field(default_factory=dict)

    @property
    def id(self) -> str:
        """The endpoint's identity in the shared queue: ``<namespace>/<name>``."""
        return f"{self.namespace}/{self.name}"

    def choose(
        self, key: bytes | None, exclude: frozenset[str] = frozenset()
    ) -> tuple[str, Outcome] | None:
        return self.router.choose(key, self.loads, exclude)


@dataclass(frozen=True)
class Lease:
    """A replica chosen for one request, counted in its load while the lease is held."""

    replica: str
    outcome: Outcome


class NoReplicaLeft(Exception):
    """Every ready replica was tried for this request and failed before answering."""


class Registry:
    def __init__(
        self,
        metrics: GatewayMetrics,
        hold_queue_length: int,
        load_factor: float,
        on_held: Callable[[str, int], None] = lambda endpoint, n: None,
        *,
        hold_key_share: float = 1.0,
        hold_max_bytes: int = 1 << 62,
    ):
        self.metrics = metrics
        self.hold_queue_length = hold_queue_length
        self.hold_key_share = hold_key_share
        self.hold_budget = HoldBudget(hold_max_bytes)
        self.load_factor = load_factor
        self.on_held = on_held
        self.endpoints: dict[str, Endpoint] = {}
        self._by_model: dict[str, Endpoint] = {}
        self.closed = False

    # -- reads (request path) --

    def by_model(self, model: str) -> Endpoint | None:
        return self._by_model.get(model)

    def get(self, name: str) -> Endpoint | None:
        return self.endpoints.get(name)

    def by_id(self, endpoint_id: str) -> Endpoint | None:
        """The endpoint whose ``<namespace>/<name>`` is ``endpoint_id``."""
        return next((ep for ep in self.endpoints.values() if ep.id == endpoint_id), None)

    def in_flight(self) -> int:
        return sum(sum(ep.loads.values()) for ep in self.endpoints.values())

    def held(self) -> int:
        return sum(len(ep.hold) for ep in self.endpoints.values())

    # -- writes (discovery) --

    def upsert(
        self,
        name: str,
        models: Iterable[str],
        strategy: Strategy,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> Endpoint:
        models = tuple(dict.fromkeys(models))
        ep = self.endpoints.get(name)
        if ep is None:
            metrics = self.metrics
            hold = HoldQueue(
                name,
                self.hold_queue_length,
                on_change=lambda n: self._held_changed(name, n),
                on_reject=lambda reason: metrics.hold_rejected.labels(name, reason).inc(),
                key_share=self.hold_key_share,
                budget=self.hold_budget,
            )
            ep = Endpoint(name, models, Router(strategy, self.load_factor), hold, namespace)
            if self.closed:
                hold.close()
            self.endpoints[name] = ep
            logger.info("endpoint %s: models %s, routing %s", name, list(models), strategy)
        else:
            if ep.models != models or ep.router.strategy is not strategy:
                logger.info("endpoint %s: models %s, routing %s", name, list(models), strategy)
            ep.models = models
            ep.router.strategy = strategy
            ep.namespace = namespace
        self._index()
        return ep

    def remove(self, name: str) -> None:
        ep = self.endpoints.pop(name, None)
        if ep is None:
            return
        ep.hold.close()
        self.metrics.ready_replicas.labels(name).set(0)
        self._index()
        logger.info("endpoint %s removed", name)

    def set_ready(self, name: str, replicas: Iterable[str]) -> None:
        """Discovery's view: these replicas of the endpoint are ready."""
        ep = self.endpoints.get(name)
        if ep is None:
            return
        ep.discovered = frozenset(replicas)
        self._publish(ep)

    def mark_failed(self, name: str, replica: str) -> None:
        """A replica refused or reset a connection: route around it for SUSPEND_SECONDS, then
        trust discovery again (a pod that is really gone leaves its EndpointSlice, a static
        backend fails its probe)."""
        ep = self.endpoints.get(name)
        if ep is None or replica not in ep.ready:
            return
        ep.suspended.add(replica)
        self._publish(ep)

        def resume() -> None:
            ep.suspended.discard(replica)
            self._publish(ep)

        asyncio.get_running_loop().call_later(SUSPEND_SECONDS, resume)

    def _publish(self, ep: Endpoint) -> None:
        ready = tuple(sorted(ep.discovered - ep.suspended))
        if ready == ep.ready:
            return
        logger.info("endpoint %s: %d ready replica(s) %s", ep.name, len(ready), list(ready))
        ep.ready = ready
        ep.router.set_replicas(ready)
        self.metrics.ready_replicas.labels(ep.name).set(len(ready))
        if ready:
            ep.hold.release_all()

    def close(self) -> None:
        """Shutting down: held requests get 503 now; nothing is held from here on."""
        self.closed = True
        for ep in self.endpoints.values():
            ep.hold.close()

    # -- the request path: wait for a replica, choose it, count it --

    @contextlib.asynccontextmanager
    async def lease(
        self,
        ep: Endpoint,
        prefix: bytes | None,
        *,
        hold_timeout: float,
        gone: Callable[[], Awaitable[object]],
        exclude: frozenset[str] = frozenset(),
        key: str = "",
        size: int = 0,
    ) -> AsyncIterator[Lease]:
        """A replica of ``ep`` for one request (KubeAI's ``getBestAddr`` and its ``done``):
        while the endpoint has none ready the request is held (``HoldQueue``: 503 when full,
        past ``hold_timeout``, over ``key``'s share or the byte budget with its ``size``, or
        shutting down; ClientGone when ``gone()`` completes first);
        the chosen replica carries the request in its load until the block ends. A retry
        passes the replicas already tried as ``exclude``: NoReplicaLeft when none is left."""
        while True:
            choice = ep.choose(prefix, exclude=exclude)
            if choice is not None:
                break
            if exclude:
                raise NoReplicaLeft()
            await ep.hold.wait(hold_timeout, gone(), key=key, size=size)
        replica, outcome = choice
        if exclude:
            outcome = Outcome.RETRY
        self.metrics.routing.labels(ep.name, outcome).inc()
        self.acquire(ep, replica)
        try:
            yield Lease(replica, outcome)
        finally:
            self.release(ep, replica)

    # -- load accounting --

    def acquire(self, ep: Endpoint, replica: str) -> None:
        n = ep.loads.get(replica, 0) + 1
        ep.loads[replica] = n
        self.metrics.in_flight.labels(ep.name, replica).set(n)

    def release(self, ep: Endpoint, replica: str) -> None:
        n = ep.loads.get(replica, 1) - 1
        if n <= 0:
            ep.loads.pop(replica, None)
            n = 0
        else:
            ep.loads[replica] = n
        self.metrics.in_flight.labels(ep.name, replica).set(n)

    def _index(self) -> None:
        by_model: dict[str, Endpoint] = {}
        for ep in sorted(self.endpoints.values(), key=lambda e: e.name):
            for model in ep.models:
                if model in by_model:
                    logger.warning(
                        "model %r is served by both %s and %s; routing it to %s",
                        model,
                        by_model[model].name,
                        ep.name,
                        by_model[model].name,
                    )
                    continue
                by_model[model] = ep
        self._by_model = by_model

    def _held_changed(self, name: str, n: int) -> None:
        self.metrics.held.labels(name).set(n)
        ep = self.endpoints.get(name)
        # The queue's signals name the endpoint by namespace and name.
        self.on_held(ep.id if ep is not None else f"{DEFAULT_NAMESPACE}/{name}", n)

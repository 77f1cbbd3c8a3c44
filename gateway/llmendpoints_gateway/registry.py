"""What the gateway knows: endpoints, the models they serve, their ready replicas, and the
gateway's own in-flight count per replica. Discovery (static file or Kubernetes) writes it; the
request path reads it. Single event loop: no locks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from llmendpoints_gateway.holding import HoldQueue, hold_timeout
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
    ready: tuple[str, ...] = ()  # what requests are routed to: discovered, not suspended
    discovered: frozenset[str] = frozenset()
    suspended: set[str] = field(default_factory=set)
    loads: dict[str, int] = field(default_factory=dict)
    # The registry's key and the `endpoint` label of its metrics: "<namespace>/<name>" for a
    # discovered endpoint (DECISIONS §2), the name for a static one.
    id: str = ""
    namespace: str | None = None
    # replica URL -> its name in metric labels (a pod name; default: host:port).
    replica_names: dict[str, str] = field(default_factory=dict)
    # spec.engine.startupTimeoutSeconds of a discovered endpoint: its holds last at least that
    # (holding.hold_timeout).
    startup_timeout: float | None = None

    def hold_seconds(self, setting: float) -> float:
        return hold_timeout(setting, self.startup_timeout)

    def replica_label(self, replica: str) -> str:
        return self.replica_names.get(replica) or replica.split("://", 1)[-1]

    def choose(
        self, key: bytes | None, exclude: frozenset[str] = frozenset()
    ) -> tuple[str, Outcome] | None:
        return self.router.choose(key, self.loads, exclude)


class Registry:
    def __init__(
        self,
        metrics: GatewayMetrics,
        hold_queue_length: int,
        load_factor: float,
        on_held: Callable[[str, int], None] = lambda endpoint, n: None,
    ):
        self.metrics = metrics
        self.hold_queue_length = hold_queue_length
        self.load_factor = load_factor
        self.on_held = on_held
        self.endpoints: dict[str, Endpoint] = {}
        self._by_model: dict[str, Endpoint] = {}
        self.closed = False

    # -- reads (request path) --

    def by_model(self, model: str) -> Endpoint | None:
        return self._by_model.get(model)

    def get(self, ref: str) -> Endpoint | None:
        """By id; or `<name>.<namespace>` (split at the last dot); or a bare name served in
        exactly one namespace (docs/contracts.md)."""
        ep = self.endpoints.get(ref)
        if ep is not None:
            return ep
        name, _, namespace = ref.rpartition(".")
        if name and namespace:
            ep = self.endpoints.get(f"{namespace}/{name}")
            if ep is not None:
                return ep
        same = [e for e in self.endpoints.values() if e.name == ref]
        return same[0] if len(same) == 1 else None

    def in_flight(self) -> int:
        return sum(sum(ep.loads.values()) for ep in self.endpoints.values())

    def held(self) -> int:
        return sum(len(ep.hold) for ep in self.endpoints.values())

    # -- writes (discovery) --

    def upsert(
        self,
        id: str,
        models: Iterable[str],
        strategy: Strategy,
        *,
        namespace: str | None = None,
        name: str | None = None,
        startup_timeout: float | None = None,
    ) -> Endpoint:
        models = tuple(dict.fromkeys(models))
        ep = self.endpoints.get(id)
        if ep is None:
            metrics = self.metrics
            hold = HoldQueue(
                name or id,
                self.hold_queue_length,
                on_change=lambda n: self._held_changed(id, name or id, n),
                on_reject=lambda reason: metrics.hold_rejected.labels(id, reason).inc(),
                on_held=lambda seconds, outcome: metrics.held_for(id, seconds, outcome),
            )
            ep = Endpoint(
                name or id, models, Router(strategy, self.load_factor), hold, id=id,
                namespace=namespace,
            )  # fmt: skip
            if self.closed:
                hold.close()
            self.endpoints[id] = ep
            self.metrics.ready_replicas.labels(id).set(0)  # an endpoint at zero is seen too
            logger.info("endpoint %s: models %s, routing %s", id, list(models), strategy)
        else:
            if ep.models != models or ep.router.strategy is not strategy:
                logger.info("endpoint %s: models %s, routing %s", id, list(models), strategy)
            ep.models = models
            ep.router.strategy = strategy
        ep.startup_timeout = startup_timeout
        self._index()
        return ep

    def remove(self, id: str) -> None:
        ep = self.endpoints.pop(id, None)
        if ep is None:
            return
        ep.hold.close()
        self.metrics.forget_endpoint(id, tuple(ep.replica_label(r) for r in ep.loads))
        self._index()
        logger.info("endpoint %s removed", id)

    def set_ready(
        self, id: str, replicas: Iterable[str], names: Mapping[str, str] | None = None
    ) -> None:
        """Discovery's view: these replicas (URLs) of the endpoint are ready; `names` gives
        their names (pods) for metric labels."""
        ep = self.endpoints.get(id)
        if ep is None:
            return
        ep.discovered = frozenset(replicas)
        if names:
            ep.replica_names.update(names)
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
        logger.info("endpoint %s: %d ready replica(s) %s", ep.id, len(ready), list(ready))
        for gone in set(ep.ready) - set(ready):
            self._forget_if_departed(ep, gone)
        ep.ready = ready
        ep.router.set_replicas(ready)
        self.metrics.ready_replicas.labels(ep.id).set(len(ready))
        if ready:
            ep.hold.release_all()

    def _forget_if_departed(self, ep: Endpoint, replica: str) -> None:
        """A replica no longer discovered and with nothing outstanding: drop its series (and
        its name). A suspended replica stays: it is still there, only routed around."""
        if replica in ep.discovered or ep.loads.get(replica):
            return
        self.metrics.forget_replica(ep.id, ep.replica_label(replica))
        ep.replica_names.pop(replica, None)

    def close(self) -> None:
        """Shutting down: held requests get 503 now; nothing is held from here on."""
        self.closed = True
        for ep in self.endpoints.values():
            ep.hold.close()

    # -- load accounting --

    def acquire(self, ep: Endpoint, replica: str) -> None:
        n = ep.loads.get(replica, 0) + 1
        ep.loads[replica] = n
        self.metrics.set_in_flight(ep.id, ep.replica_label(replica), n)

    def release(self, ep: Endpoint, replica: str) -> None:
        n = ep.loads.get(replica, 1) - 1
        if n <= 0:
            ep.loads.pop(replica, None)
            n = 0
        else:
            ep.loads[replica] = n
        self.metrics.set_in_flight(ep.id, ep.replica_label(replica), n)
        if n == 0 and replica not in ep.ready:
            self._forget_if_departed(ep, replica)  # its last request ended after it left

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

    def _held_changed(self, id: str, name: str, n: int) -> None:
        self.metrics.held.labels(id).set(n)
        # The queue's signal subjects still carry the bare name (the tenancy work moves them
        # to namespace + name, DECISIONS §2).
        self.on_held(name, n)

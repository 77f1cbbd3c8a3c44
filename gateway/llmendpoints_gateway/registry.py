"""What the gateway knows: endpoints, the models they serve, their ready replicas, and the
gateway's own in-flight count per replica. Discovery (static file or Kubernetes) writes it; the
request path reads it. Single event loop: no locks.

An endpoint is ``<namespace>/<name>`` (``llmendpoints_common.identity``): the registry's key,
its ``endpoint`` metric label, its identity in the shared queue. Two same-named endpoints in two
namespaces are two endpoints. A served model name belongs to one endpoint, the oldest claimant
(``llmendpoints_common.model_names.claim_order``: creation time, then ``<namespace>/<name>``;
static endpoints: file order); a later one is not routed to for that name (the operator reports
it on the newcomer's status, from the same rule).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from llmendpoints_common.identity import DEFAULT_NAMESPACE
from llmendpoints_common.model_names import claim_order

from llmendpoints_gateway.holding import HoldBudget, HoldQueue, hold_timeout
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
    # replica URL -> its name in metric labels (a pod name; default: host:port).
    replica_names: dict[str, str] = field(default_factory=dict)
    # spec.engine.startupTimeoutSeconds of a discovered endpoint: its holds last at least that
    # (holding.hold_timeout).
    startup_timeout: float | None = None
    # When it was created (epoch seconds; None: unknown): the oldest claimant keeps a model name.
    created: float | None = None

    @property
    def id(self) -> str:
        """``<namespace>/<name>``: the registry's key, the metric label, the queue's identity."""
        return f"{self.namespace}/{self.name}"

    def hold_seconds(self, setting: float) -> float:
        return hold_timeout(setting, self.startup_timeout)

    def replica_label(self, replica: str) -> str:
        return self.replica_names.get(replica) or replica.split("://", 1)[-1]

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
        self.on_held = on_held  # (endpoint id, requests held): the queue's held signal
        self.endpoints: dict[str, Endpoint] = {}
        self._by_model: dict[str, Endpoint] = {}
        # model -> (the endpoint routed to, the later claimants refused)
        self.model_claims: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.closed = False

    # -- reads (request path) --

    def by_model(self, model: str) -> Endpoint | None:
        return self._by_model.get(model)

    def get(self, ref: str) -> Endpoint | None:
        """The endpoint a client names: ``<namespace>/<name>``; ``<name>.<namespace>`` (split at
        the last dot: a namespace has none), which always works; or a bare ``<name>`` served in
        exactly one namespace. The qualified reading wins (docs/contracts.md)."""
        ep = self.endpoints.get(ref)
        if ep is not None:
            return ep
        name, _, namespace = ref.rpartition(".")
        if name and namespace:
            ep = self.endpoints.get(f"{namespace}/{name}")
            if ep is not None:
                return ep
        return self.by_unique_name(ref)

    def by_id(self, endpoint_id: str) -> Endpoint | None:
        return self.endpoints.get(endpoint_id)

    def address(self, ep: Endpoint) -> str:
        """How a client names ``ep`` in ``/v2/{endpoint}/...``: its bare name while no other
        namespace has an endpoint of that name, else ``<name>.<namespace>``."""
        return ep.name if self.by_unique_name(ep.name) is ep else f"{ep.name}.{ep.namespace}"

    def by_unique_name(self, name: str) -> Endpoint | None:
        """The one endpoint named ``name``, if no other namespace has one of that name."""
        same = [e for e in self.endpoints.values() if e.name == name]
        return same[0] if len(same) == 1 else None

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
        *,
        namespace: str = DEFAULT_NAMESPACE,
        startup_timeout: float | None = None,
        created: float | None = None,
    ) -> Endpoint:
        """``created``: the endpoint's creation time (epoch seconds; Kubernetes), or for static
        endpoints their position in the file (so the first entry listing a model keeps it);
        None when unknown (such an endpoint keeps a model name from no endpoint of known age)."""
        models = tuple(dict.fromkeys(models))
        endpoint_id = f"{namespace}/{name}"
        ep = self.endpoints.get(endpoint_id)
        if ep is None:
            metrics = self.metrics
            hold = HoldQueue(
                endpoint_id,
                self.hold_queue_length,
                on_change=lambda n: self._held_changed(endpoint_id, n),
                on_reject=lambda reason: metrics.hold_rejected.labels(endpoint_id, reason).inc(),
                key_share=self.hold_key_share,
                budget=self.hold_budget,
                on_held=lambda seconds, outcome: metrics.held_for(endpoint_id, seconds, outcome),
            )
            ep = Endpoint(
                name, models, Router(strategy, self.load_factor), hold, namespace, created=created
            )  # fmt: skip
            if self.closed:
                hold.close()
            self.endpoints[endpoint_id] = ep
            self.metrics.ready_replicas.labels(endpoint_id).set(0)  # one at zero is seen too
            logger.info("endpoint %s: models %s, routing %s", endpoint_id, list(models), strategy)
        else:
            if ep.models != models or ep.router.strategy is not strategy:
                logger.info(
                    "endpoint %s: models %s, routing %s", endpoint_id, list(models), strategy
                )
            ep.models = models
            ep.router.strategy = strategy
            ep.created = created
        ep.startup_timeout = startup_timeout
        self._index()
        return ep

    def remove(self, endpoint_id: str) -> None:
        ep = self.endpoints.pop(endpoint_id, None)
        if ep is None:
            return
        ep.hold.close()
        self.metrics.forget_endpoint(endpoint_id, tuple(ep.replica_label(r) for r in ep.loads))
        self._index()
        logger.info("endpoint %s removed", endpoint_id)

    def set_ready(
        self, endpoint_id: str, replicas: Iterable[str], names: Mapping[str, str] | None = None
    ) -> None:
        """Discovery's view: these replicas (URLs) of the endpoint are ready; ``names`` gives
        their names (pods) for metric labels."""
        ep = self.endpoints.get(endpoint_id)
        if ep is None:
            return
        ep.discovered = frozenset(replicas)
        if names:
            ep.replica_names.update(names)
        self._publish(ep)

    def mark_failed(self, endpoint_id: str, replica: str) -> None:
        """A replica refused or reset a connection: route around it for SUSPEND_SECONDS, then
        trust discovery again (a pod that is really gone leaves its EndpointSlice, a static
        backend fails its probe)."""
        ep = self.endpoints.get(endpoint_id)
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
        past ``ep.hold_seconds(hold_timeout)``, over ``key``'s share or the byte budget with
        its ``size``, or shutting down; ClientGone when ``gone()`` completes first); the chosen
        replica carries the request in its load until the block ends. A retry passes the
        replicas already tried as ``exclude``: NoReplicaLeft when none is left."""
        while True:
            choice = ep.choose(prefix, exclude=exclude)
            if choice is not None:
                break
            if exclude:
                raise NoReplicaLeft()
            await ep.hold.wait(ep.hold_seconds(hold_timeout), gone(), key=key, size=size)
        replica, outcome = choice
        if exclude:
            outcome = Outcome.RETRY
        self.metrics.routing.labels(ep.id, outcome).inc()
        self.acquire(ep, replica)
        try:
            yield Lease(replica, outcome)
        finally:
            self.release(ep, replica)

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
        """Each model name to its oldest claimant; the later ones are remembered, refused."""
        by_model: dict[str, Endpoint] = {}
        refused: dict[str, list[str]] = {}
        for ep in sorted(self.endpoints.values(), key=lambda e: claim_order(e.created, e.id)):
            for model in ep.models:
                if model in by_model:
                    refused.setdefault(model, []).append(ep.id)
                    continue
                by_model[model] = ep
        claims = {model: (by_model[model].id, tuple(refused.get(model, ()))) for model in by_model}
        for model, (owner, later) in claims.items():
            if later and self.model_claims.get(model) != (owner, later):
                logger.warning(
                    "model %r is served by %s; not routed to %s (a model name belongs to the "
                    "endpoint that claimed it first)",
                    model,
                    owner,
                    ", ".join(later),
                )
        self._by_model = by_model
        self.model_claims = claims

    def _held_changed(self, endpoint_id: str, n: int) -> None:
        self.metrics.held.labels(endpoint_id).set(n)
        self.on_held(endpoint_id, n)

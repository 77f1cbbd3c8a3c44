"""What the gateway knows: endpoints, the models they serve, their ready replicas, and the
gateway's own in-flight count per replica. Discovery (static file or Kubernetes) writes it; the
request path reads it. Single event loop: no locks.

An endpoint is ``<namespace>/<name>`` (``llmendpoints_common.identity``): the registry's key,
its ``endpoint`` metric label, its identity in the shared queue. Two same-named endpoints in two
namespaces are two endpoints. A served model name belongs to one endpoint, the oldest claimant
(``llmendpoints_common.model_names.claim_order``: creation time, then ``<namespace>/<name>``;
static endpoints: file order); a later one is not routed to for that name (the operator reports
it on the newcomer's status, from the same rule).

Routing (``lease``): ``prefix-aware`` endpoints are scored (scoring.choose) over what this process
knows of each ready replica -- the prompt blocks it sent there (the endpoint's PrefixIndex), the
engine's own load (pod_reader.PodReader, one reader per gateway pod, fed back through
``engine_sampled``), this process's in-flight requests and those sent since the engine's last
sample; round-robin and least-loaded go through routing.Router as before.

Activity (``pod_board.Activity``): an endpoint is busy while this process has a request of it in
flight or held; the pod's reader reads the engines of active endpoints only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmendpoints_common.identity import DEFAULT_NAMESPACE
from llmendpoints_common.model_names import claim_order

from llmendpoints_gateway.engine_load import EngineLoad, hit_rate
from llmendpoints_gateway.holding import HoldBudget, HoldQueue, hold_timeout
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.pod_board import Activity, slot_of
from llmendpoints_gateway.prefix_index import PrefixIndex, RouteLog, block_hashes, render_prompt
from llmendpoints_gateway.routing import Outcome, Router, Strategy, hash64, home_key
from llmendpoints_gateway.scoring import DEFAULT_WEIGHTS, Candidate, Reason, Weights, choose

logger = logging.getLogger("llmendpoints.gateway.registry")

# How long a replica that refused a connection is routed around.
SUSPEND_SECONDS = 2.0
# The moving average of a routed request's uncached blocks (scoring's "typical" request).
TYPICAL_WEIGHT = 0.1

_OUTCOME = {
    Reason.AFFINITY: Outcome.AFFINITY,
    Reason.SPILL: Outcome.SPILLED,
    Reason.LOAD: Outcome.LOAD,
    Reason.ADAPTER: Outcome.ADAPTER,
}


@dataclass(frozen=True)
class RouteKey:
    """What a prefix-aware endpoint routes a request by (computed once, before any hold)."""

    model: str
    blocks: tuple[int, ...]  # prefix_index.block_hashes of its rendered prompt
    chars: int  # the rendered prompt's length: with prompt_tokens, the characters per token
    ring: int | None  # hash of routing.home_key: its home on the ring (scoring's ``home``)

    @classmethod
    def of(cls, path: str, payload: Mapping[str, Any], chunk_chars: int) -> RouteKey:
        model = payload.get("model")
        model = model if isinstance(model, str) else ""
        text = render_prompt(path, payload)
        blocks = () if text is None else tuple(block_hashes(model, text, chunk_chars))
        key = home_key(path, payload)
        return cls(model, blocks, len(text or ""), None if key is None else hash64(key))


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
    # Prefix-aware routing: the prompt blocks this process sent to each replica, a typical
    # request's uncached blocks (moving average), and per replica the requests sent since its
    # engine's last sample (not in that sample's numbers yet).
    index: PrefixIndex = field(default_factory=PrefixIndex)
    typical: float = 1.0
    sent_since: dict[str, int] = field(default_factory=dict)
    # replica URL -> its control port's base URL (Kubernetes: the EndpointSlice's `control`).
    controls: dict[str, str] = field(default_factory=dict)
    in_flight: int = 0  # this process's requests of the endpoint now (the sum of loads)

    def __post_init__(self) -> None:
        self.slot = slot_of(self.id)  # its activity slot (pod_board.Activity)

    @property
    def id(self) -> str:
        """``<namespace>/<name>``: the registry's key, the metric label, the queue's identity."""
        return f"{self.namespace}/{self.name}"

    def hold_seconds(self, setting: float) -> float:
        return hold_timeout(setting, self.startup_timeout)

    def replica_label(self, replica: str) -> str:
        return self.replica_names.get(replica) or replica.split("://", 1)[-1]


@dataclass(frozen=True)
class Lease:
    """A replica chosen for one request, counted in its load while the lease is held."""

    replica: str
    outcome: Outcome


class EngineLoads(Protocol):
    """Where the scorer finds each replica's latest engine sample (pod_reader.PodReader)."""

    def get(self, replica: str) -> EngineLoad | None: ...


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
        weights: Weights = DEFAULT_WEIGHTS,
        count_engine_hits: bool = True,
        share_routes: bool = False,
        activity: Activity | None = None,
    ):
        self.metrics = metrics
        # Which endpoints have work (None: not tracked; every replica counts as active).
        self.activity = activity
        self.weights = weights
        # The engines' own prefix-cache counters are counted by one process of a pod only (the
        # other workers see the same engines: their metrics are summed).
        self.count_engine_hits = count_engine_hits
        # Each ready replica's engine load (the pod reader, set by the composition root: it is
        # built on this registry; None: not read, the scorer weighs this process's in-flight
        # requests alone).
        self.feed: EngineLoads | None = None
        # With ``share_routes``: (endpoint id, replica, blocks) of every prefix-aware request
        # routed, for the other gateway processes (route_sharing.py publishes it; theirs come
        # back through apply_shared).
        self.routed = RouteLog() if share_routes else None
        self.hold_queue_length = hold_queue_length
        self.hold_key_share = hold_key_share
        self.hold_budget = HoldBudget(hold_max_bytes)
        self.load_factor = load_factor
        self.on_held = on_held  # (endpoint id, requests held): the queue's held signal
        self.endpoints: dict[str, Endpoint] = {}
        self._by_model: dict[str, Endpoint] = {}
        # name -> the one endpoint of that name, for names no other namespace has (by_unique_name
        # on every request's access check: kept with the endpoints, not searched each time).
        self._unique_names: dict[str, Endpoint] = {}
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
        return self._unique_names.get(name)

    def in_flight(self) -> int:
        return sum(sum(ep.loads.values()) for ep in self.endpoints.values())

    def held(self) -> int:
        return sum(len(ep.hold) for ep in self.endpoints.values())

    def route_key(self, ep: Endpoint, path: str, payload: Mapping[str, Any]) -> RouteKey | None:
        """What ``ep`` routes the request by: a RouteKey for a prefix-aware endpoint, else
        None (round-robin and least-loaded look at no prompt)."""
        if ep.router.strategy is not Strategy.PREFIX_AWARE:
            return None
        return RouteKey.of(path, payload, ep.index.chunk_chars)

    # -- the engines' load (pod_reader.PodReader) --

    def engine_targets(self) -> list[str]:
        """The replicas whose engines the reader reads: every endpoint's discovered ones."""
        return sorted({r for ep in self.endpoints.values() for r in ep.discovered})

    def control_url(self, replica: str) -> str | None:
        """The control port of ``replica``'s pod, when discovery knows it."""
        for ep in self.endpoints.values():
            control = ep.controls.get(replica)
            if control is not None:
                return control
        return None

    def active_replicas(self, now: float) -> set[str]:
        """The discovered replicas of endpoints with work in any process of this gateway pod
        now, or within the activity's grace (every one when activity is not tracked)."""
        activity = self.activity
        return {
            r
            for ep in self.endpoints.values()
            if activity is None or activity.active(ep.slot, now)
            for r in ep.discovered
        }

    def engine_sampled(self, replica: str, previous: EngineLoad | None, new: EngineLoad) -> None:
        """A fresh sample of ``replica``'s engine: what this process sent it since is in the
        engine's numbers now; its KV capacity sizes the index; its prefix-cache counters move."""
        hits, queries = hit_rate(previous, new) if previous is not None else (0.0, 0.0)
        for ep in self.endpoints.values():
            if replica not in ep.discovered:
                continue
            ep.sent_since.pop(replica, None)
            ep.index.set_kv_tokens(replica, new.kv_tokens)
            if self.count_engine_hits and queries > 0:
                self.metrics.engine_prefix_cache(ep.id, hits, queries)

    def apply_shared(self, endpoint_id: str, replica: str, blocks: list[int]) -> None:
        """Another gateway process sent ``blocks`` to ``replica``: this index learns it too
        (for a replica this process knows; a departed one's records are dropped)."""
        ep = self.endpoints.get(endpoint_id)
        if ep is not None and replica in ep.discovered and blocks:
            ep.index.record(replica, blocks)

    def observe_prompt(self, endpoint_id: str | None, chars: int, prompt_tokens: int) -> None:
        """Metering saw a request's prompt_tokens: learn the endpoint's characters per token
        (it sizes what the index believes each engine can hold)."""
        ep = self.endpoints.get(endpoint_id or "")
        if ep is not None:
            ep.index.observe_chars_per_token(chars, prompt_tokens)

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
        cold_start: float | None = None,
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
                name, models, Router(strategy), hold, namespace, created=created
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
        ep.hold.cold_start = cold_start  # status.coldStart.last: the Retry-After of refusals
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
        self,
        endpoint_id: str,
        replicas: Iterable[str],
        names: Mapping[str, str] | None = None,
        controls: Mapping[str, str] | None = None,
    ) -> None:
        """Discovery's view: these replicas (URLs) of the endpoint are ready; ``names`` gives
        their names (pods) for metric labels, ``controls`` their control ports' URLs."""
        ep = self.endpoints.get(endpoint_id)
        if ep is None:
            return
        ep.discovered = frozenset(replicas)
        if names:
            ep.replica_names.update(names)
        if controls is not None:
            ep.controls = {r: c for r, c in controls.items() if r in ep.discovered}
        # A replica that left took its cache with it (a suspended one keeps its index entries:
        # it is still discovered).
        ep.index.retain(ep.discovered)
        for gone in [r for r in ep.sent_since if r not in ep.discovered]:
            del ep.sent_since[gone]
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

    def lease(
        self,
        ep: Endpoint,
        route: RouteKey | None,
        *,
        hold_timeout: float,
        gone: Callable[[], Awaitable[object]],
        exclude: frozenset[str] = frozenset(),
        key: str = "",
        size: int = 0,
        on_hold: Callable[[], None] | None = None,
    ) -> _Leasing:
        """A replica of ``ep`` for one request (KubeAI's ``getBestAddr`` and its ``done``), as
        ``async with registry.lease(...) as lease``: while the endpoint has none ready the
        request is held (``HoldQueue``: 503 when full, past ``ep.hold_seconds(hold_timeout)``,
        over ``key``'s share or the byte budget with its ``size``, or shutting down; ClientGone
        when ``gone()`` completes first); the chosen replica carries the request in its load
        until the block ends. A retry passes the replicas already tried as ``exclude``:
        NoReplicaLeft when none is left. ``route``: what a prefix-aware endpoint scores
        replicas by (``route_key``). ``on_hold()`` is called when the request starts waiting
        (a held stream's keep-alive, held_stream.py)."""
        return _Leasing(self, ep, route, hold_timeout, gone, exclude, key, size, on_hold)

    async def _take(
        self,
        ep: Endpoint,
        route: RouteKey | None,
        hold_timeout: float,
        gone: Callable[[], Awaitable[object]],
        exclude: frozenset[str],
        key: str,
        size: int,
        on_hold: Callable[[], None] | None,
    ) -> Lease:
        while True:
            choice = self.choose(ep, route, exclude)
            if choice is not None:
                break
            if exclude:
                raise NoReplicaLeft()
            if on_hold is not None:
                on_hold()
            await ep.hold.wait(ep.hold_seconds(hold_timeout), gone(), key=key, size=size)
        replica, outcome = choice
        if exclude:
            outcome = Outcome.RETRY
        self.metrics.routed(ep.id, outcome)
        self.acquire(ep, replica)
        ep.sent_since[replica] = ep.sent_since.get(replica, 0) + 1
        return Lease(replica, outcome)

    def choose(
        self, ep: Endpoint, route: RouteKey | None, exclude: frozenset[str] = frozenset()
    ) -> tuple[str, Outcome] | None:
        """The replica for one request (None: no ready replica left), and how it was chosen.
        Prefix-aware: scored, then its blocks recorded as the chosen replica's."""
        if ep.router.strategy is not Strategy.PREFIX_AWARE or ep.router.ring is None:
            return ep.router.choose(ep.loads, exclude)
        if route is None:  # the endpoint turned prefix-aware while the request was held
            route = RouteKey("", (), 0, None)
        now = time.monotonic()
        feed = self.feed
        candidates = []
        for replica in ep.ready:
            if replica in exclude:
                continue
            load = feed.get(replica) if feed is not None else None
            candidates.append(
                Candidate(
                    replica,
                    ep.loads.get(replica, 0),
                    None if load is None else load.state(now),
                    ep.sent_since.get(replica, 0),
                )
            )
        if not candidates:
            return None
        blocks = route.blocks
        choice = choose(
            candidates,
            len(blocks),
            ep.index.longest_match(blocks),
            typical_blocks=ep.typical,
            adapter=self._adapter(route.model, candidates),
            load_factor=self.load_factor,
            weights=self.weights,
            home=ep.router.ring.walk(route.ring) if route.ring is not None else (),
        )
        assert choice is not None
        chosen = next(s for s in choice.scores if s.replica == choice.replica)
        ep.typical += TYPICAL_WEIGHT * (max(chosen.uncached, 1) - ep.typical)
        if blocks:
            ep.index.record(choice.replica, blocks)
            self.metrics.prefix_index(ep.id, chosen.matched, len(blocks))
            if self.routed is not None:
                self.routed.add(ep.id, choice.replica, blocks)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("endpoint %s: %s", ep.id, choice.log_line())
        return choice.replica, _OUTCOME[choice.reason]

    def _adapter(self, model: str, candidates: list[Candidate]) -> str | None:
        """``model`` when some replica's engine reports it as a LoRA adapter (active in its
        batches, or loaded by the pod): then replicas that have it active are preferred."""
        if not model or self.feed is None:
            return None
        for c in candidates:
            load = self.feed.get(c.replica)
            if load is not None and (model in load.active_adapters or model in load.ready_adapters):
                return model
        return None

    # -- load accounting --

    def acquire(self, ep: Endpoint, replica: str) -> None:
        n = ep.loads.get(replica, 0) + 1
        ep.loads[replica] = n
        ep.in_flight += 1
        if self.activity is not None:
            self.activity.busy(ep.slot)
        self.metrics.set_in_flight(ep.id, ep.replica_label(replica), n)

    def release(self, ep: Endpoint, replica: str) -> None:
        ep.in_flight -= 1
        if ep.in_flight <= 0 and self.activity is not None and not len(ep.hold):
            self.activity.idle(ep.slot, time.monotonic())
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
        """Each model name to its oldest claimant; the later ones are remembered, refused. And
        each endpoint name no other namespace has, to its endpoint."""
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
        named: dict[str, list[Endpoint]] = {}
        for ep in self.endpoints.values():
            named.setdefault(ep.name, []).append(ep)
        self._unique_names = {name: eps[0] for name, eps in named.items() if len(eps) == 1}

    def _held_changed(self, endpoint_id: str, n: int) -> None:
        self.metrics.held.labels(endpoint_id).set(n)
        self.on_held(endpoint_id, n)
        ep = self.endpoints.get(endpoint_id)
        if ep is not None and self.activity is not None:
            if n > 0:
                self.activity.busy(ep.slot)  # the reader probes a replica that is coming
            elif ep.in_flight <= 0:
                self.activity.idle(ep.slot, time.monotonic())


class _Leasing:
    """``Registry.lease``'s context: the lease taken on entry, released on exit (a class, not
    ``contextlib.asynccontextmanager``, which makes a generator and a wrapper object per request
    for the same two steps)."""

    __slots__ = ("_args", "_ep", "_lease", "_registry")

    def __init__(self, registry: Registry, ep: Endpoint, *args: Any) -> None:
        self._registry = registry
        self._ep = ep
        self._args = args
        self._lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        self._lease = await self._registry._take(self._ep, *self._args)
        return self._lease

    async def __aexit__(self, *exc_info: object) -> None:
        if self._lease is not None:
            self._registry.release(self._ep, self._lease.replica)

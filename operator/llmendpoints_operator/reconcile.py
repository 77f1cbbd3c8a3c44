"""The reconcile and the status publishing: one endpoint's children made to match its spec.

`Reconciler` is given everything it works with - the API client (kube.py's narrow interface),
kopf's in-memory indexes, the settings, an Event poster, its metrics, a clock - and keeps the
per-endpoint state that must outlive one call (locks, the last status written). handlers.py wires
it to kopf; tests drive it with a fake client and plain dicts as indexes.

- `reconcile` admits the spec (admission.admit: parse, managed variables, cluster policy), creates
  the endpoint's admin-key Secret once, applies every child with a fixed name and an owner reference,
  writes the workload's replicas only as manifests.replicas_to_write says, deletes the optional
  children the spec no longer asks for, and publishes the status.
- The workload is a Deployment, or for a multi-node endpoint a LeaderWorkerSet of groups
  (groups.py); a change of spec.resources.nodes between 1 and more replaces one with the other
  (the new one first, with the old one's replica count). The LeaderWorkerSet API is optional in a
  cluster: missing (or forbidden), it becomes the status's Ready=False reason, never a failed
  reconcile, and the endpoint's other children are written all the same.
- Idempotent: running it twice changes nothing. An invalid spec publishes the status
  (Ready=False/InvalidSpec naming the field), creates nothing, and raises InvalidSpecError; an
  API refusal raises kube.ApiError.
- The fit check (fit/checker.py) runs on every reconcile, beside the children's writes: a model
  that does not fit (ModelFits False) gets no workload (Deployment or LeaderWorkerSet) -- none is
  created, and an existing one, running the last spec that did fit, is left as it is (its pods
  keep serving; the new spec is not rolled out). Unknown rolls out. The check is bounded in time
  and never fails a reconcile.
- `publish_status` computes the status from the indexes (status.compute, pure) and writes it
  when it changed, posting Events for notable transitions.
- A served model name belongs to the oldest endpoint declaring it (llmendpoints_common.
  model_names, the gateway's rule too): the status's ModelNameAvailable condition says whether
  this endpoint keeps its name, from the model_claims index. `model_claims_changed` re-publishes
  the other claimants' status when an endpoint appears, renames its model or goes away, so a
  newcomer learns that it now keeps the name at once (the resync is the backstop).
- The InferencePool (manifests.build_inference_pool) is an optional child whose API may be
  missing: its outcome becomes the status's InferencePool condition, never a failed reconcile.
- `resync_forever` reconciles every endpoint once per period (drift correction).
- `AutoscaledSubjects` lists what the autoscaler decides the size of now.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import kopf
from llmendpoints_common import gateway_token
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.model_names import Claim, creation_time, owner, served_model_name
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

from llmendpoints_operator import groups, kube, manifests, status
from llmendpoints_operator.adapter_status import STATUS_KEY as ADAPTERS_KEY
from llmendpoints_operator.admission import AdmissionMemo, admit
from llmendpoints_operator.autoscaling.controller import STATUS_KEY as AUTOSCALING_KEY
from llmendpoints_operator.autoscaling.controller import Subject
from llmendpoints_operator.coldstart import children as coldstart
from llmendpoints_operator.coldstart.record import with_download
from llmendpoints_operator.coldstart.recorder import STATUS_KEY as COLD_START_KEY
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.events import PostEvent
from llmendpoints_operator.fit.checker import FitChecker
from llmendpoints_operator.fit.verdict import Fit
from llmendpoints_operator.jobs_queue import JobsQueue
from llmendpoints_operator.spec import Endpoint, InvalidSpecError

# status keys written by others (the autoscaler; the adapter watcher; the cold-start
# recorder), never by a reconcile
_OTHER_WRITERS = (AUTOSCALING_KEY, ADAPTERS_KEY, COLD_START_KEY)
logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, endpoint name)

# The Secrets the operator created for an endpoint (names, comma-separated), on the endpoint.
SECRETS_CREATED = "llmendpoints.dev/secrets-created"


def created_secrets(endpoint: Mapping[str, Any]) -> set[str]:
    annotations = (endpoint.get("metadata") or {}).get("annotations") or {}
    return {n for n in (annotations.get(SECRETS_CREATED) or "").split(",") if n}


class NotOurSecret(kube.Conflict):
    """A Secret the endpoint's pods would trust exists, and the operator did not make it."""

    def __init__(self, name: str, what: str):
        super().__init__(
            409,
            "SecretNotCreatedByOperator",
            f"Secret {name} ({what}) exists and was not created by the operator for this "
            "endpoint: its pods are not started with it. Delete it; the operator then creates "
            "its own.",
        )


# kopf.Index[K, V] is a Mapping of K to a collection of V; so is a dict of lists in tests.
Index = Mapping[Any, Collection[Any]]


class KubeApi(Protocol):
    """The part of kube.KubeClient the reconcile uses."""

    async def list(
        self, api_version: str, kind: str, namespace: str, *, label_selector: str
    ) -> list[dict[str, Any]]: ...

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]: ...

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool: ...


@dataclass(frozen=True)
class Indexes:
    """kopf's in-memory indexes (the @kopf.index functions in handlers.py)."""

    llmendpoints: Index  # Key -> snapshot(endpoint)
    runtime_deployments: Index  # Key -> status.DeploymentState
    claim_phases: Index  # (namespace, claim) -> phase
    claim_users: Index  # (namespace, claim) -> endpoint name
    model_claims: Index  # served model name -> model_names.Claim of each endpoint declaring it
    download_jobs: Index = field(default_factory=dict)  # Key -> its download Jobs (coldstart/)
    endpoint_pods: Index = field(default_factory=dict)  # Key -> its runtime and download pods
    # Key -> status.DeploymentState of the endpoint's LeaderWorkerSet (multi-node endpoints)
    runtime_groups: Index = field(default_factory=dict)

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> Indexes:
        """The indexes kopf passes to every handler as keyword arguments (by function name)."""
        return cls(**{name: kwargs[name] for name in cls.__dataclass_fields__})

    def endpoint(self, key: Key) -> dict[str, Any] | None:
        return _one(self.llmendpoints, key)

    def deployment(self, key: Key) -> status.DeploymentState | None:
        return _one(self.runtime_deployments, key)

    def groups(self, key: Key) -> status.DeploymentState | None:
        return _one(self.runtime_groups, key)

    def workload(self, key: Key, multinode: bool) -> status.DeploymentState | None:
        """The state of the workload of the kind the spec asks for."""
        return self.groups(key) if multinode else self.deployment(key)


def _one(index: Index, key: Any) -> Any:
    store = index.get(key)
    return next(iter(store), None) if store else None


# creationTimestamp: who keeps a served model name (model_name).
_SNAPSHOT_METADATA = (
    "name", "namespace", "uid", "generation", "labels", "creationTimestamp", "deletionTimestamp"
)  # fmt: skip


def snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    """What is needed to reconcile or publish an endpoint outside its own handlers."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion", manifests.API_VERSION),
        "kind": body.get("kind", manifests.KIND),
        "metadata": {key: meta[key] for key in _SNAPSHOT_METADATA if key in meta},
        # No copies: kopf parses every watch event into fresh dicts and never mutates them.
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }


def lenient_nodes(raw_spec: Mapping[str, Any] | None) -> int:
    """spec.resources.nodes read from a spec that may be invalid (1 when it cannot be read)."""
    resources = (raw_spec or {}).get("resources") if isinstance(raw_spec, Mapping) else None
    nodes = resources.get("nodes", 1) if isinstance(resources, Mapping) else 1
    return nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 0 else 1


def lenient_cache_state(
    name: str, raw_spec: Mapping[str, Any], phases: Mapping[str, str]
) -> status.CacheState:
    """Read leniently from the raw spec: an invalid spec still reports its last cache volume."""
    cache = raw_spec.get("cache") if isinstance(raw_spec, Mapping) else None
    if not isinstance(cache, Mapping) or not (cache.get("existingClaim") or cache.get("size")):
        return status.CacheState()
    existing = cache.get("existingClaim")
    claim = str(existing) if existing else manifests.cache_claim_name(name)
    return status.CacheState(claim_name=claim, phase=phases.get(claim), existing=bool(existing))


def _nulling(previous: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`new` as a merge patch over `previous`: inside objects both have (status.groups and its
    lastFailure), the keys `new` no longer has are nulled (a merge patch merges nested objects;
    lists it replaces)."""
    out = dict(new)
    for key, value in new.items():
        old = previous.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            out[key] = {**dict.fromkeys(k for k in old if k not in value), **_nulling(old, value)}
    return out


class _ClaimPhases(Mapping[str, str]):
    """Claim name -> phase for one namespace, read from the claim_phases index."""

    def __init__(self, index: Index, namespace: str):
        self._index, self._namespace = index, namespace

    def __getitem__(self, claim: str) -> str:
        value = _one(self._index, (self._namespace, claim))
        if value is None:
            raise KeyError(claim)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(claim for ns, claim in self._index if ns == self._namespace)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ReconcileMetrics:
    """The reconcile's own Prometheus metrics (docs/operator.md, "Metrics")."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # process-wide: no `_created` series (nothing reads them)
        registry = registry or CollectorRegistry(auto_describe=True)
        self.reconciles = Counter(
            "llmendpoints_operator_reconciles_total",
            "Reconciles of LLMEndpoints, by trigger and result (ok, invalid, error).",
            ["trigger", "result"],
            registry=registry,
        )
        self.seconds = Histogram(
            "llmendpoints_operator_reconcile_duration_seconds",
            "Wall time of one reconcile, including its API requests.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Reconciler:
    def __init__(
        self,
        *,
        kube: Callable[[], KubeApi],
        indexes: Indexes,
        settings: OperatorSettings,
        post_event: PostEvent,
        metrics: ReconcileMetrics | None = None,
        clock: Callable[[], datetime.datetime] = _utc_now,
        jobs_queue: JobsQueue | None = None,
        fit_checker: FitChecker | None = None,
    ) -> None:
        self._kube = kube
        self._jobs_queue = jobs_queue
        self._fit_checker = fit_checker
        self._gateway_token_secret = (
            gateway_token.read_secret(settings.gateway_token_secret_file)
            if settings.gateway_token_secret_file
            else None
        )
        self.indexes = indexes
        self._settings = settings
        self._post_event = post_event
        self._metrics = metrics or ReconcileMetrics()
        self._clock = clock
        self._reconcile_locks: defaultdict[Key, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._status_locks: defaultdict[Key, asyncio.Lock] = defaultdict(asyncio.Lock)
        # The last status written per endpoint: the watch stream may lag behind our own writes.
        self._published: dict[Key, dict[str, Any]] = {}
        # What the last reconcile did about each endpoint's InferencePool (status reports it).
        self._pools: dict[Key, status.InferencePoolState] = {}
        # Why the last reconcile could not write an endpoint's workload (no LeaderWorkerSet API).
        self._workload_problems: dict[Key, status.WorkloadProblem] = {}
        # Endpoints a child's event came for while they were being reconciled (child_changed).
        self._missed: set[Key] = set()
        # The last fit check of each endpoint (status.fit, ModelFits).
        self._fits: dict[Key, Fit] = {}
        # The served model name each endpoint declared when last seen (model_claims_changed).
        self._served: dict[Key, str] = {}
        # Secrets this process created, per endpoint (the annotation's record may not be in the
        # snapshot a reconcile gets yet: the watch event of our own patch comes later).
        self._created: defaultdict[Key, set[str]] = defaultdict(set)

    # --- the reconcile ------------------------------------------------------------------------

    async def reconcile(
        self, endpoint: Mapping[str, Any], *, prune: bool, logger: logging.Logger, trigger: str
    ) -> None:
        """Make the children match the spec, then publish the status.

        Raises InvalidSpecError (after publishing it) and kube.ApiError. `prune` deletes the
        optional children the spec no longer asks for (pointless on a new endpoint). `trigger`
        (create, update, resume, resync, deployment-deleted) labels the metrics."""
        started = time.perf_counter()
        result = "error"
        try:
            await self._reconcile(endpoint, prune=prune, logger=logger)
            result = "ok"
            await self._publish_missed(endpoint)
        except InvalidSpecError:
            result = "invalid"
            raise
        finally:
            self._metrics.reconciles.labels(trigger, result).inc()
            self._metrics.seconds.observe(time.perf_counter() - started)

    def reconciling(self, key: Key) -> bool:
        """A reconcile of this endpoint is running: it publishes the status when done, from the
        then-current indexes, so a publish triggered by a child's event now would be wasted."""
        lock = self._reconcile_locks.get(key)
        return lock is not None and lock.locked()

    async def child_changed(self, endpoint: Mapping[str, Any]) -> None:
        """A child's watch event: publish the status, or - while a reconcile runs, which
        publishes what it wrote - once more after it (the event may be newer than the write)."""
        meta = endpoint["metadata"]
        key = (meta["namespace"], meta["name"])
        if self.reconciling(key):
            self._missed.add(key)
            return
        await self.publish_status(endpoint)

    async def _publish_missed(self, endpoint: Mapping[str, Any]) -> None:
        meta = endpoint["metadata"]
        key = (meta["namespace"], meta["name"])
        if key in self._missed and not self.reconciling(key):
            self._missed.discard(key)
            await self.publish_status(self.indexes.endpoint(key) or endpoint)

    async def _reconcile(
        self, endpoint: Mapping[str, Any], *, prune: bool, logger: logging.Logger
    ) -> None:
        meta = endpoint["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        key = (namespace, name)
        generation = meta.get("generation")
        async with self._reconcile_locks[key]:
            try:
                ep = admit(name, namespace, endpoint.get("spec"), self._settings)
            except InvalidSpecError as exc:
                logger.warning("Invalid spec: %s", exc)
                await self.publish_status(endpoint, observed_generation=generation)
                raise

            client = self._kube()
            # The fit check reads the hub while the children are written (bounded in time).
            checking = asyncio.create_task(self._check_fit(ep))
            try:
                await self._ensure_admin_key(ep, endpoint, client, logger)
                await self._ensure_queue_creds(ep, endpoint, client, logger)
                await self._ensure_gateway_token(ep, endpoint, client, logger)
                children = manifests.build_children(ep, self._settings)
                kopf.adopt(children, owner=endpoint)
                for child in children:
                    await client.apply(child)
                fit = await checking
            finally:
                checking.cancel()
            if fit is not None:
                self._fits[key] = fit

            created, written = False, None
            if fit is not None and fit.refuses:
                # Nor pre-pulled or downloaded ahead: what exists stays until it fits or goes.
                logger.warning("Not rolled out, the model does not fit: %s", fit.message)
            else:
                await coldstart.reconcile(
                    ep, endpoint, client, self._settings, self.indexes.download_jobs.get(key, ()),
                    prune=prune, logger=logger,
                )  # fmt: skip
                created, written = await self._write_workload(ep, endpoint, client, logger)
            self._pools[key] = await self._reconcile_inference_pool(ep, endpoint, client, logger)

            if prune:
                wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
                for ref in manifests.optional_children(name):
                    if (ref.kind, ref.name) not in wanted and await client.delete(
                        ref.api_version, ref.kind, namespace, ref.name
                    ):
                        logger.info(
                            "Deleted %s %s: the spec no longer asks for it", ref.kind, ref.name
                        )

            await self._ensure_queue_consumers(ep, logger)
            if created:
                kinds = ", ".join(f"{c['kind']} {c['metadata']['name']}" for c in children)
                ref = groups.workload_ref(ep)
                self._post_event(
                    endpoint, "Normal", "Created", f"created {ref.kind} {ref.name}, {kinds}"
                )
            await self.publish_status(
                endpoint,
                observed_generation=generation,
                parsed=ep,
                # Fresher than the index, whose watch event for our write may not have come yet.
                deployment=status.workload_state(written) if written else None,
            )

    async def _check_fit(self, ep: Endpoint) -> Fit | None:
        if self._fit_checker is None:
            return None
        return await self._fit_checker.check(ep)

    async def _ensure_admin_key(
        self, ep: Endpoint, owner: Mapping[str, Any], client: KubeApi, logger: logging.Logger
    ) -> None:
        """Create the endpoint's admin-key Secret unless it exists (a 409): created once, never
        rotated or read back by a reconcile. Before the Deployment, whose pods mount it.

        A POST per reconcile rather than a read: the operator may create Secrets but not read
        them (its RBAC), so an existing one is known only by the API's Conflict."""
        secret = manifests.build_admin_key_secret(ep, secrets.token_urlsafe(32))
        await self._create_once(secret, owner, client, logger, "the endpoint's admin key")

    async def _ensure_gateway_token(
        self, ep: Endpoint, owner: Mapping[str, Any], client: KubeApi, logger: logging.Logger
    ) -> None:
        """The endpoint's gateway token (with the gateway's token secret): derived from the
        installation's secret and the endpoint's ``<namespace>/<name>``, what the gateway
        presents to its pods instead of a client's key. Created once, like the admin key."""
        if self._gateway_token_secret is None:
            return
        token = gateway_token.derive(self._gateway_token_secret, f"{ep.namespace}/{ep.name}")
        secret = manifests.build_gateway_token_secret(ep, token)
        await self._create_once(secret, owner, client, logger, "the gateway's token for its pods")

    async def _create_once(
        self,
        secret: dict[str, Any],
        owner: Mapping[str, Any],
        client: KubeApi,
        logger: logging.Logger,
        what: str,
    ) -> None:
        """Create a Secret the endpoint's pods trust unless the operator made it already.

        The operator may create Secrets, never read them (its RBAC), so an existing one is known
        only by the API's Conflict -- and one planted under that name before the endpoint
        existed (by anyone who may create Secrets in the namespace) would hand its author the
        endpoint's admin key or the gateway's word at its pods. So each Secret the operator
        creates is recorded on the endpoint (annotation ``SECRETS_CREATED``); a Conflict for a
        Secret not recorded is refused (NotOurSecret: an Event, retried until the Secret is
        deleted). Endpoints from before the record existed have their Deployment already: their
        Secrets were made by this operator, before it."""
        name = secret["metadata"]["name"]
        meta = owner["metadata"]
        key = (meta["namespace"], meta["name"])
        kopf.adopt(secret, owner=owner)
        try:
            await client.create(secret)
        except kube.Conflict:
            ours = self._created[key] | created_secrets(owner)
            if name in ours or self.indexes.deployment(key) or self.indexes.groups(key):
                return
            raise NotOurSecret(name, what) from None
        self._created[key].add(name)
        await client.patch(
            "llmendpoints.dev/v1alpha1",
            "LLMEndpoint",
            meta["namespace"],
            meta["name"],
            {"metadata": {"annotations": {SECRETS_CREATED: ",".join(
                sorted(self._created[key] | created_secrets(owner))
            )}}},
        )  # fmt: skip
        logger.info("Created Secret %s (%s)", name, what)

    async def _ensure_queue_creds(
        self, ep: Endpoint, owner: Mapping[str, Any], client: KubeApi, logger: logging.Logger
    ) -> None:
        """Create the endpoint's queue credential Secret unless it exists, before the
        Deployment whose pods read it: a creds file minted for this endpoint alone (with the
        queue's keys), else the password URL (kept out of the pod spec). Created once, like the
        admin key, and never read back: a Secret of that name that the operator did not make
        is refused by the pods (they check whom a creds file was minted for)."""
        if self._jobs_queue is None:
            return
        if self._jobs_queue.per_endpoint_credentials:
            ref = EndpointRef(ep.namespace, ep.name)
            secret = manifests.build_queue_creds_secret(
                ep, creds=self._jobs_queue.endpoint_creds(ref)
            )
        else:
            secret = manifests.build_queue_creds_secret(ep, url=self._jobs_queue.url)
        kopf.adopt(secret, owner=owner)
        try:
            await client.create(secret)
        except kube.Conflict:
            return
        logger.info(
            "Created Secret %s (the endpoint's queue credential)", secret["metadata"]["name"]
        )

    async def _ensure_queue_consumers(self, ep: Endpoint, logger: logging.Logger) -> None:
        """The endpoint's own queue -- its two streams, with this operator's bounds, its worker
        consumers and the gateway's usage consumer (the pods' credential may create none).
        Best effort: NATS down, or its storage fully reserved, does not fail the reconcile; the
        autoscaler's next read of the endpoint, or the next resync, creates them."""
        if self._jobs_queue is None:
            return
        ref = EndpointRef(ep.namespace, ep.name)
        try:
            await asyncio.wait_for(self._jobs_queue.ensure_endpoint(ref), 5.0)
        except Exception as exc:
            logger.warning(
                "The queue of %s (its streams and consumers) is not made yet: %s",
                ref.id,
                exc or type(exc),
            )

    async def _reconcile_inference_pool(
        self, ep: Endpoint, owner: Mapping[str, Any], client: KubeApi, logger: logging.Logger
    ) -> status.InferencePoolState:
        """Apply the endpoint's InferencePool, or delete one it no longer asks for.

        Its API is optional in a cluster: a missing API (404 on the apply), a refusal (an older
        CRD's schema, RBAC) become the status's InferencePool condition, never a failed
        reconcile: the rest of the endpoint serves regardless, and the next reconcile (or the
        CRD's installation, handlers.py) tries again."""
        key = (ep.namespace, ep.name)
        pool = manifests.build_inference_pool(ep, self._settings)
        if pool is None:
            if self._pool_may_exist(key, owner):
                try:
                    if await client.delete(
                        manifests.INFERENCE_POOL_API_VERSION,
                        manifests.INFERENCE_POOL_KIND,
                        ep.namespace,
                        manifests.inference_pool_name(ep.name),
                    ):
                        logger.info(
                            "Deleted InferencePool %s: the spec no longer asks for it", ep.name
                        )
                except kube.ApiError as exc:  # API gone, or no permission: nothing to remove
                    logger.info("InferencePool %s not deleted: %s", ep.name, exc)
            return status.NO_POOL
        kopf.adopt(pool, owner=owner)
        try:
            await client.apply(pool)
        except kube.NotFound:
            return status.pool_api_missing()
        except kube.ApiError as exc:
            logger.warning("InferencePool %s refused: %s", ep.name, exc)
            if exc.status in (401, 403):
                return status.pool_forbidden(exc.message)
            if exc.status in (400, 422):
                return status.pool_rejected(
                    exc.message, has_picker="endpointPickerRef" in pool["spec"]
                )
            raise  # the API server in trouble: retried like any other failed write
        return status.pool_created(pool)

    def _pool_may_exist(self, key: Key, owner: Mapping[str, Any]) -> bool:
        """Whether an InferencePool of ours may exist: this process or the stored status says
        it was created. (Endpoints that never asked for one cost no DELETE per reconcile.)"""
        if self._pools.get(key, status.NO_POOL).name is not None:
            return True
        for stored in (self._published.get(key), owner.get("status")):
            if stored and stored.get("inferencePool"):
                return True
        return False

    async def _write_workload(
        self, ep: Endpoint, owner: Mapping[str, Any], client: KubeApi, logger: logging.Logger
    ) -> tuple[bool, dict[str, Any] | None]:
        """Write the workload the spec asks for; then delete one of the other kind (the spec's
        nodes went from 1 to more, or back), whose replica count the new one starts with.

        Returns whether this call created it, and the workload as the API returned it (None:
        the LeaderWorkerSet API is missing or forbidden, which the status reports)."""
        key = (ep.namespace, ep.name)
        multinode = groups.multinode(ep)
        current = self.indexes.workload(key, multinode)
        left = self.indexes.workload(key, not multinode)
        try:
            created, written = await self._apply_workload(ep, owner, current, left, client)
        except kube.ApiError as exc:
            if not multinode or exc.status not in (401, 403, 404):
                raise
            logger.warning("LeaderWorkerSet of %s/%s not written: %s", *key, exc)
            self._workload_problems[key] = (
                status.groups_api_missing(ep.spec.resources.nodes)
                if exc.status == 404
                else status.groups_forbidden(exc.message)
            )
            return False, None  # a Deployment left behind keeps serving meanwhile
        self._workload_problems.pop(key, None)
        if left is not None:
            ref = groups.other_workload_ref(ep)
            if await client.delete(ref.api_version, ref.kind, ep.namespace, ref.name):
                logger.info(
                    "Deleted %s %s: spec.resources.nodes is now %d",
                    ref.kind, ref.name, ep.spec.resources.nodes,
                )  # fmt: skip
        return created, written

    async def _apply_workload(
        self,
        ep: Endpoint,
        owner: Mapping[str, Any],
        current: status.DeploymentState | None,
        left: status.DeploymentState | None,
        client: KubeApi,
    ) -> tuple[bool, dict[str, Any]]:
        """Create or apply the workload; write replicas only as manifests.replicas_to_write says
        (a new one: the count of the workload of the other kind it replaces, within bounds)."""
        if current is None:
            first = manifests.first_replicas(ep, left.desired if left is not None else None)
            workload = groups.build_workload(ep, self._settings, replicas=first)
            kopf.adopt(workload, owner=owner)
            try:
                # POST, not apply: replicas is then owned by an Update operation, and later
                # applies (which leave replicas out) never remove it.
                return True, await client.create(workload)
            except kube.Conflict:
                pass  # it exists but our index has not seen it yet: apply, replicas untouched
        workload = groups.build_workload(ep, self._settings, replicas=None)
        kopf.adopt(workload, owner=owner)
        written = await client.apply(workload)
        if current is not None:
            replicas = manifests.replicas_to_write(ep, current.desired)
            if replicas is not None:
                # A merge patch (an Update operation, like the create): never part of an apply.
                ref = groups.workload_ref(ep)
                written = await client.patch(
                    ref.api_version, ref.kind, ep.namespace, ref.name,
                    {"spec": {"replicas": replicas}},
                )  # fmt: skip
        return False, written

    # --- status -------------------------------------------------------------------------------

    async def publish_status(
        self,
        snapshot: Mapping[str, Any],
        *,
        observed_generation: int | None = None,
        parsed: Endpoint | None = None,
        deployment: status.DeploymentState | None = None,
    ) -> None:
        """Compute the status from the indexes and write it if it changed; post transition Events.

        `observed_generation` is given only by the reconcile (it has acted on that generation);
        publishes triggered by children keep the previous one."""
        meta = snapshot["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        key = (namespace, name)
        raw_spec = snapshot.get("spec") or {}
        invalid: str | None = None
        if parsed is None:
            try:
                parsed = admit(name, namespace, raw_spec, self._settings)
            except InvalidSpecError as exc:
                invalid = str(exc)
        nodes = parsed.spec.resources.nodes if parsed is not None else lenient_nodes(raw_spec)
        workload = deployment or self.indexes.workload(key, nodes > 1)
        unready: list[groups.UnreadyPod] = []
        if nodes > 1 and workload and workload.ready < max(workload.desired, workload.replicas):
            unready = await self._unready_pods(namespace, name)
            workload = replace(workload, group_failure_message=groups.failure_message(unready))
        async with self._status_locks[key]:
            previous = self._published.get(key, snapshot.get("status") or {})
            phases = _ClaimPhases(self.indexes.claim_phases, namespace)
            cache = (
                status.cache_state_for(parsed, phases)
                if parsed is not None
                else lenient_cache_state(name, raw_spec, phases)
            )
            now = self._clock().strftime("%Y-%m-%dT%H:%M:%SZ")
            new = status.compute(
                name=name,
                namespace=namespace,
                endpoint=parsed,
                invalid_message=invalid,
                observed=status.Observed(
                    deployment=workload,
                    cache=cache,
                    unready=tuple(unready),
                    workload_problem=self._workload_problems.get(key) if nodes > 1 else None,
                ),
                previous=previous,
                now=now,
                observed_generation=observed_generation,
                cluster_domain=self._settings.cluster_domain,
                gateway_url=self._settings.gateway_url,
                inference_pool=self._pools.get(key),
                model_name=self.model_name(snapshot),
                fit=self._fits.get(key),
            )
            download = coldstart.download_state(
                parsed,
                self._settings,
                self.indexes.download_jobs.get(key, ()),
                self.indexes.endpoint_pods.get(key, ()),
            )
            new = with_download(new, download, previous, now)
            # Blocks other writers own: the autoscaler's and the adapter watcher's.
            others = {k: v for k, v in previous.items() if k not in _OTHER_WRITERS}
            if status.without_times(new) == status.without_times(others):
                return
            # A merge patch: keys no longer reported must be nulled explicitly (but never the
            # autoscaler's block, which only the autoscaler writes).
            gone = [k for k in previous if k not in new and k not in _OTHER_WRITERS]
            try:
                await self._kube().patch(
                    manifests.API_VERSION,
                    manifests.KIND,
                    namespace,
                    name,
                    {"status": {**dict.fromkeys(gone), **_nulling(previous, new)}},
                    subresource="status",
                )
            except kube.NotFound:
                self._published.pop(key, None)
                return  # the endpoint was deleted meanwhile
            self._published[key] = new
        for event in status.transition_events(previous, new):
            self._post_event(snapshot, event.type, event.reason, event.message)

    async def _unready_pods(self, namespace: str, name: str) -> list[groups.UnreadyPod]:
        """The pods that keep a multi-node endpoint's groups from being ready (a GET, only
        while one is not ready: a pod's state reaches nothing the operator watches)."""
        selector = manifests.selector_string(manifests.selector_labels(name))
        try:
            pods = await self._kube().list("v1", "Pod", namespace, label_selector=selector)
        except kube.ApiError as exc:  # no permission (an older chart): the counts still show
            logger.info("Pods of %s/%s not read: %s", namespace, name, exc)
            return []
        mine = [
            pod
            for pod in pods
            if ((pod.get("metadata") or {}).get("labels") or {}).get(manifests.LABEL_ENDPOINT)
            == name
        ]  # the selector's answer, checked (a stand-in API server may not filter)
        return groups.unready_pods(mine)

    def model_name(self, snapshot: Mapping[str, Any]) -> status.ModelNameState:
        """The endpoint's served model name, and the older endpoint keeping it, if any.

        From the raw spec, as the gateway reads it: an invalid spec is still routed, so it still
        claims its name. The endpoint itself is counted whether or not the index has it yet."""
        meta = snapshot["metadata"]
        me = Claim(meta["namespace"], meta["name"], creation_time(meta.get("creationTimestamp")))
        served = served_model_name(me.name, snapshot.get("spec"))
        others = [c for c in self.indexes.model_claims.get(served, ()) if c.id != me.id]
        keeper = owner([me, *others])
        return status.ModelNameState(served, None if keeper is me else keeper.id)

    def model_claim_is_news(self, key: Key, served: str | None) -> bool:
        """Whether endpoint `key` declaring `served` (None: deleted) differs from what was seen."""
        return self._served.get(key) != served

    async def model_claims_changed(
        self, key: Key, served: str | None, logger: logging.Logger
    ) -> None:
        """Endpoint `key` was seen declaring the model name `served` (None: it was deleted).

        If that is news (a new endpoint, a renamed model, a deletion), the other endpoints
        declaring the names involved may have gained or lost them: their status is published
        now. The index kopf passes has been updated for this event already. Otherwise nothing
        (a dict lookup per event: status writes come through here too)."""
        if not self.model_claim_is_news(key, served):
            return
        before = self._served.get(key)
        if served is None:
            self._served.pop(key, None)
        else:
            self._served[key] = served
        for name in {before, served} - {None}:
            for claim in list(self.indexes.model_claims.get(name, ())):
                other = (claim.namespace, claim.name)
                endpoint = self.indexes.endpoint(other)
                if (
                    other == key
                    or endpoint is None
                    or endpoint["metadata"].get("deletionTimestamp")
                    or self.reconciling(other)  # it publishes when done
                ):
                    continue
                try:
                    await self.publish_status(endpoint)
                except kube.ApiError as exc:  # the resync reports it
                    logger.warning("Status of %s/%s not published: %s", *other, exc)

    def waiting_for_groups_api(self) -> list[dict[str, Any]]:
        """Multi-node endpoints whose LeaderWorkerSet could not be written for want of its API."""
        return [
            endpoint
            for key, problem in list(self._workload_problems.items())
            if problem.reason == "LeaderWorkerSetNotInstalled"
            and (endpoint := self.indexes.endpoint(key)) is not None
        ]

    def waiting_for_pool_api(self) -> list[dict[str, Any]]:
        """Endpoints whose InferencePool could not be created because its API is missing."""
        waiting = []
        for key, state in list(self._pools.items()):
            endpoint = self.indexes.endpoint(key)
            if state.reason == "CRDNotInstalled" and endpoint is not None:
                waiting.append(endpoint)
        return waiting

    # --- the resync ---------------------------------------------------------------------------

    async def resync_forever(self, period: float) -> None:
        """Reconcile every endpoint once per `period` seconds, spread over the period.

        One task for the whole operator rather than a kopf timer per endpoint: kopf timers put a
        finalizer on every object, and then deleting an endpoint needs a running operator."""
        logger = logging.getLogger("llmendpoints_operator.resync")
        while True:
            snapshots = [s for store in self.indexes.llmendpoints.values() for s in store]
            self.forget_deleted()
            if not snapshots:
                await asyncio.sleep(period)
                continue
            for old in snapshots:
                await asyncio.sleep(period / len(snapshots))
                await self.resync_one(
                    (old["metadata"]["namespace"], old["metadata"]["name"]), logger
                )

    async def resync_one(self, key: Key, logger: logging.Logger) -> None:
        current = self.indexes.endpoint(key)
        if current is None or current["metadata"].get("deletionTimestamp"):
            return  # deleted meanwhile
        # Compare with the status as stored, not as last written: repairs edits by others.
        self._published.pop(key, None)
        try:
            await self.reconcile(current, prune=True, logger=logger, trigger="resync")
        except InvalidSpecError:
            pass  # reported when the spec was written; the status still says it
        except Exception as exc:  # one endpoint's failure must not stop the others' resync
            logger.exception("Resync of %s/%s failed", *key)
            self._post_event(current, "Warning", "ReconcileFailed", str(exc))

    def forget_deleted(self) -> None:
        """Drop the per-endpoint state of endpoints that no longer exist."""
        endpoints = self.indexes.llmendpoints
        for key in [k for k in self._published if k not in endpoints]:
            self._published.pop(key, None)
        for key in [k for k in self._pools if k not in endpoints]:
            self._pools.pop(key, None)
        for key in [k for k in self._workload_problems if k not in endpoints]:
            self._workload_problems.pop(key, None)
        self._missed = {key for key in self._missed if key in endpoints}
        for key in [k for k in self._fits if k not in endpoints]:
            self._fits.pop(key, None)
        for key in [k for k in self._served if k not in endpoints]:
            self._served.pop(key, None)
        for locks in (self._reconcile_locks, self._status_locks):
            for key in [k for k, lock in locks.items() if k not in endpoints]:
                if not locks[key].locked():
                    del locks[key]


class AutoscaledSubjects:
    """The endpoints whose size the autoscaler decides now: admitted spec (admission.admit),
    bounds that leave a choice, no `spec.scaling.replicas` pin, and a workload (a Deployment, or
    a LeaderWorkerSet whose replicas are groups: the autoscaler counts a group as one replica).

    Called by the autoscaler's loop up to four times a second, over every endpoint: an endpoint
    whose body (kopf hands a new object for every change) and workload state are those of the
    last call gets the same Subject; its spec's admission is remembered too (AdmissionMemo)."""

    def __init__(self, indexes: Indexes, settings: OperatorSettings) -> None:
        self._indexes = indexes
        self._admissions = AdmissionMemo(settings)
        self._last: dict[Key, tuple[Any, status.DeploymentState, Subject | None]] = {}

    def __call__(self) -> list[Subject]:
        stores = list(self._indexes.llmendpoints.items())
        keys = {key for key, _ in stores}
        self._admissions.keep_only(keys)
        for key in [k for k in self._last if k not in keys]:
            del self._last[key]
        subjects = []
        for key, store in stores:
            endpoint = next(iter(store), None)
            if endpoint is None or endpoint["metadata"].get("deletionTimestamp"):
                continue
            raw = (endpoint.get("spec") or {}).get("scaling") or {}
            if not raw.get("maxReplicas") or raw.get("replicas") is not None:
                continue  # a fixed size or a pin (a cheap check before parsing)
            workload = self._indexes.workload(key, lenient_nodes(endpoint.get("spec")) > 1)
            if workload is None:
                continue
            last = self._last.get(key)
            if last is not None and last[0] is endpoint and last[1] == workload:
                subject = last[2]
            else:
                subject = self._subject(key, endpoint, workload)
                self._last[key] = (endpoint, workload, subject)
            if subject is not None:
                subjects.append(subject)
        return subjects

    def _subject(
        self, key: Key, endpoint: Mapping[str, Any], workload: status.DeploymentState
    ) -> Subject | None:
        try:
            ep = self._admissions.admit(key[1], key[0], endpoint.get("spec"))
        except InvalidSpecError:
            return None
        if not ep.spec.scaling.autoscaled:
            return None
        ref = groups.workload_ref(ep)
        return Subject(
            owner=endpoint,
            api_version=manifests.API_VERSION,
            kind=manifests.KIND,
            policy=ep.spec.scaling.policy(),
            service=manifests.service_name(ep.name),
            deployment=ref.name,
            replicas=workload.desired,
            ready_replicas=workload.ready,
            workload=(ref.api_version, ref.kind),
        )

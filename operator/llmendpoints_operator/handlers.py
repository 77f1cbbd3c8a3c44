"""kopf wiring: one level-triggered reconcile, a periodic resync, and status kept up to date.

- `reconcile` runs on create, on update, on resume (operator restart) and every
  LLMEP_OPERATOR_RESYNC_SECONDS (drift correction). It parses the spec, applies every child with
  a fixed name and an owner reference, deletes the optional children the spec no longer asks for,
  and publishes the status. It is idempotent: running it twice changes nothing.
- Children's state reaches the status without polling: kopf indexes keep the runtime
  Deployments and the PersistentVolumeClaims in memory, and their watch events re-publish the
  owning endpoint's status (a Deployment becoming available turns the endpoint Ready).
- A spec that cannot be reconciled gives Ready=False/InvalidSpec naming the field, a Warning
  Event, no children, and kopf.PermanentError: no retries until the spec changes again.

Kubernetes Events are posted through kopf's event queue (kopf.event); everything else the
operator writes goes through kube.py. kopf's own per-handler events are switched off so that an
endpoint's Events are ours alone, with stable reasons (Created, InvalidSpec, Ready, RolledOut,
Degraded, RolloutFailed, ReconcileFailed).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import prometheus_client

from llmendpoints_operator import kube, manifests, status
from llmendpoints_operator.autoscaling.controller import STATUS_KEY as AUTOSCALING_KEY
from llmendpoints_operator.autoscaling.controller import Autoscaler, Subject
from llmendpoints_operator.autoscaling.metrics import shared_metrics
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import Endpoint, InvalidSpecError, parse

LLMEP = (manifests.GROUP, manifests.VERSION, manifests.PLURAL)
# In prometheus_client's default registry, which the CLI serves on LLMEP_OPERATOR_METRICS_PORT.
RECONCILES = prometheus_client.Counter(
    "llmendpoints_operator_reconciles_total",
    "Reconciles of LLMEndpoints, by trigger and result (ok, invalid, error).",
    ["trigger", "result"],
)
RECONCILE_SECONDS = prometheus_client.Histogram(
    "llmendpoints_operator_reconcile_duration_seconds",
    "Wall time of one reconcile, including its API requests.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
SETTINGS = OperatorSettings()
CHILD_LABELS = {
    manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY,
    manifests.LABEL_ENDPOINT: kopf.PRESENT,
}

Key = tuple[str, str]  # (namespace, endpoint name)


@dataclass(frozen=True)
class Indexes:
    """kopf's in-memory indexes (see the @kopf.index functions below)."""

    llmendpoints: kopf.Index[Key, dict[str, Any]]
    runtime_deployments: kopf.Index[Key, status.DeploymentState]
    claim_phases: kopf.Index[Key, str]
    claim_users: kopf.Index[Key, str]

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> Indexes:
        indexes = cls(
            llmendpoints=kwargs["llmendpoints"],
            runtime_deployments=kwargs["runtime_deployments"],
            claim_phases=kwargs["claim_phases"],
            claim_users=kwargs["claim_users"],
        )
        STATE.indexes = indexes
        _start_resync()
        _start_autoscaler()
        return indexes


class _State:
    """Process-wide state of the operator: the API client and per-endpoint serialisation."""

    def __init__(self) -> None:
        self.connection: kube.Connection | None = None
        self.client: kube.KubeClient | None = None
        self.relogin: kube.Relogin | None = None
        self.reconcile_locks: defaultdict[Key, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.status_locks: defaultdict[Key, asyncio.Lock] = defaultdict(asyncio.Lock)
        # The last status we wrote per endpoint: the watch stream may lag behind our own writes.
        self.published: dict[Key, dict[str, Any]] = {}
        # kopf hands indexes to handlers only; the resync loop uses the ones handlers saw.
        self.indexes: Indexes | None = None
        self.resync_task: asyncio.Task[None] | None = None
        self.autoscaler: Autoscaler | None = None
        self.autoscaler_task: asyncio.Task[None] | None = None

    def kube(self) -> kube.KubeClient:
        if self.client is None:
            if self.connection is None:
                raise RuntimeError("not logged in to the Kubernetes API yet")
            self.client = kube.KubeClient(
                self.connection, field_manager=SETTINGS.field_manager, relogin=self.relogin
            )
        return self.client


STATE = _State()


# --- operator lifecycle -----------------------------------------------------------------------


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf's bookkeeping lives in our own annotations, never in .status (which the CRD's
    # structural schema would prune) and never under a foreign domain.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=manifests.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=manifests.GROUP, key="last-handled-configuration"
    )
    # Only our explicit events (kopf.event is not subject to this level).
    settings.posting.level = logging.CRITICAL


def _login(**kwargs: Any) -> kopf.ConnectionInfo:
    """KUBECONFIG when set, else the in-cluster service account, else ~/.kube/config."""
    info: kopf.ConnectionInfo | None = None
    if os.environ.get("KUBECONFIG"):
        info = kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        info = kopf.login_with_service_account(**kwargs)
    if info is None:
        info = kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        raise kopf.LoginError(
            "no credentials: set KUBECONFIG or run in a pod with a service account"
        )
    return info


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo:
    info = _login(**kwargs)
    STATE.connection = kube.connection_from_kopf(info)

    async def relogin() -> kube.Connection:
        return kube.connection_from_kopf(_login(**kwargs))

    STATE.relogin = relogin
    return info


@kopf.on.cleanup()
async def close_client(**_: Any) -> None:
    if STATE.resync_task is not None:
        STATE.resync_task.cancel()
    if STATE.autoscaler_task is not None:
        STATE.autoscaler_task.cancel()
    if STATE.autoscaler is not None:
        await STATE.autoscaler.close()
    if STATE.client is not None:
        await STATE.client.close()
        STATE.client = None


# --- indexes: what the status needs, kept in memory by kopf's watches --------------------------


# The indexers are coroutines: kopf runs plain functions in a thread pool, which costs more CPU
# than the indexing itself.
@kopf.index(*LLMEP)
async def llmendpoints(
    namespace: str, name: str, body: kopf.Body, **_: Any
) -> dict[Key, dict[str, Any]]:
    return {(namespace, name): _snapshot(body)}


@kopf.index(*LLMEP)
async def claim_users(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Key, str]:
    """(namespace, claim) -> the endpoint mounting it: a claim's events find their endpoints."""
    claim = _cache_state(name, body.get("spec") or {}, {}).claim_name
    return {(namespace, claim): name} if claim else {}


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
async def runtime_deployments(
    namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, status.DeploymentState]:
    return {(namespace, labels[manifests.LABEL_ENDPOINT]): status.DeploymentState.from_object(body)}


@kopf.index("", "v1", "persistentvolumeclaims")
async def claim_phases(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Key, str]:
    # A claim without a status has just been created: Kubernetes reports it Pending.
    return {(namespace, name): (body.get("status") or {}).get("phase") or "Pending"}


def _snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    """What is needed to reconcile or publish an endpoint outside its own handlers."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion", manifests.API_VERSION),
        "kind": body.get("kind", manifests.KIND),
        "metadata": {
            key: meta[key]
            for key in ("name", "namespace", "uid", "generation", "labels", "deletionTimestamp")
            if key in meta
        },
        # No copies: kopf parses every watch event into fresh dicts and never mutates them.
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }


def _one(index: kopf.Index[Any, Any], key: Any) -> Any:
    store = index.get(key)
    return next(iter(store), None) if store else None


# --- the reconcile ----------------------------------------------------------------------------


@kopf.on.resume(*LLMEP)
@kopf.on.create(*LLMEP)
@kopf.on.update(*LLMEP)
async def reconcile_endpoint(
    body: kopf.Body, reason: str, logger: logging.Logger, **kwargs: Any
) -> None:
    snapshot = _snapshot(body)
    try:
        await reconcile(
            snapshot,
            indexes=Indexes.of(kwargs),
            prune=reason != "create",  # nothing to prune on a fresh endpoint
            logger=logger,
            trigger=reason,
        )
    except InvalidSpecError as exc:
        kopf.event(snapshot, type="Warning", reason="InvalidSpec", message=str(exc))
        raise kopf.PermanentError(f"invalid spec: {exc}") from None
    except kube.ApiError as exc:
        kopf.event(snapshot, type="Warning", reason="ReconcileFailed", message=str(exc))
        raise kopf.TemporaryError(str(exc), delay=30) from exc


def _start_resync() -> None:
    """Start the resync loop once, from a handler: kopf.event works only in tasks that inherit
    the handlers' context (startup handlers run before it exists)."""
    if STATE.resync_task is None:
        STATE.resync_task = asyncio.create_task(_resync_loop(), name="llmendpoints-resync")


async def _resync_loop() -> None:
    """Reconcile every endpoint once per LLMEP_OPERATOR_RESYNC_SECONDS, spread over the period.

    One task for the whole operator rather than a kopf timer per endpoint: kopf timers put a
    finalizer on every object, and then deleting an endpoint needs a running operator."""
    logger = logging.getLogger("llmendpoints_operator.resync")
    period = SETTINGS.resync_seconds
    while True:
        indexes = STATE.indexes
        snapshots = [s for store in indexes.llmendpoints.values() for s in store] if indexes else []
        _forget_deleted(indexes)
        if not snapshots:
            await asyncio.sleep(period)
            continue
        for snapshot in snapshots:
            await asyncio.sleep(period / len(snapshots))
            key = (snapshot["metadata"]["namespace"], snapshot["metadata"]["name"])
            current = _one(indexes.llmendpoints, key)
            if current is None or current["metadata"].get("deletionTimestamp"):
                continue  # deleted meanwhile
            # Compare with the status as stored, not as last written: repairs edits by others.
            STATE.published.pop(key, None)
            try:
                await reconcile(
                    current, indexes=indexes, prune=True, logger=logger, trigger="resync"
                )
            except InvalidSpecError:
                pass  # reported when the spec was written; the status still says it
            except Exception as exc:  # one endpoint's failure must not stop the others' resync
                logger.exception("Resync of %s/%s failed", *key)
                kopf.event(current, type="Warning", reason="ReconcileFailed", message=str(exc))


def _forget_deleted(indexes: Indexes | None) -> None:
    """Drop per-endpoint state of endpoints that no longer exist."""
    if indexes is None:
        return
    for key in [k for k in STATE.published if k not in indexes.llmendpoints]:
        STATE.published.pop(key, None)
    for locks in (STATE.reconcile_locks, STATE.status_locks):
        for key in [k for k, lock in locks.items() if k not in indexes.llmendpoints]:
            if not locks[key].locked():
                del locks[key]


async def reconcile(
    endpoint: Mapping[str, Any],
    *,
    indexes: Indexes,
    prune: bool,
    logger: logging.Logger,
    trigger: str,
) -> None:
    """Make the children match the spec, then publish the status. Raises InvalidSpecError.

    `trigger` (create, update, resume, resync, deployment-deleted) labels the metrics."""
    started = time.perf_counter()
    result = "error"
    try:
        await _reconcile(endpoint, indexes=indexes, prune=prune, logger=logger)
        result = "ok"
    except InvalidSpecError:
        result = "invalid"
        raise
    finally:
        RECONCILES.labels(trigger, result).inc()
        RECONCILE_SECONDS.observe(time.perf_counter() - started)


async def _reconcile(
    endpoint: Mapping[str, Any], *, indexes: Indexes, prune: bool, logger: logging.Logger
) -> None:
    meta = endpoint["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    key = (namespace, name)
    async with STATE.reconcile_locks[key]:
        try:
            ep = parse(name, namespace, endpoint.get("spec"))
        except InvalidSpecError as exc:
            logger.warning("Invalid spec: %s", exc)
            await publish_status(
                endpoint, indexes=indexes, observed_generation=meta.get("generation")
            )
            raise

        client = STATE.kube()
        children = manifests.build_children(ep, SETTINGS)
        kopf.adopt(children, owner=endpoint)
        for child in children:
            await client.apply(child)

        current = _one(indexes.runtime_deployments, key)
        created, written = await _write_deployment(ep, endpoint, current, client)

        if prune:
            wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
            for ref in manifests.optional_children(name):
                if (ref.kind, ref.name) not in wanted and await client.delete(
                    ref.api_version, ref.kind, namespace, ref.name
                ):
                    logger.info("Deleted %s %s: the spec no longer asks for it", ref.kind, ref.name)

        if created:
            kinds = ", ".join(f"{c['kind']} {c['metadata']['name']}" for c in children)
            kopf.event(
                endpoint,
                type="Normal",
                reason="Created",
                message=f"created Deployment {manifests.deployment_name(name)}, {kinds}",
            )
        await publish_status(
            endpoint,
            indexes=indexes,
            observed_generation=meta.get("generation"),
            parsed=ep,
            # Fresher than the index, whose watch event for our write may not have arrived yet.
            deployment=status.DeploymentState.from_object(written),
        )


async def _write_deployment(
    ep: Endpoint,
    owner: Mapping[str, Any],
    current: status.DeploymentState | None,
    client: kube.KubeClient,
) -> tuple[bool, dict[str, Any]]:
    """Create or apply the Deployment; write replicas only as manifests.replicas_to_write says.

    Returns whether this call created the Deployment, and the Deployment as the API returned it."""
    if current is None:
        deployment = manifests.build_deployment(
            ep, SETTINGS, replicas=manifests.replicas_to_write(ep, None)
        )
        kopf.adopt(deployment, owner=owner)
        try:
            # POST, not apply: replicas is then owned by an Update operation, and later applies
            # (which leave replicas out) never remove it.
            return True, await client.create(deployment)
        except kube.Conflict:
            pass  # it exists but our index has not seen it yet: apply below, replicas untouched
    deployment = manifests.build_deployment(ep, SETTINGS, replicas=None)
    kopf.adopt(deployment, owner=owner)
    written = await client.apply(deployment)
    if current is not None:
        replicas = manifests.replicas_to_write(ep, current.desired)
        if replicas is not None:
            # A merge patch (an Update operation, like the create): never part of our applies.
            written = await client.patch(
                "apps/v1",
                "Deployment",
                ep.namespace,
                manifests.deployment_name(ep.name),
                {"spec": {"replicas": replicas}},
            )
    return False, written


# --- status -----------------------------------------------------------------------------------


def _cache_state(
    name: str, raw_spec: Mapping[str, Any], phases: Mapping[str, str]
) -> status.CacheState:
    """Read leniently from the raw spec: an invalid spec still reports its last cache volume."""
    cache = raw_spec.get("cache") if isinstance(raw_spec, Mapping) else None
    if not isinstance(cache, Mapping) or not (cache.get("existingClaim") or cache.get("size")):
        return status.CacheState()
    existing = cache.get("existingClaim")
    claim = str(existing) if existing else manifests.cache_claim_name(name)
    return status.CacheState(claim_name=claim, phase=phases.get(claim), existing=bool(existing))


class _ClaimPhases(Mapping[str, str]):
    """Claim name -> phase for one namespace, read from the claim_phases index."""

    def __init__(self, index: kopf.Index[Key, str], namespace: str):
        self._index, self._namespace = index, namespace

    def __getitem__(self, claim: str) -> str:
        value = _one(self._index, (self._namespace, claim))
        if value is None:
            raise KeyError(claim)
        return value

    def __iter__(self) -> Any:
        return iter(claim for ns, claim in self._index if ns == self._namespace)

    def __len__(self) -> int:
        return sum(1 for _ in self)


async def publish_status(
    snapshot: Mapping[str, Any],
    *,
    indexes: Indexes,
    observed_generation: int | None = None,
    parsed: Endpoint | None = None,
    deployment: status.DeploymentState | None = None,
) -> None:
    """Compute the status from the indexes and write it if it changed; post transition events.

    `observed_generation` is given only by the reconcile (it has acted on that generation);
    publishes triggered by children keep the previous one."""
    meta = snapshot["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    key = (namespace, name)
    raw_spec = snapshot.get("spec") or {}
    invalid: str | None = None
    if parsed is None:
        try:
            parsed = parse(name, namespace, raw_spec)
        except InvalidSpecError as exc:
            invalid = str(exc)
    async with STATE.status_locks[key]:
        previous = STATE.published.get(key, snapshot.get("status") or {})
        phases = _ClaimPhases(indexes.claim_phases, namespace)
        cache = (
            status.cache_state_for(parsed, phases)
            if parsed is not None
            else _cache_state(name, raw_spec, phases)
        )
        new = status.compute(
            name=name,
            namespace=namespace,
            endpoint=parsed,
            invalid_message=invalid,
            observed=status.Observed(
                deployment=deployment or _one(indexes.runtime_deployments, key), cache=cache
            ),
            previous=previous,
            now=_now(),
            observed_generation=observed_generation,
        )
        others = {k: v for k, v in previous.items() if k != AUTOSCALING_KEY}
        if status.without_times(new) == status.without_times(others):
            return
        # A merge patch: keys we no longer report must be nulled explicitly (but never the
        # autoscaler's block, which only the autoscaler writes).
        gone = [k for k in previous if k not in new and k != AUTOSCALING_KEY]
        patch = {**dict.fromkeys(gone), **new}
        try:
            await STATE.kube().patch(
                manifests.API_VERSION,
                manifests.KIND,
                namespace,
                name,
                {"status": patch},
                subresource="status",
            )
        except kube.NotFound:
            STATE.published.pop(key, None)
            return  # the endpoint was deleted meanwhile
        STATE.published[key] = new
    for event in status.transition_events(previous, new):
        kopf.event(snapshot, type=event.type, reason=event.reason, message=event.message)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- autoscaling (operator/llmendpoints_operator/autoscaling, docs/autoscaling.md) -------------


def _start_autoscaler() -> None:
    """Start the autoscaler's scheduler once, from a handler: kopf.event only works in tasks
    that inherit the handlers' context (it is not set yet when startup handlers run)."""
    if STATE.autoscaler_task is None:
        STATE.autoscaler = Autoscaler(
            kube=STATE.kube, post_event=_post_event, metrics=shared_metrics()
        )
        STATE.autoscaler_task = asyncio.create_task(
            STATE.autoscaler.run(_autoscaled), name="llmendpoints-autoscaler"
        )


def _autoscaled() -> list[Subject]:
    """The endpoints whose size the autoscaler decides now: valid spec, bounds that leave a
    choice, no `spec.scaling.replicas` pin, and a Deployment."""
    indexes = STATE.indexes
    if indexes is None:
        return []
    subjects = []
    for key, store in list(indexes.llmendpoints.items()):
        snapshot = next(iter(store), None)
        if snapshot is None or snapshot["metadata"].get("deletionTimestamp"):
            continue
        raw = (snapshot.get("spec") or {}).get("scaling") or {}
        if not raw.get("maxReplicas") or raw.get("replicas") is not None:
            continue  # a fixed size or a pin (cheap check before parsing)
        deployment = _one(indexes.runtime_deployments, key)
        if deployment is None:
            continue
        try:
            ep = parse(key[1], key[0], snapshot.get("spec"))
        except InvalidSpecError:
            continue
        if not ep.spec.scaling.autoscaled:
            continue
        subjects.append(
            Subject(
                owner=snapshot,
                api_version=manifests.API_VERSION,
                kind=manifests.KIND,
                policy=ep.spec.scaling.policy(),
                service=manifests.service_name(ep.name),
                deployment=manifests.deployment_name(ep.name),
                replicas=deployment.desired,
                ready_replicas=deployment.ready,
            )
        )
    return subjects


def _post_event(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(obj, type=type_, reason=reason, message=message)


# --- children's events -> the owner's status --------------------------------------------------


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_changed(
    type: str,
    namespace: str,
    labels: Mapping[str, str],
    logger: logging.Logger,
    **kwargs: Any,
) -> None:
    indexes = Indexes.of(kwargs)
    key = (namespace, labels[manifests.LABEL_ENDPOINT])
    snapshot = _one(indexes.llmendpoints, key)
    if snapshot is None or snapshot["metadata"].get("deletionTimestamp"):
        return  # not ours (anymore): garbage collection is deleting it
    if type == "DELETED":
        # Someone deleted a serving workload: put it back now rather than at the next resync.
        logger.warning("Deployment of %s/%s was deleted; recreating it", *key)
        with contextlib.suppress(InvalidSpecError):
            await reconcile(
                snapshot,
                indexes=indexes,
                prune=False,
                logger=logger,
                trigger="deployment-deleted",
            )
        return
    if not _reconciling(key):
        await publish_status(snapshot, indexes=indexes)


@kopf.on.event("", "v1", "persistentvolumeclaims")
async def claim_changed(namespace: str, name: str, **kwargs: Any) -> None:
    indexes = Indexes.of(kwargs)
    for endpoint_name in list(indexes.claim_users.get((namespace, name), ())):
        key = (namespace, endpoint_name)
        snapshot = _one(indexes.llmendpoints, key)
        if snapshot is not None and not _reconciling(key):
            await publish_status(snapshot, indexes=indexes)


def _reconciling(key: Key) -> bool:
    """A reconcile is running: it publishes the status when done, from the then-current indexes
    (which already hold the change that triggered this event), so publishing now is wasted."""
    lock = STATE.reconcile_locks.get(key)
    return lock is not None and lock.locked()

"""kopf wiring: the operator's state in kopf's memo, its indexes, and the handlers that call the
reconcile (reconcile.py) and the autoscaler (autoscaling/controller.py).

- Startup builds the operator's state (`Running`: settings, API client, Event poster,
  reconciler, autoscaler) into kopf's operator-wide memo and starts its background tasks: the
  Event poster, the resync loop and the autoscaler. Cleanup stops them. Nothing is created at
  import: importing this module only registers the handlers.
- One level-triggered reconcile is bound to create, update and resume (operator restart); the
  resync repeats it every LLMEP_OPERATOR_RESYNC_SECONDS. An invalid spec is a kopf.PermanentError
  (no retries until the spec changes again); an API refusal a kopf.TemporaryError (retried).
- Children's state reaches the status without polling: kopf indexes keep the runtime
  Deployments, the LeaderWorkerSets of multi-node endpoints and the PersistentVolumeClaims in
  memory, and their watch events re-publish the owning endpoint's status (a Deployment becoming
  available turns the endpoint Ready). Where LeaderWorkerSet is not installed its handlers wait:
  kopf starts watching once the CRD appears, and the endpoints that asked for groups meanwhile
  are reconciled then.
- Served model names: an index of who declares each name, and every LLMEndpoint event
  re-publishes the status of the endpoints whose claim it changes (one deleted: the next oldest
  declaring its name gets it, and its ModelNameAvailable condition turns True at once).

Events are posted by events.EventPoster, with stable reasons (Created, InvalidSpec, Ready,
RolledOut, Degraded, RolloutFailed, ReconcileFailed, ScaleUp, ScaleDown); kopf's own per-handler
events are switched off, so an endpoint's Events are ours alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
import prometheus_client
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.model_names import Claim, creation_time, served_model_name

from llmendpoints_operator import groups, kube, manifests, status
from llmendpoints_operator.autoscaling.adapter_watch import AdapterStatusWatcher, adapter_subjects
from llmendpoints_operator.autoscaling.controller import Autoscaler
from llmendpoints_operator.autoscaling.metrics import AutoscalerMetrics
from llmendpoints_operator.autoscaling.outside import NatsOutside
from llmendpoints_operator.autoscaling.scrape import MetricsScraper
from llmendpoints_operator.coldstart import manifests as coldstart_manifests
from llmendpoints_operator.coldstart import record as coldstart_record
from llmendpoints_operator.coldstart.recorder import ColdStartMetrics, ColdStartRecorder
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.events import EventPoster
from llmendpoints_operator.fit.checker import FitChecker
from llmendpoints_operator.hub import DEFAULT_HUB, HubClient
from llmendpoints_operator.jobs_queue import JobsQueue
from llmendpoints_operator.reconcile import (
    AutoscaledSubjects,
    Indexes,
    Key,
    ReconcileMetrics,
    Reconciler,
    lenient_cache_state,
    lenient_nodes,
    snapshot,
)
from llmendpoints_operator.spec import InvalidSpecError

LLMEP = (manifests.GROUP, manifests.VERSION, manifests.PLURAL)
LWS = (groups.LWS_GROUP, "v1", groups.LWS_PLURAL)
CHILD_LABELS = {
    manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY,
    manifests.LABEL_ENDPOINT: kopf.PRESENT,
}
EVENT_FLUSH_SECONDS = 5.0  # how long a shutdown waits for queued Events to be posted


@dataclass
class Running:
    """The running operator's state; lives in kopf's memo as `memo.operator`."""

    settings: OperatorSettings
    connection: kube.Connection | None = None
    relogin: kube.Relogin | None = None
    client: kube.KubeClient | None = None
    # The Event poster's task, and the loops that post Events (resync, autoscaler).
    events_task: asyncio.Task[None] | None = None
    loops: list[asyncio.Task[None]] = field(default_factory=list)
    # Set by `start`:
    events: EventPoster = field(init=False)
    reconciler: Reconciler = field(init=False)
    autoscaler: Autoscaler = field(init=False)
    adapter_watcher: AdapterStatusWatcher = field(init=False)
    cold_starts: ColdStartRecorder = field(init=False)
    cold_start_scraper: MetricsScraper = field(default_factory=lambda: MetricsScraper(5.0))
    fit_checker: FitChecker = field(init=False)
    jobs_queue: JobsQueue | None = None

    def api(self) -> kube.KubeClient:
        """The API client, created on first use (kopf logs in after the startup handlers)."""
        if self.client is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
            self.client = kube.KubeClient(
                self.connection, field_manager=self.settings.field_manager, relogin=self.relogin
            )
        return self.client

    def start(self, indexes: Indexes, registry: prometheus_client.CollectorRegistry) -> None:
        self.events = EventPoster(self.api)
        # The shared job queue (None without one): streams, consumers, per-endpoint creds.
        self.jobs_queue = JobsQueue.from_settings(self.settings)
        self.fit_checker = FitChecker(
            cluster=self.api,
            hub=HubClient(timeout=self.settings.fit_timeout_seconds),
            settings=self.settings,
            # The operator's own HF_ENDPOINT, as huggingface_hub reads it (unless the setting).
            default_hub=os.environ.get("HF_ENDPOINT") or DEFAULT_HUB,
        )
        self.reconciler = Reconciler(
            kube=self.api,
            indexes=indexes,
            settings=self.settings,
            post_event=self.events.post,
            metrics=ReconcileMetrics(registry),
            jobs_queue=self.jobs_queue,
            fit_checker=self.fit_checker,
        )
        self.autoscaler = Autoscaler(
            kube=self.api, post_event=self.events.post, metrics=AutoscalerMetrics(registry)
        )
        self.adapter_watcher = AdapterStatusWatcher(kube=self.api)
        self.cold_starts = ColdStartRecorder(
            kube=self.api, fetch=self.cold_start_scraper.fetch, metrics=ColdStartMetrics(registry)
        )
        if self.jobs_queue is not None:  # held requests, queued jobs and nudges live in NATS
            self.autoscaler.set_outside(
                NatsOutside(self.jobs_queue, on_nudge=self.autoscaler.nudge)
            )
        self.events_task = asyncio.create_task(self.events.run(), name="llmendpoints-events")
        self.loops = [
            asyncio.create_task(
                self.reconciler.resync_forever(self.settings.resync_seconds),
                name="llmendpoints-resync",
            ),
            asyncio.create_task(
                self.autoscaler.run(AutoscaledSubjects(indexes, self.settings)),
                name="llmendpoints-autoscaler",
            ),
            asyncio.create_task(
                self.adapter_watcher.run(lambda: _with_adapters(indexes)),
                name="llmendpoints-adapter-status",
            ),
        ]

    async def stop(self) -> None:
        for task in self.loops:
            task.cancel()
        await asyncio.gather(*self.loops, return_exceptions=True)
        if self.loops:
            await self.autoscaler.close()
            await self.adapter_watcher.close()
            await self.fit_checker.close()
        await self.cold_start_scraper.close()
        if self.events_task is not None:
            # What the last reconciles had to say still reaches the API, while it is reachable.
            await self.events.flush(EVENT_FLUSH_SECONDS)
            self.events_task.cancel()
            await asyncio.gather(self.events_task, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
            self.client = None


def _with_adapters(indexes: Indexes) -> list[Any]:
    """Endpoints whose status.adapters the adapter watcher keeps (autoscaling/adapter_watch.py)."""
    pairs = []
    for key, store in list(indexes.llmendpoints.items()):
        endpoint = next(iter(store), None)
        nodes = lenient_nodes((endpoint or {}).get("spec"))
        pairs.append((endpoint, getattr(indexes.workload(key, nodes > 1), "ready", 0)))
    return adapter_subjects(pairs)


def _running(memo: Any) -> Running:
    return memo.operator


# --- operator lifecycle -----------------------------------------------------------------------


@kopf.on.startup()
async def start(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **kwargs: Any
) -> None:
    # kopf's bookkeeping lives in our own annotations, never in .status (which the CRD's
    # structural schema would prune) and never under a foreign domain.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=manifests.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=manifests.GROUP, key="last-handled-configuration"
    )
    # No per-handler events from kopf: ours (events.py) are the only ones.
    settings.posting.enabled = False
    # __main__ passes the validated settings and the registry it serves on metrics_port.
    running = Running(settings=memo.get("settings") or OperatorSettings())
    # The indexes exist (empty) before any watch starts; kopf fills them in place.
    running.start(Indexes.of(kwargs), memo.get("registry") or prometheus_client.REGISTRY)
    memo.operator = running
    logger.info("Resync every %g s; autoscaler started.", running.settings.resync_seconds)


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
def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo:
    info = _login(**kwargs)
    running = _running(memo)
    running.connection = kube.connection_from_kopf(info)

    async def relogin() -> kube.Connection:
        return kube.connection_from_kopf(_login(**kwargs))

    running.relogin = relogin
    return info


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    running = memo.get("operator")
    if running is not None:  # None: the startup handler did not get that far
        await running.stop()


# --- indexes: what the status needs, kept in memory by kopf's watches --------------------------


# The indexers are coroutines: kopf runs plain functions in a thread pool, which costs more CPU
# than the indexing itself.
@kopf.index(*LLMEP)
async def llmendpoints(
    namespace: str, name: str, body: kopf.Body, **_: Any
) -> dict[Key, dict[str, Any]]:
    return {(namespace, name): snapshot(body)}


@kopf.index(*LLMEP)
async def claim_users(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Key, str]:
    """(namespace, claim) -> the endpoint mounting it: a claim's events find their endpoints."""
    claim = lenient_cache_state(name, body.get("spec") or {}, {}).claim_name
    return {(namespace, claim): name} if claim else {}


@kopf.index(*LLMEP)
async def model_claims(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[str, Claim]:
    """Served model name -> the endpoints declaring it: the oldest keeps it (status.py)."""
    created = creation_time((body.get("metadata") or {}).get("creationTimestamp"))
    return {served_model_name(name, body.get("spec")): Claim(namespace, name, created)}


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
async def runtime_deployments(
    namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, status.DeploymentState]:
    return {(namespace, labels[manifests.LABEL_ENDPOINT]): status.DeploymentState.from_object(body)}


@kopf.index(*LWS, labels=CHILD_LABELS)
async def runtime_groups(
    namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, status.DeploymentState]:
    """A multi-node endpoint's LeaderWorkerSet (its replicas are groups)."""
    state = status.DeploymentState.from_leader_worker_set(body)
    return {(namespace, labels[manifests.LABEL_ENDPOINT]): state}


@kopf.index("batch", "v1", "jobs", labels=CHILD_LABELS)
async def download_jobs(
    namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, dict[str, Any]]:
    """The endpoints' download Jobs (coldstart/): the Downloaded condition reads them."""
    if labels.get(coldstart_manifests.LABEL_COMPONENT) != coldstart_manifests.COMPONENT_DOWNLOAD:
        return {}
    meta = body.get("metadata") or {}
    job = {"metadata": {"name": meta.get("name")}, "status": dict(body.get("status") or {})}
    return {(namespace, labels[manifests.LABEL_ENDPOINT]): job}


# Runtime pods (their cold starts) and download pods (the attempts' reports); not the pre-pull
# pods, one per node.
POD_COMPONENTS = ("inference", coldstart_manifests.COMPONENT_DOWNLOAD)
POD_LABELS = {manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY}


def _indexed_pod(labels: Mapping[str, str], **_: Any) -> bool:
    return labels.get(coldstart_manifests.LABEL_COMPONENT) in POD_COMPONENTS


def _pod_snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    return {
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "uid", "labels", "creationTimestamp")
            if k in meta
        },
        "spec": {
            "nodeName": (body.get("spec") or {}).get("nodeName"),
            "containers": [
                {"name": c.get("name"), "ports": c.get("ports") or []}
                for c in (body.get("spec") or {}).get("containers") or ()
            ],
        },
        "status": dict(body.get("status") or {}),
    }


@kopf.index("", "v1", "pods", labels=POD_LABELS, when=_indexed_pod)
async def endpoint_pods(
    namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, dict[str, Any]]:
    """Runtime and download pods by endpoint (the instance label: download pods are not in the
    endpoint's pod selector)."""
    endpoint = labels.get("app.kubernetes.io/instance")
    return {(namespace, endpoint): _pod_snapshot(body)} if endpoint else {}


@kopf.index("", "v1", "persistentvolumeclaims")
async def claim_phases(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Key, str]:
    # A claim without a status has just been created: Kubernetes reports it Pending.
    return {(namespace, name): (body.get("status") or {}).get("phase") or "Pending"}


# --- the reconcile ----------------------------------------------------------------------------


@kopf.on.resume(*LLMEP)
@kopf.on.create(*LLMEP)
@kopf.on.update(*LLMEP)
async def reconcile_endpoint(
    body: kopf.Body, reason: str, logger: logging.Logger, memo: kopf.Memo, **_: Any
) -> None:
    running = _running(memo)
    endpoint = snapshot(body)
    try:
        await running.reconciler.reconcile(
            endpoint,
            prune=reason != "create",  # nothing to prune on a fresh endpoint
            logger=logger,
            trigger=reason,
        )
    except InvalidSpecError as exc:
        running.events.post(endpoint, "Warning", "InvalidSpec", str(exc))
        raise kopf.PermanentError(f"invalid spec: {exc}") from None
    except kube.ApiError as exc:
        running.events.post(endpoint, "Warning", "ReconcileFailed", str(exc))
        raise kopf.TemporaryError(str(exc), delay=30) from exc


def _declared_name(type: str | None, name: str, body: kopf.Body) -> str | None:
    return None if type == "DELETED" else served_model_name(name, body.get("spec"))


def _model_claim_is_news(
    type: str | None, namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> bool:
    """Status writes (the autoscaler's every tick) are events too: filtered here, they neither
    run the handler nor log a line each."""
    running = getattr(memo, "operator", None)
    return running is None or running.reconciler.model_claim_is_news(
        (namespace, name), _declared_name(type, name, body)
    )


@kopf.on.event(*LLMEP, when=_model_claim_is_news)
async def model_name_claim_seen(
    type: str | None,
    namespace: str,
    name: str,
    body: kopf.Body,
    logger: logging.Logger,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Another endpoint declaring the same model name may have gained or lost it (the reconcile
    of this one publishes its own status)."""
    served = _declared_name(type, name, body)
    await _running(memo).reconciler.model_claims_changed((namespace, name), served, logger)


def _is_deletion(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


@kopf.on.event(*LLMEP, when=_is_deletion)
async def endpoint_deleted(
    namespace: str, name: str, logger: logging.Logger, memo: kopf.Memo, **_: Any
) -> None:
    """A deleted endpoint's own queue goes with it: its jobs, and the storage NATS reserved for
    it (every endpoint's streams reserve their bound; queue/topology.py)."""
    queue = _running(memo).jobs_queue
    if queue is None:
        return
    try:
        removed = await asyncio.wait_for(queue.drop_endpoint(EndpointRef(namespace, name)), 10.0)
    except Exception as exc:  # NATS down: an admin removes them (docs/install.md)
        logger.warning("The queue streams of %s/%s were not deleted: %s", namespace, name, exc)
        return
    if removed:
        logger.info("Deleted the queue streams of %s/%s", namespace, name)


# --- the InferencePool API appearing ----------------------------------------------------------


@kopf.on.event(
    "apiextensions.k8s.io",
    "v1",
    "customresourcedefinitions",
    when=lambda name, **_: name in (manifests.INFERENCE_POOL_CRD, groups.LWS_CRD),
)
async def optional_api_changed(
    type: str, name: str, logger: logging.Logger, memo: kopf.Memo, **_: Any
) -> None:
    """The InferencePool or the LeaderWorkerSet CRD was installed (or became established):
    endpoints that asked for a pool, or for groups, while it was missing get them now rather
    than at their next resync."""
    if type == "DELETED":
        return  # the API server deletes the objects with it; the next reconcile reports it
    reconciler = _running(memo).reconciler
    if name == groups.LWS_CRD:
        waiting, trigger = reconciler.waiting_for_groups_api(), "leaderworkerset-api"
    else:
        waiting, trigger = reconciler.waiting_for_pool_api(), "inference-pool-api"
    for endpoint in waiting:
        with contextlib.suppress(InvalidSpecError, kube.ApiError):
            await reconciler.reconcile(endpoint, prune=True, logger=logger, trigger=trigger)


# --- children's events -> the owner's status --------------------------------------------------


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_changed(
    type: str, namespace: str, labels: Mapping[str, str], logger: logging.Logger, memo: kopf.Memo,
    **_: Any,
) -> None:  # fmt: skip
    await _workload_changed(
        type, (namespace, labels[manifests.LABEL_ENDPOINT]), False, logger, memo
    )


@kopf.on.event(*LWS, labels=CHILD_LABELS)
async def groups_changed(
    type: str, namespace: str, labels: Mapping[str, str], logger: logging.Logger, memo: kopf.Memo,
    **_: Any,
) -> None:  # fmt: skip
    await _workload_changed(type, (namespace, labels[manifests.LABEL_ENDPOINT]), True, logger, memo)


async def _workload_changed(
    type: str, key: Key, multinode: bool, logger: logging.Logger, memo: kopf.Memo
) -> None:
    reconciler = _running(memo).reconciler
    endpoint = reconciler.indexes.endpoint(key)
    if endpoint is None or endpoint["metadata"].get("deletionTimestamp"):
        return  # not ours (anymore): garbage collection is deleting it
    if type == "DELETED":
        if (lenient_nodes(endpoint.get("spec")) > 1) != multinode:
            return  # the reconcile replaced it with a workload of the other kind
        # Someone deleted a serving workload: put it back now rather than at the next resync.
        logger.warning("Workload of %s/%s was deleted; recreating it", *key)
        with contextlib.suppress(InvalidSpecError):
            await reconciler.reconcile(
                endpoint, prune=False, logger=logger, trigger="deployment-deleted"
            )
        return
    await reconciler.child_changed(endpoint)


@kopf.on.event("", "v1", "persistentvolumeclaims")
async def claim_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    reconciler = _running(memo).reconciler
    for endpoint_name in list(reconciler.indexes.claim_users.get((namespace, name), ())):
        key = (namespace, endpoint_name)
        endpoint = reconciler.indexes.endpoint(key)
        if endpoint is not None:
            await reconciler.child_changed(endpoint)


@kopf.on.event("batch", "v1", "jobs", labels=CHILD_LABELS)
async def download_job_changed(
    namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any
) -> None:
    """A download Job progressed: its endpoint's Downloaded condition says so."""
    if labels.get(coldstart_manifests.LABEL_COMPONENT) != coldstart_manifests.COMPONENT_DOWNLOAD:
        return
    await _publish(memo, (namespace, labels[manifests.LABEL_ENDPOINT]))


async def _publish(memo: kopf.Memo, key: Key) -> None:
    reconciler = _running(memo).reconciler
    endpoint = reconciler.indexes.endpoint(key)
    if endpoint is not None:
        await reconciler.child_changed(endpoint)


@kopf.on.event("", "v1", "pods", labels=POD_LABELS, when=_indexed_pod)
async def endpoint_pod_changed(
    type: str,
    namespace: str,
    labels: Mapping[str, str],
    body: kopf.Body,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A download attempt ended (its report: the Downloaded condition), or a runtime pod turned
    Ready for the first time (its cold start: status.coldStart.last)."""
    endpoint_name = labels.get("app.kubernetes.io/instance")
    if type == "DELETED" or not endpoint_name:
        return
    key = (namespace, endpoint_name)
    component = labels.get(coldstart_manifests.LABEL_COMPONENT)
    if component == coldstart_manifests.COMPONENT_DOWNLOAD:
        return await _publish(memo, key)
    running = _running(memo)
    endpoint = running.reconciler.indexes.endpoint(key)
    pod = _pod_snapshot(body)
    if not running.cold_starts.wants(pod, endpoint):
        return
    assert endpoint is not None  # wants()
    others = running.reconciler.indexes.endpoint_pods.get(key, ())
    from_zero = not any(
        coldstart_record.is_ready(p)
        and coldstart_record.serves(p)  # another replica: a Deployment's pod or a group's leader
        and p["metadata"].get("uid") != pod["metadata"].get("uid")
        and (p["metadata"].get("labels") or {}).get(coldstart_manifests.LABEL_COMPONENT)
        == "inference"
        for p in others
    )
    await running.cold_starts.record(pod, endpoint, from_zero=from_zero)

"""Kubernetes discovery: LLMEndpoints for names, served models, routing and keys; EndpointSlices
for the ready pods; labelled Secrets for API keys. Each is listed, then watched from the list's
resourceVersion, so a pod turning ready or going away reaches the routing table as soon as the
API server tells.

- An LLMEndpoint is registered as ``<namespace>/<name>`` (DECISIONS §2); its model is
  ``spec.model.servedModelName`` (default: the name), its strategy ``spec.routing``; requests
  wait for it at least its ``spec.engine.startupTimeoutSeconds`` (holding.hold_timeout).
- EndpointSlices are selected by the labels the operator puts on its Services (the EndpointSlice
  controller copies a Service's labels to its slices): ``app.kubernetes.io/managed-by=
  llmendpoints-operator`` and ``llmendpoints.dev/endpoint``, never every slice of the cluster.
  Port ``http``; endpoints whose ``conditions.ready`` is not false; replicas are named by their
  pod (``targetRef``) in metrics; port ``control`` is where the gateway reads each pod's engine
  load (pod_reader.py), never the serving port.
- ``spec.api.apiKeysSecretRef``: the Secret's key holds that endpoint's API keys (the runtime's
  file format); re-read on every change of the endpoint and every 30 s (rotations).
- Secrets labelled ``llmendpoints.dev/api-key`` in GATEWAY_KEYS_NAMESPACE (default: the
  gateway's own namespace): one API key each, with its name, endpoints and limits
  (keys.secret_api_key). While at least one exists, every request needs a key.

The client is kubernetes-asyncio, chosen over lightkube and kr8s because:
- it is the generated client of the Kubernetes API (same models and kubeconfig handling as the
  official Python client: exec plugins, client certificates, OIDC, merged KUBECONFIG lists);
- it runs on aiohttp, the HTTP client the gateway already uses for its upstreams (lightkube and
  kr8s bring httpx and, for kr8s, half a dozen more packages into the image);
- in a pod it re-reads the projected ServiceAccount token every minute (bound tokens expire;
  lightkube reads it once), and its Watch resumes from the last resourceVersion it saw, bookmarks
  included (kr8s restarts a watch that ended from its first version).
On top of it, this module adds what none of the three does as the gateway needs it: on a 401 it
reloads the credentials (token file or kubeconfig, exec plugin re-run) and retries; on 410 Gone
it re-lists; on any other failure it resumes the watch from the last version seen after a
capped, jittered exponential backoff (so a thousand gateways do not hammer a recovering API
server in step); and it filters by label on its side too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client as kube_client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException, load_kube_config
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader
from kubernetes_asyncio.watch import Watch
from llmendpoints_common.model_names import creation_time, served_model_name
from llmendpoints_edge.keys import parse_key_list

from llmendpoints_gateway.keys import (
    KEY_SECRET_LABEL,
    Key,
    KeyFileError,
    KeyRing,
    secret_api_key,
)
from llmendpoints_gateway.registry import Registry
from llmendpoints_gateway.routing import Strategy

logger = logging.getLogger("llmendpoints.gateway.discovery")

# The operator's labels on an endpoint's Service, copied to its EndpointSlices (operator
# manifests.py; tests/contract checks they stay equal).
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "llmendpoints-operator"
LABEL_ENDPOINT = "llmendpoints.dev/endpoint"
SLICE_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_ENDPOINT}"
PORT_NAME = "http"
CONTROL_PORT_NAME = "control"  # the runtime's LLMEP_CONTROL_PORT (operator manifests.py)
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
KEYS_REFRESH_SECONDS = 30.0
# A watch asks the API server to end it after about this long (randomised, as client-go does, so
# that the gateways' watches do not all end together) and resumes from its last version.
WATCH_SECONDS = 300
BACKOFF_BASE_SECONDS = 0.5
BACKOFF_CAP_SECONDS = 30.0

GROUP, VERSION, PLURAL = "llmendpoints.dev", "v1alpha1", "llmendpoints"
DEFAULT_STARTUP_TIMEOUT = 3600.0  # the CRD's default of spec.engine.startupTimeoutSeconds
_sleep = asyncio.sleep  # the backoff's wait (tests record it)


# ------------------------------------------------------------------ pure views of objects


@dataclass(frozen=True)
class EndpointView:
    namespace: str
    name: str
    models: tuple[str, ...]
    routing: Strategy
    keys_secret: tuple[str, str] | None  # (secret name, data key)
    startup_timeout: float | None = None  # spec.engine.startupTimeoutSeconds
    # metadata.creationTimestamp (epoch seconds; None: unknown): the oldest claimant keeps a
    # model name (llmendpoints_common.model_names, the operator's rule too).
    created: float | None = None
    # The last cold start's length (status.coldStart.last.seconds, else the autoscaler's
    # status.autoscaling.coldStart.seconds): the Retry-After of a request refused while it wakes.
    cold_start: float | None = None

    @property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"


def last_cold_start(status: Mapping[str, Any]) -> float | None:
    for block in (
        (status.get("coldStart") or {}).get("last"),
        (status.get("autoscaling") or {}).get("coldStart"),
    ):
        seconds = (block or {}).get("seconds") if isinstance(block, Mapping) else None
        if isinstance(seconds, int | float) and seconds > 0:
            return float(seconds)
    return None


def endpoint_view(obj: Mapping[str, Any]) -> EndpointView:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    name = meta["name"]
    model = served_model_name(name, spec)
    try:
        routing = Strategy(spec.get("routing") or Strategy.PREFIX_AWARE)
    except ValueError:
        logger.warning(
            "endpoint %s: unknown spec.routing %r; using prefix-aware", name, spec.get("routing")
        )
        routing = Strategy.PREFIX_AWARE
    ref = (spec.get("api") or {}).get("apiKeysSecretRef") or None
    secret = (ref["name"], ref["key"]) if ref and ref.get("name") and ref.get("key") else None
    startup = (spec.get("engine") or {}).get("startupTimeoutSeconds", DEFAULT_STARTUP_TIMEOUT)
    startup = float(startup) if isinstance(startup, int | float) else DEFAULT_STARTUP_TIMEOUT
    created = creation_time(meta.get("creationTimestamp"))
    return EndpointView(
        meta.get("namespace", ""), name, (model,), routing, secret, startup, created,
        last_cold_start(obj.get("status") or {}),
    )  # fmt: skip


def is_operator_slice(obj: Mapping[str, Any]) -> bool:
    """The slice belongs to an endpoint's Service (the selector, checked on our side too)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_MANAGED_BY) == MANAGED_BY and bool(labels.get(LABEL_ENDPOINT))


def slice_backends(obj: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """(endpoint name, {ready backend URL: its pod's name}) of one EndpointSlice."""
    endpoint, found = slice_pods(obj)
    return endpoint, {url: pod for url, (pod, _) in found.items()}


def slice_pods(obj: Mapping[str, Any]) -> tuple[str | None, dict[str, tuple[str, str | None]]]:
    """(endpoint name, {ready backend URL: (its pod's name, its control port's URL)}) of one
    EndpointSlice: port ``http`` serves, port ``control`` answers probes and /metrics (the
    gateway reads engine load there; None when the slice has no such port)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    endpoint = labels.get(LABEL_ENDPOINT) if is_operator_slice(obj) else None
    ports = {p.get("name"): p.get("port") for p in obj.get("ports") or []}
    port, control = ports.get(PORT_NAME), ports.get(CONTROL_PORT_NAME)
    if endpoint is None or port is None:
        return endpoint, {}
    ipv6 = obj.get("addressType") == "IPv6"
    backends: dict[str, tuple[str, str | None]] = {}
    for item in obj.get("endpoints") or []:
        conditions = item.get("conditions") or {}
        # Kubernetes: a missing `ready` means ready; terminating pods have ready false.
        if conditions.get("ready") is False:
            continue
        target = item.get("targetRef") or {}
        for address in item.get("addresses") or []:
            host = f"[{address}]" if ipv6 else address
            pod = target.get("name") if target.get("kind", "Pod") == "Pod" else None
            backends[f"http://{host}:{port}"] = (
                pod or address,
                f"http://{host}:{control}" if control is not None else None,
            )
    return endpoint, backends


@dataclass
class Backoff:
    """Capped exponential backoff with jitter: attempt n waits between half and all of
    min(cap, base * 2**n) ("equal jitter": spread out, never a tight loop)."""

    base: float = BACKOFF_BASE_SECONDS
    cap: float = BACKOFF_CAP_SECONDS
    attempt: int = 0
    rand: Callable[[], float] = field(default=random.random, repr=False)

    def next(self) -> float:
        ceiling = min(self.cap, self.base * 2 ** min(self.attempt, 32))
        self.attempt += 1
        return ceiling / 2 + self.rand() * ceiling / 2

    def reset(self) -> None:
        self.attempt = 0


# ------------------------------------------------------------------ credentials


class KubeAuth:
    """Where the credentials come from, and reloading them: an explicit KUBECONFIG first (as
    the operator does), else the pod's ServiceAccount, else ~/.kube/config.

    kubernetes-asyncio re-reads a pod's token file every minute by itself; `reload` (on a 401)
    re-reads it at once, or re-loads the kubeconfig (a rotated token, a re-run exec plugin)."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        sa_dir: Path = SA_DIR,
    ) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.sa_dir = sa_dir
        self.configuration = kube_client.Configuration()

    @property
    def in_cluster(self) -> bool:
        return (
            not self.environ.get("KUBECONFIG")
            and bool(self.environ.get("KUBERNETES_SERVICE_HOST"))
            and (self.sa_dir / "token").is_file()
        )

    @property
    def source(self) -> str:
        if self.in_cluster:
            return f"the ServiceAccount token in {self.sa_dir}"
        return self.environ.get("KUBECONFIG") or "~/.kube/config"

    async def load(self) -> None:
        """Raises ConfigException (or OSError) naming what is wrong."""
        if self.in_cluster:
            InClusterConfigLoader(
                token_filename=str(self.sa_dir / "token"),
                cert_filename=str(self.sa_dir / "ca.crt"),
                environ=self.environ,  # type: ignore[arg-type]
            ).load_and_set(self.configuration)
        else:
            path = self.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
            missing = [p for p in path.split(os.pathsep) if p and not os.path.isfile(p)]
            if missing:
                where = "KUBECONFIG" if self.environ.get("KUBECONFIG") else "the default kubeconfig"
                raise ConfigException(
                    f"{where} {missing[0]}: no such file (and no in-cluster ServiceAccount)"
                )
            try:
                await load_kube_config(
                    config_file=path, client_configuration=self.configuration, persist_config=False
                )
            except ConfigException as exc:
                raise ConfigException(f"kubeconfig {path}: {exc}") from None

    async def reload(self) -> None:
        try:
            await self.load()
        except (ConfigException, OSError) as exc:
            logger.error("re-reading Kubernetes credentials from %s failed: %s", self.source, exc)


# ------------------------------------------------------------------ the watcher

Handler = Callable[[str, Mapping[str, Any]], Awaitable[None]]


@dataclass
class Watched:
    """One list+watch: what to call, what to keep, what to tell."""

    what: str  # for logs
    list_call: Callable[..., Awaitable[Any]]
    handler: Handler
    known: Callable[[], list[tuple[str, str]]]  # keys the handler holds (for re-list deletions)
    selector: str | None = None
    accept: Callable[[Mapping[str, Any]], bool] = lambda obj: True
    version: str | None = None  # where the watch resumes; None: list first
    backoff: Backoff = field(default_factory=Backoff)


class KubeDiscovery:
    def __init__(
        self,
        registry: Registry,
        keys: KeyRing,
        namespace: str | None = None,
        keys_namespace: str | None = None,
        auth: KubeAuth | None = None,
        endpoint_keys: bool = False,
    ):
        self.endpoint_keys = endpoint_keys
        self.registry = registry
        self.keys = keys
        self.namespace = namespace
        self.keys_namespace = keys_namespace or own_namespace()
        self.auth = auth or KubeAuth()
        # (namespace, name) -> its key, or None for a malformed one (which still makes keys
        # required: a typo in a Secret must not open the gateway).
        self._key_secrets: dict[tuple[str, str], tuple[bytes, Key] | None] = {}
        self._endpoints: dict[tuple[str, str], EndpointView] = {}
        self._slices: dict[
            tuple[str, str], tuple[str | None, dict[str, tuple[str, str | None]]]
        ] = {}
        self._tasks: list[asyncio.Task] = []
        self._api: kube_client.ApiClient | None = None
        self._reauth: asyncio.Task | None = None

    async def start(self) -> None:
        await self.auth.load()
        self._api = kube_client.ApiClient(self.auth.configuration)
        custom = kube_client.CustomObjectsApi(self._api)
        slices = kube_client.DiscoveryV1Api(self._api)
        core = kube_client.CoreV1Api(self._api)
        if self.namespace:
            endpoints_call = _bind(custom.list_namespaced_custom_object, GROUP, VERSION,
                                   self.namespace, PLURAL)  # fmt: skip
            slices_call = _bind(slices.list_namespaced_endpoint_slice, self.namespace)
        else:
            endpoints_call = _bind(custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
            slices_call = _bind(slices.list_endpoint_slice_for_all_namespaces)
        self._core = core
        watched = [
            Watched("LLMEndpoints", endpoints_call, self._on_endpoint, lambda: list(self._endpoints)),
            Watched(
                "EndpointSlices", slices_call, self._on_slice, lambda: list(self._slices),
                selector=SLICE_SELECTOR, accept=is_operator_slice,
            ),
            Watched(
                f"key Secrets in {self.keys_namespace}",
                _bind(core.list_namespaced_secret, self.keys_namespace),
                self._on_key_secret, lambda: list(self._key_secrets),
                selector=KEY_SECRET_LABEL,
                accept=lambda obj: KEY_SECRET_LABEL in ((obj.get("metadata") or {}).get("labels") or {}),
            ),
        ]  # fmt: skip
        self._tasks = [asyncio.create_task(self._watch(w)) for w in watched]
        self._tasks.append(asyncio.create_task(self._refresh_keys_forever()))
        logger.info(
            "discovering endpoints from the Kubernetes API at %s (credentials: %s)",
            self.auth.configuration.host,
            self.auth.source,
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._api is not None:
            await self._api.close()

    # -- list + watch --

    async def _watch(self, w: Watched) -> None:
        while True:
            try:
                if w.version is None:
                    await self._list(w)
                await self._stream(w)
                w.backoff.reset()  # ended by the server's timeout: resume at once
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:  # the version is too old to resume from: list again
                    logger.info("watch of %s expired (410 Gone); re-listing", w.what)
                    w.version = None
                    continue
                if exc.status == 401:
                    logger.warning("watching %s: 401 Unauthorized; re-reading credentials", w.what)
                    await self._reauthenticate()
                delay = w.backoff.next()
                logger.warning(
                    "watching %s failed (HTTP %s: %s); retrying in %.1f s",
                    w.what, exc.status, exc.reason, delay,
                )  # fmt: skip
                await _sleep(delay)
            except Exception as exc:  # the connection, a malformed answer...: never give up
                delay = w.backoff.next()
                logger.warning(
                    "watching %s failed (%s); resuming from version %s in %.1f s",
                    w.what, exc or type(exc).__name__, w.version or "(re-list)", delay,
                )  # fmt: skip
                await _sleep(delay)

    async def _list(self, w: Watched) -> None:
        kwargs = {"label_selector": w.selector} if w.selector else {}
        listing = await self._call(w.list_call, **kwargs)
        items = [item for item in listing.get("items") or [] if w.accept(item)]
        seen = {_key(item) for item in items}
        for key in [k for k in w.known() if k not in seen]:
            await w.handler("DELETED", {"metadata": {"namespace": key[0], "name": key[1]}})
        for item in items:
            await w.handler("ADDED", item)
        if w.handler == self._on_key_secret:
            self._publish_keys()  # listed: even none is now known to be none
        w.version = (listing.get("metadata") or {}).get("resourceVersion") or None

    async def _stream(self, w: Watched) -> None:
        kwargs: dict[str, Any] = {
            "allow_watch_bookmarks": True,
            "timeout_seconds": int(WATCH_SECONDS * (1 + random.random())),
        }
        kwargs["_request_timeout"] = kwargs["timeout_seconds"] + 30  # a silently dead connection
        if w.selector:
            kwargs["label_selector"] = w.selector
        if w.version:
            kwargs["resource_version"] = w.version
        async with Watch() as watch:
            async for event in watch.stream(w.list_call, **kwargs):
                # Watch keeps the last version of every event and bookmark: resume from there.
                w.version = watch.resource_version or w.version
                kind, obj = event.get("type"), event.get("raw_object") or {}
                if kind in ("ADDED", "MODIFIED", "DELETED") and w.accept(obj):
                    await w.handler(kind, obj)

    async def _call(self, call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """One API read as raw JSON; a 401 re-reads the credentials and retries once."""
        for attempt in (1, 2):
            try:
                response = await call(*args, _preload_content=False, **kwargs)
                try:
                    # Unloaded content is not status-checked by the client: do it here.
                    if not 200 <= response.status < 300:
                        raise ApiException(status=response.status, reason=await _message(response))
                    return await response.json()
                finally:
                    response.release()
            except ApiException as exc:
                if exc.status != 401 or attempt == 2:
                    raise
                logger.warning("Kubernetes API: 401 Unauthorized; re-reading credentials")
                await self._reauthenticate()
        raise AssertionError("not reached")

    async def _reauthenticate(self) -> None:
        """One reload for every caller that saw the same 401 at about the same time."""
        if self._reauth is None or self._reauth.done():
            self._reauth = asyncio.ensure_future(self.auth.reload())
        await asyncio.shield(self._reauth)

    # -- handlers --

    async def _on_key_secret(self, kind: str, obj: Mapping[str, Any]) -> None:
        key = _key(obj)
        if kind == "DELETED":
            self._key_secrets.pop(key, None)
        else:
            try:
                self._key_secrets[key] = secret_api_key(obj)
            except KeyFileError as exc:
                # A malformed Secret is no key (its old value neither): fail closed, say why.
                logger.error("ignoring API key %s", exc)
                self._key_secrets[key] = None
        self._publish_keys()

    def _publish_keys(self) -> None:
        keys = dict(v for v in self._key_secrets.values() if v is not None)
        self.keys.set_secret_keys(keys if self._key_secrets else None)

    async def _on_endpoint(self, kind: str, obj: Mapping[str, Any]) -> None:
        key = _key(obj)
        if kind == "DELETED":
            view = self._endpoints.pop(key, None)
            if view is not None:
                self.registry.remove(view.id)
                self.keys.set_endpoint_keys(view.id, [])
            return
        view = endpoint_view(obj)
        self._endpoints[key] = view
        self.registry.upsert(
            view.name, view.models, view.routing, namespace=view.namespace,
            startup_timeout=view.startup_timeout, created=view.created,
            cold_start=view.cold_start,
        )  # fmt: skip
        await self._load_keys(view)
        self._publish_ready(view)

    async def _on_slice(self, kind: str, obj: Mapping[str, Any]) -> None:
        key = _key(obj)
        before = self._slices.get(key, (None, {}))[0]
        if kind == "DELETED":
            self._slices.pop(key, None)
        else:
            self._slices[key] = slice_pods(obj)
        after = self._slices.get(key, (None, {}))[0]
        for name in {before, after} - {None}:
            view = self._endpoints.get((key[0], name))
            if view is not None:
                self._publish_ready(view)

    def _publish_ready(self, view: EndpointView) -> None:
        backends: dict[str, tuple[str, str | None]] = {}
        for (namespace, _), (endpoint, found) in self._slices.items():
            if namespace == view.namespace and endpoint == view.name:
                backends.update(found)
        self.registry.set_ready(
            view.id,
            list(backends),
            names={url: pod for url, (pod, _) in backends.items()},
            controls={url: c for url, (_, c) in backends.items() if c is not None},
        )

    async def _load_keys(self, view: EndpointView) -> None:
        # An endpoint's own keys (apiKeysSecretRef) only with GATEWAY_ENDPOINT_KEYS: reading
        # them takes `get` on Secrets in every namespace served; by default the gateway's keys
        # are its tenant keys alone, in its key namespace.
        if view.keys_secret is None or not self.endpoint_keys:
            self.keys.set_endpoint_keys(view.id, [])
            return
        secret_name, data_key = view.keys_secret
        try:
            secret = await self._call(
                self._core.read_namespaced_secret, secret_name, view.namespace
            )
            encoded = (secret.get("data") or {}).get(data_key)
            if encoded is None:
                raise KeyError(f"the Secret has no key {data_key!r}")
            secrets = parse_key_list(base64.b64decode(encoded).decode("utf-8"))
        except Exception as exc:
            # Fail closed: an endpoint whose keys cannot be read accepts no key but the
            # gateway's own -- and needs one (a placeholder nobody can present).
            logger.error(
                "endpoint %s: cannot read keys from Secret %s/%s (%s)",
                view.id,
                view.namespace,
                secret_name,
                _reason(exc),
            )
            if not self.keys.requires_key(view.id):
                self.keys.set_endpoint_keys(view.id, [os.urandom(32).hex()])
            return
        self.keys.set_endpoint_keys(view.id, secrets)

    async def _refresh_keys_forever(self) -> None:
        while True:
            await asyncio.sleep(KEYS_REFRESH_SECONDS)
            for view in list(self._endpoints.values()):
                with contextlib.suppress(Exception):
                    await self._load_keys(view)


def _bind(call: Callable[..., Awaitable[Any]], *args: Any) -> Callable[..., Awaitable[Any]]:
    """A list call with its positional arguments bound. Having no docstring, it gives Watch no
    return type to deserialise events into: the handlers read the raw objects (dicts)."""

    async def bound(**kwargs: Any) -> Any:
        return await call(*args, **kwargs)

    return bound


async def _message(response: Any) -> str:
    """The API server's Status message of an error answer, else its HTTP reason."""
    try:
        return str((await response.json()).get("message") or response.reason)
    except Exception:
        return str(response.reason)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status}: {exc.reason}"
    return str(exc) or type(exc).__name__


def own_namespace() -> str:
    """The gateway pod's namespace (its service account's), else ``default``."""
    try:
        return (SA_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return os.environ.get("POD_NAMESPACE") or "default"


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")

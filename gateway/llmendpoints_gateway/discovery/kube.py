"""Kubernetes discovery: LLMEndpoints for names, served models, routing and keys; EndpointSlices
for the ready pods. Both are watched (list, then a watch stream; re-listed after any error), so a
pod becoming ready or going away reaches the routing table as soon as the API server tells.

- LLMEndpoint ``name`` is the endpoint id (``/v2/<name>/...``); its model is
  ``spec.model.servedModelName`` (default: the name), its strategy ``spec.routing``.
- EndpointSlices labelled ``kubernetes.io/service-name: <name>`` (the operator's Service has
  the endpoint's name), port named ``http``, endpoints whose ``conditions.ready`` is not false.
- ``spec.api.apiKeysSecretRef``: the Secret's key holds that endpoint's API keys (the runtime's
  file format); re-read on every change of the endpoint and every 30 s (rotations).
- Secrets labelled ``llmendpoints.dev/api-key`` in GATEWAY_KEYS_NAMESPACE (default: the
  gateway's own namespace): one API key each, with its name, endpoints and limits
  (keys.secret_api_key). Watched, so a new, changed or deleted key Secret takes effect on every
  replica as soon as the API server tells it (well within 5 s). While at least one exists,
  every request needs a key.

Endpoint ids are names, so two endpoints of one name in different namespaces collide: the
last one seen wins and a warning says so; GATEWAY_NAMESPACE limits the gateway to one namespace.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
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

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PORT_NAME = "http"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
KEYS_REFRESH_SECONDS = 30.0


# ------------------------------------------------------------------ pure views of objects


@dataclass(frozen=True)
class EndpointView:
    namespace: str
    name: str
    models: tuple[str, ...]
    routing: Strategy
    keys_secret: tuple[str, str] | None  # (secret name, data key)


def endpoint_view(obj: Mapping[str, Any]) -> EndpointView:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    name = meta["name"]
    model = (spec.get("model") or {}).get("servedModelName") or name
    try:
        routing = Strategy(spec.get("routing") or Strategy.PREFIX_AWARE)
    except ValueError:
        logger.warning(
            "endpoint %s: unknown spec.routing %r; using prefix-aware", name, spec.get("routing")
        )
        routing = Strategy.PREFIX_AWARE
    ref = (spec.get("api") or {}).get("apiKeysSecretRef") or None
    secret = (ref["name"], ref["key"]) if ref and ref.get("name") and ref.get("key") else None
    return EndpointView(meta.get("namespace", ""), name, (model,), routing, secret)


def slice_backends(obj: Mapping[str, Any]) -> tuple[str | None, list[str]]:
    """(service name, ready backend URLs) of one EndpointSlice."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    service = labels.get(SERVICE_NAME_LABEL)
    port = next((p.get("port") for p in obj.get("ports") or [] if p.get("name") == PORT_NAME), None)
    if service is None or port is None:
        return service, []
    ipv6 = obj.get("addressType") == "IPv6"
    urls = []
    for endpoint in obj.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        # Kubernetes: a missing `ready` means ready; terminating pods have ready false.
        if conditions.get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ipv6 else address
            urls.append(f"http://{host}:{port}")
    return service, urls


# ------------------------------------------------------------------ connection


@dataclass
class Connection:
    server: str
    headers: dict[str, str]
    ssl: ssl.SSLContext | bool


def load_connection() -> Connection:
    """In-cluster service account, else KUBECONFIG (or ~/.kube/config), current context."""
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT"),
    )
    if host and port and (SA_DIR / "token").exists():
        context = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        token = (SA_DIR / "token").read_text().strip()
        return Connection(f"https://{host}:{port}", {"Authorization": f"Bearer {token}"}, context)
    path = os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config")).split(os.pathsep)[0]
    config = yaml.safe_load(Path(path).read_text())
    current = config.get("current-context")
    context = next(c["context"] for c in config["contexts"] if c["name"] == current)
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user = (
        next((u["user"] for u in config.get("users", []) if u["name"] == context.get("user")), {})
        or {}
    )
    headers = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
    server = cluster["server"].rstrip("/")
    if not server.startswith("https://"):
        return Connection(server, headers, False)
    if cluster.get("insecure-skip-tls-verify"):
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    else:
        ctx = ssl.create_default_context(cafile=_file(cluster, "certificate-authority"))
    cert = _file(user, "client-certificate")
    if cert:
        ctx.load_cert_chain(cert, _file(user, "client-key"))
    return Connection(server, headers, ctx)


def _file(section: Mapping[str, Any], name: str) -> str | None:
    if section.get(name):
        return section[name]
    data = section.get(f"{name}-data")
    if not data:
        return None
    handle = tempfile.NamedTemporaryFile(delete=False, suffix=".pem")  # noqa: SIM115
    handle.write(base64.b64decode(data))
    handle.close()
    return handle.name


# ------------------------------------------------------------------ the watcher


class KubeDiscovery:
    def __init__(
        self,
        registry: Registry,
        keys: KeyRing,
        namespace: str | None = None,
        keys_namespace: str | None = None,
    ):
        self.registry = registry
        self.keys = keys
        self.namespace = namespace
        self.keys_namespace = keys_namespace or own_namespace()
        # (namespace, name) -> its key, or None for a malformed one (which still makes keys
        # required: a typo in a Secret must not open the gateway).
        self._key_secrets: dict[tuple[str, str], tuple[bytes, Key] | None] = {}
        self._endpoints: dict[tuple[str, str], EndpointView] = {}
        self._slices: dict[tuple[str, str], tuple[str | None, list[str]]] = {}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    def _path(self, group_version: str, plural: str) -> str:
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        return (
            f"{base}/namespaces/{self.namespace}/{plural}" if self.namespace else f"{base}/{plural}"
        )

    async def start(self) -> None:
        conn = load_connection()
        self._conn = conn
        self._session = aiohttp.ClientSession(
            base_url=None,
            headers=conn.headers,
            connector=aiohttp.TCPConnector(ssl=conn.ssl),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None),
        )
        self._tasks = [
            asyncio.create_task(
                self._watch(
                    self._path("llmendpoints.dev/v1alpha1", "llmendpoints"), self._on_endpoint
                )
            ),
            asyncio.create_task(
                self._watch(
                    self._path("discovery.k8s.io/v1", "endpointslices"),
                    self._on_slice,
                    label_selector=SERVICE_NAME_LABEL,
                )
            ),
            asyncio.create_task(self._refresh_keys_forever()),
            asyncio.create_task(
                self._watch(
                    f"/api/v1/namespaces/{self.keys_namespace}/secrets",
                    self._on_key_secret,
                    label_selector=KEY_SECRET_LABEL,
                )
            ),
        ]
        logger.info("discovering endpoints from the Kubernetes API at %s", conn.server)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _watch(
        self,
        path: str,
        handler: Callable[[str, Mapping[str, Any]], Any],
        label_selector: str | None = None,
    ) -> None:
        assert self._session is not None
        url = self._conn.server + path
        params = {"labelSelector": label_selector} if label_selector else {}
        while True:
            try:
                async with self._session.get(url, params=params) as response:
                    if response.status != 200:
                        raise RuntimeError(
                            f"list {path}: HTTP {response.status}: {(await response.text())[:200]}"
                        )
                    listing = await response.json()
                items = listing.get("items") or []
                seen = {_key(item) for item in items}
                for key in [k for k in self._known(handler) if k not in seen]:
                    await handler("DELETED", {"metadata": {"namespace": key[0], "name": key[1]}})
                for item in items:
                    await handler("ADDED", item)
                if handler == self._on_key_secret:
                    self._publish_keys()  # listed: even none is now known to be none
                version = (listing.get("metadata") or {}).get("resourceVersion")
                watch_params = {**params, "watch": "true", "allowWatchBookmarks": "true"}
                if version:
                    watch_params["resourceVersion"] = version
                async with self._session.get(url, params=watch_params) as response:
                    if response.status != 200:
                        raise RuntimeError(f"watch {path}: HTTP {response.status}")
                    async for line in response.content:
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        kind = event.get("type")
                        if kind == "ERROR":
                            raise RuntimeError(f"watch {path}: {event.get('object')}")
                        if kind in ("ADDED", "MODIFIED", "DELETED"):
                            await handler(kind, event["object"])
                logger.debug("watch %s ended; re-listing", path)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("watching %s failed (%s); retrying in 1 s", path, exc)
                await asyncio.sleep(1.0)

    def _known(self, handler) -> list[tuple[str, str]]:
        if handler == self._on_key_secret:
            return list(self._key_secrets)
        return list(self._endpoints if handler == self._on_endpoint else self._slices)

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
            if view is not None and not any(v.name == view.name for v in self._endpoints.values()):
                self.registry.remove(view.name)
                self.keys.set_endpoint_keys(view.name, [])
            return
        view = endpoint_view(obj)
        clash = [k for k, v in self._endpoints.items() if v.name == view.name and k != key]
        if clash:
            logger.warning(
                "endpoint name %s exists in namespaces %s and %s; routing to %s",
                view.name,
                clash[0][0],
                view.namespace,
                view.namespace,
            )
        self._endpoints[key] = view
        self.registry.upsert(view.name, view.models, view.routing, view.namespace or "default")
        await self._load_keys(view)
        self._publish_ready(view.name)

    async def _on_slice(self, kind: str, obj: Mapping[str, Any]) -> None:
        key = _key(obj)
        before = self._slices.get(key, (None, []))[0]
        if kind == "DELETED":
            self._slices.pop(key, None)
        else:
            self._slices[key] = slice_backends(obj)
        for service in {before, self._slices.get(key, (None, []))[0]} - {None}:
            self._publish_ready(service)

    def _publish_ready(self, endpoint: str) -> None:
        namespace = next(
            (v.namespace for v in self._endpoints.values() if v.name == endpoint), None
        )
        if namespace is None:
            return
        urls = [
            url
            for (ns, _), (service, backends) in self._slices.items()
            if ns == namespace and service == endpoint
            for url in backends
        ]
        self.registry.set_ready(endpoint, urls)

    async def _load_keys(self, view: EndpointView) -> None:
        if view.keys_secret is None:
            self.keys.set_endpoint_keys(view.name, [])
            return
        secret_name, data_key = view.keys_secret
        url = f"{self._conn.server}/api/v1/namespaces/{view.namespace}/secrets/{secret_name}"
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}")
                secret = await response.json()
            encoded = (secret.get("data") or {}).get(data_key)
            if encoded is None:
                raise RuntimeError(f"the Secret has no key {data_key!r}")
            secrets = parse_key_list(base64.b64decode(encoded).decode("utf-8"))
        except Exception as exc:
            # Fail closed: an endpoint whose keys cannot be read accepts no key but the
            # gateway's own -- and needs one (a placeholder nobody can present).
            logger.error(
                "endpoint %s: cannot read keys from Secret %s/%s (%s)",
                view.name,
                view.namespace,
                secret_name,
                exc,
            )
            if not self.keys.requires_key(view.name):
                self.keys.set_endpoint_keys(view.name, [os.urandom(32).hex()])
            return
        self.keys.set_endpoint_keys(view.name, secrets)

    async def _refresh_keys_forever(self) -> None:
        while True:
            await asyncio.sleep(KEYS_REFRESH_SECONDS)
            for view in list(self._endpoints.values()):
                with contextlib.suppress(Exception):
                    await self._load_keys(view)


def own_namespace() -> str:
    """The gateway pod's namespace (its service account's), else ``default``."""
    try:
        return (SA_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return os.environ.get("POD_NAMESPACE") or "default"


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")

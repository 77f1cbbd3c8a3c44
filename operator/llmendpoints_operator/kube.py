"""The ONLY module of the operator that talks to the Kubernetes API (besides kopf's own watching).

A small asyncio client over aiohttp, authenticated with the credentials kopf logged in with
(kubeconfig or the in-cluster service account; see handlers.login). It knows exactly the kinds the
operator writes, and offers the verbs the reconcile needs:

- `apply`: server-side apply (PATCH application/apply-patch+yaml, our field manager, force) so
  that fields other controllers own (the autoscaler's replicas, a mutating webhook's sidecars)
  are never clobbered;
- `create`: POST, used for the first write of a Deployment so that `replicas` is owned by an
  Update operation and later applies that omit it do not remove it (see manifests.replicas_to_write),
  and for Events (events.py);
- `patch`: JSON merge patch, e.g. of `status` or the `scale` subresource;
- `list` (by label selector) and `delete` (a missing object is not an error);
- for the fit check: `list_nodes` (their GPU feature discovery labels) and `secret_value` (an
  endpoint's hub token, only where the chart grants `get` on Secrets).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

logger = logging.getLogger(__name__)

# (apiVersion, kind) -> plural; all of them namespaced.
PLURALS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    # Created: the endpoint's admin key; read (when allowed): the hub token of spec.model.
    ("v1", "Secret"): "secrets",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "Ingress"): "ingresses",
    # Optional: only when the Gateway API Inference Extension's CRDs are installed.
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    # Optional: a multi-node endpoint's groups, only where LeaderWorkerSet is installed.
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    ("llmendpoints.dev/v1alpha1", "LLMEndpoint"): "llmendpoints",
    ("v1", "Event"): "events",  # posted by events.py
    # Read only: a multi-node endpoint's pods, listed while a group is not ready (the status
    # says which pod keeps it from being ready).
    ("v1", "Pod"): "pods",
    ("discovery.k8s.io/v1", "EndpointSlice"): "endpointslices",
}


class ApiError(Exception):
    """The API server refused a request; `status` is the HTTP status, `reason` Kubernetes' word."""

    def __init__(self, status: int, reason: str, message: str):
        self.status, self.reason, self.message = status, reason, message
        super().__init__(f"{status} {reason}: {message}")


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    pass


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    try:
        plural = PLURALS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not manage {kind} ({api_version})") from None
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{quote(namespace, safe='')}/{plural}"
    return path if name is None else f"{path}/{quote(name, safe='')}"


@dataclass(frozen=True)
class Connection:
    """Where and how to connect: kopf's ConnectionInfo mapped to what aiohttp needs."""

    server: str
    headers: Mapping[str, str]
    ssl: Any  # ssl.SSLContext | bool | None
    proxy: str | None = None


Relogin = Callable[[], Awaitable[Connection]]


class KubeClient:
    """One shared aiohttp session; re-authenticates once on 401 (rotated service-account tokens)."""

    def __init__(
        self, connection: Connection, *, field_manager: str, relogin: Relogin | None = None
    ):
        self._connection = connection
        self._field_manager = field_manager
        self._relogin = relogin
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            conn = self._connection
            self._session = aiohttp.ClientSession(
                base_url=conn.server.rstrip("/") + "/",
                headers={"User-Agent": "llmendpoints-operator", **conn.headers},
                connector=aiohttp.TCPConnector(ssl=conn.ssl if conn.ssl is not None else True),
                timeout=aiohttp.ClientTimeout(total=60),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        retry_auth: bool = True,
    ) -> dict[str, Any]:
        session = self._open()
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        headers = {"Content-Type": content_type} if data is not None else {}
        async with session.request(
            method,
            path.lstrip("/"),
            data=data,
            headers=headers,
            params=params,
            proxy=self._connection.proxy,
        ) as response:
            text = await response.text()
            if response.status == 401 and retry_auth and self._relogin is not None:
                self._connection = await self._relogin()
                await self.close()
                return await self._request(
                    method,
                    path,
                    body=body,
                    content_type=content_type,
                    params=params,
                    retry_auth=False,
                )
            if response.status >= 400:
                raise _error(response.status, text)
            return json.loads(text) if text else {}

    async def list(
        self, api_version: str, kind: str, namespace: str, *, label_selector: str
    ) -> list[dict[str, Any]]:
        result = await self._request(
            "GET",
            object_path(api_version, kind, namespace),
            params={"labelSelector": label_selector},
        )
        return list(result.get("items") or [])

    async def list_nodes(self) -> list[dict[str, Any]]:
        """Every node (cluster-scoped; the fit check reads their GPU labels and taints)."""
        result = await self._request("GET", "/api/v1/nodes")
        return list(result.get("items") or [])

    async def secret_value(self, namespace: str, name: str, key: str) -> str:
        """One key of a Secret, decoded; NotFound when the Secret or the key is missing."""
        secret = await self._request("GET", object_path("v1", "Secret", namespace, name))
        raw = (secret.get("data") or {}).get(key)
        if raw is None:
            raise NotFound(404, "NotFound", f"Secret {name} has no key {key}")
        try:
            return base64.b64decode(raw).decode().strip()
        except (binascii.Error, UnicodeDecodeError):
            raise ApiError(422, "Invalid", f"Secret {name}: key {key} is not text") from None

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return await self._request(
            "POST", path, body=obj, params={"fieldManager": self._field_manager}
        )

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` (the full intent for the fields we own); creates it if missing."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return await self._request(
            "PATCH",
            path,
            body=obj,
            content_type="application/apply-patch+yaml",  # JSON is YAML
            params={"fieldManager": self._field_manager, "force": "true"},
        )

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        path = object_path(api_version, kind, namespace, name)
        if subresource is not None:
            path = f"{path}/{subresource}"
        return await self._request(
            "PATCH",
            path,
            body=patch,
            content_type="application/merge-patch+json",
            params={"fieldManager": self._field_manager},
        )

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete an object (children go with it, in the background). False if it did not exist."""
        try:
            await self._request(
                "DELETE",
                object_path(api_version, kind, namespace, name),
                body={
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "propagationPolicy": "Background",
                },
            )
        except NotFound:
            return False
        return True


def _error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
    except ValueError:
        payload = {}
    if not isinstance(payload, dict):
        payload = {}
    reason = str(payload.get("reason") or "Error")
    message = str(payload.get("message") or text[:500])
    cls = NotFound if status == 404 else Conflict if status == 409 else ApiError
    return cls(status, reason, message)


def connection_from_kopf(info: Any) -> Connection:
    """Map kopf.ConnectionInfo (the credentials kopf logged in with) to a Connection."""
    ssl_context: Any = None
    if info.server.startswith("https"):
        ssl_context = info.as_ssl_context()
    return Connection(
        server=info.server,
        headers=dict(info.as_http_headers()),
        ssl=ssl_context,
        proxy=info.proxy_url,
    )

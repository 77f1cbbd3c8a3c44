"""An in-memory Kubernetes API (kmock's KubernetesEmulator) and the real operator process against it.

Shared by tests/integration/ and bench/operator_scale.py. The emulator runs in the caller's event
loop; the operator runs as a subprocess (`python -m llmendpoints_operator run`) pointed at it by a
kubeconfig, exactly as a user would run it.

kmock's emulator stores objects exactly as given. `Emulator` below adds what an API server does
on every write that kopf and the operator rely on: a uid, a resourceVersion that changes on every
write (kopf skips events older than its own last patch by it, and guards its patches with a
JSON-patch test of it: a failed test is a 422, as on a real server), and a generation that
changes when the spec does (the status reports observedGeneration). And the parts of server-side
apply the operator depends on:
- an apply (PATCH application/apply-patch+yaml) of a missing object creates it;
- field ownership of a Deployment's `spec.replicas`, per field manager and operation (Apply or
  Update), as the API server keeps it in managedFields: a create or a merge patch that sets it
  makes (manager, Update) its owner; an apply that sets it makes (manager, Apply) its owner; an
  apply that leaves it out releases (manager, Apply)'s ownership, and when no owner is left the
  field is removed and defaulted to 1 - so a count written by an apply is reset by the next
  apply without it, exactly as on a real cluster. `Cluster.replicas_owners` shows the owners.
Still missing, so the tests do it where they need it: garbage collection, controllers (a
Deployment never gets a status unless a test writes one), and apply semantics for every other
field (an apply is merged like a merge patch: a field an apply stops sending stays).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import attrs
import jsonpatch
import kmock
import yaml
from aiohttp import web
from kmock._internal import dicts as kmock_dicts
from kmock._internal import dsl, rendering

REPO = pathlib.Path(__file__).resolve().parents[2]
LLMEP = "llmendpoints.dev/v1alpha1/llmendpoints"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
Owner = tuple[str, str]  # (field manager, operation: Apply or Update)
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}

# Every kind the operator watches or writes, plus what kopf itself needs.
RESOURCES: dict[str, dict[str, Any]] = {
    LLMEP: {
        "kind": "LLMEndpoint",
        "singular": "llmendpoint",
        "shortnames": {"llmep"},
        "subresources": {"status", "scale"},
    },
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
    },
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "v1/events": {"kind": "Event"},
    "apps/v1/deployments": {"kind": "Deployment", "subresources": {"status", "scale"}},
    "v1/services": {"kind": "Service", "subresources": {"status"}},
    "v1/configmaps": {"kind": "ConfigMap"},
    "v1/secrets": {"kind": "Secret"},  # the endpoints' admin keys
    "v1/persistentvolumeclaims": {"kind": "PersistentVolumeClaim", "subresources": {"status"}},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "subresources": {"status"}},
    "networking.k8s.io/v1/ingresses": {"kind": "Ingress", "subresources": {"status"}},
    "discovery.k8s.io/v1/endpointslices": {"kind": "EndpointSlice"},  # the autoscaler reads them
    "v1/nodes": {"kind": "Node", "namespaced": False},  # the fit check reads their GPU labels
}

CHILD_RESOURCES = {
    "Deployment": "apps/v1/deployments",
    "Service": "v1/services",
    "ConfigMap": "v1/configmaps",
    "Secret": "v1/secrets",
    "PersistentVolumeClaim": "v1/persistentvolumeclaims",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
    "Ingress": "networking.k8s.io/v1/ingresses",
}


def _passes(view: dsl.View, request: kmock.Request) -> bool:
    """Whether a new request belongs to a view, judged on the request alone.

    kmock answers `request in view` by iterating the view over the whole request history, so its
    cost per request grows with every request served. For the chains the emulator's own
    reactions use (root -> priority -> filter), looking at the request itself is equivalent."""
    match view:
        case dsl.Root():
            return True
        case dsl.Filter():
            return _passes(view._source, request) and bool(view.criteria(request))
        case dsl.Priority():
            return _passes(view._source, request)
        case _:
            return request in view  # slices, groups, exclusions: kmock's own answer


class _FastMatching(kmock.RawHandler):
    """RawHandler._handle with `_passes` for membership (same reaction order and semantics)."""

    __slots__ = ()

    async def _handle(self, request: kmock.Request) -> Any:
        # Highest priority first; shorter priority tuples padded with zeros (as kmock does).
        width = max((len(p.priorities) for p in self._payloads), default=0)
        payloads = sorted(
            self._payloads,
            key=lambda p: tuple(-x for x in p.priorities) + (0,) * (width - len(p.priorities)),
        )
        for payload in payloads:
            if _passes(payload._source, request) and not payload._disabled.is_set():
                try:
                    return await payload(request)
                except rendering.ReactionMismatchError:
                    payload._disabled.set()
                except NotImplementedError:
                    pass
        raise NotImplementedError("no reaction matches the request")


_GO_TRUE = {"1", "t", "T", "TRUE", "True"}


def _is_apply(request: kmock.Request) -> bool:
    content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
    return content_type.startswith(APPLY_CONTENT_TYPE)


class Emulator(kmock.KubernetesEmulator, _FastMatching):
    """KubernetesEmulator plus uid, resourceVersion and generation bookkeeping, apply-create, and
    the ownership of Deployments' spec.replicas (see the module's docstring)."""

    _versions = itertools.count(1)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # (namespace, name) of a Deployment -> the owners of its spec.replicas.
        self.replicas_owners: dict[tuple[str | None, str], set[Owner]] = {}
        # Resources (group/version/plural) whose API is not installed: answered 404, as an API
        # server answers for a CRD that does not exist (kmock itself accepts any resource).
        self.uninstalled: set[str] = set()

    def _stored(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    async def _handle(self, request: kmock.Request) -> Any:
        # Nothing here asserts on past requests: do not let the history grow without bound.
        if len(self._requests) > 1024:
            del self._requests[:-512]
        if request.action == kmock.action.LIST and request.params.get("watch") in _GO_TRUE:
            # The API server reads `watch` with Go's strconv.ParseBool; kmock knows only "true"
            # (kubernetes-asyncio, the gateway's client, sends "True").
            request = attrs.evolve(request, action=kmock.action.WATCH)
        if request.resource is not None and any(
            request.resource == kmock.resource(missing) for missing in self.uninstalled
        ):
            raise kmock.KubernetesError(
                status=404,
                reason="NotFound",
                message="the server could not find the requested resource",
            )
        if (
            request.resource is not None
            and request.action == kmock.action.UPDATE
            and _is_apply(request)
            and request.subresource is None
            and self._stored(request) is None
        ):
            request = attrs.evolve(request, action=kmock.action.CREATE)  # apply creates
        if request.resource == kmock.resource(CHILD_RESOURCES["Deployment"]):
            self._own_replicas(request)
        if request.resource is None:
            pass  # discovery and other non-object requests
        elif request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{next(self._versions):05d}"
            meta.setdefault("uid", f"uid-{next(self._versions)}")
            meta.setdefault("creationTimestamp", _now())
            meta["generation"] = 1
            meta["resourceVersion"] = str(next(self._versions))
        elif request.action == kmock.action.UPDATE and request.name is not None:
            self._stamp_update(request)
        try:
            return await super()._handle(request)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc

    def _own_replicas(self, request: kmock.Request) -> None:
        """Track who owns a Deployment's spec.replicas; remove it when an apply releases it last."""
        data = request.data
        if request.subresource is not None or not isinstance(data, dict):
            return
        if not isinstance(data.get("spec"), dict):
            data["spec"] = {}
        spec, meta = data["spec"], data.get("metadata") or {}
        key = (request.namespace or meta.get("namespace"), request.name or meta.get("name"))
        owner = (
            request.params.get("fieldManager", "unknown"),
            "Apply" if _is_apply(request) else "Update",
        )
        if request.action == kmock.action.CREATE:
            self.replicas_owners[key] = {owner} if spec.get("replicas") is not None else set()
            spec.setdefault("replicas", 1)  # the API server's default: nobody owns it
            return
        if request.action != kmock.action.UPDATE or self._stored(request) is None:
            return
        owners = self.replicas_owners.setdefault(key, set())
        current = (self._stored(request).get("spec") or {}).get("replicas")
        if spec.get("replicas") is not None:
            if spec["replicas"] != current:
                owners.clear()  # a changed value belongs to its writer alone (apply forces)
            if spec["replicas"] != current or owner[1] == "Apply":
                owners.add(owner)
        elif owner[1] == "Apply" and owner in owners:
            owners.discard(owner)  # an apply without the field gives it up
            if not owners:
                spec["replicas"] = 1  # removed, then defaulted again

    def _stamp_update(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return
        old = self.objects[key].raw
        version = str(next(self._versions))
        generation = (old.get("metadata") or {}).get("generation") or 1
        data = request.data
        if isinstance(data, list):  # JSON patch
            try:
                new = kmock_dicts.json_patch_dict(copy.deepcopy(old), data)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException):
                return  # the test op fails: the request is answered with a 422
            if request.subresource != "status" and new.get("spec") != old.get("spec"):
                generation += 1
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
            data.append({"op": "add", "path": "/metadata/generation", "value": generation})
        elif isinstance(data, dict):  # merge patch (or an apply, which the emulator merges)
            if request.subresource != "status" and "spec" in data:
                merged = kmock_dicts.merge_patch_dict(old.get("spec") or {}, data["spec"] or {})
                if merged != old.get("spec"):
                    generation += 1
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = version
            meta["generation"] = generation


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Cluster:
    """A running emulator: create/patch objects through its HTTP API, read its store directly."""

    def __init__(self) -> None:
        self.kmock = Emulator()
        self._server = kmock.Server(self.kmock)
        self.url = ""

    async def __aenter__(self) -> Cluster:
        await self.kmock.__aenter__()
        await self._server.__aenter__()
        self.url = str(self._server.url).rstrip("/")
        for resource, info in RESOURCES.items():
            info = {"namespaced": True, "verbs": VERBS, **info}
            self.kmock.resources[resource] = kmock.ResourceInfo(**info)
        crd = yaml.safe_load((REPO / "crds/llmendpoints.dev_llmendpoints.yaml").read_text())
        self.kmock.objects[
            "apiextensions.k8s.io/v1/customresourcedefinitions", None, crd["metadata"]["name"]
        ] = crd
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.__aexit__(*exc)
        await self.kmock.__aexit__(*exc)

    def write_kubeconfig(self, path: pathlib.Path) -> pathlib.Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {}}],
            "contexts": [
                {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}
            ],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # -- writing through the API (so that watchers see the change) --

    async def create(self, resource: str, namespace: str, body: dict[str, Any]) -> None:
        path = _collection_path(resource, namespace)
        async with self._server.client.post(path, json=body) as response:
            assert response.status < 400, await response.text()

    async def patch(
        self,
        resource: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        field_manager: str = "test",
    ) -> None:
        path = f"{_collection_path(resource, namespace)}/{name}"
        async with self._server.client.patch(
            path,
            json=patch,
            params={"fieldManager": field_manager},
            headers={"Content-Type": "application/merge-patch+json"},
        ) as response:
            assert response.status < 400, await response.text()

    async def delete(self, resource: str, namespace: str, name: str) -> None:
        path = f"{_collection_path(resource, namespace)}/{name}"
        async with self._server.client.delete(path) as response:
            assert response.status < 400, await response.text()

    # -- reading the store directly --

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.kmock.objects:
            return None
        obj = self.kmock.objects[key]
        return None if obj.deleted else obj.raw

    def replicas_owners(self, namespace: str, deployment: str) -> set[Owner]:
        """(field manager, operation) pairs owning the Deployment's spec.replicas."""
        return set(self.kmock.replicas_owners.get((namespace, deployment), set()))

    def names(self, resource: str, namespace: str) -> set[str]:
        return {
            name
            for (res, ns, name), obj in self.kmock.objects.items()
            if res == kmock.resource(resource) and ns == namespace and not obj.deleted
        }

    def events(self, namespace: str, involved_name: str) -> list[dict[str, Any]]:
        return [
            obj.raw
            for (res, ns, _), obj in self.kmock.objects.items()
            if res == kmock.resource("v1/events")
            and ns == namespace
            and not obj.deleted
            and obj.raw.get("involvedObject", {}).get("name") == involved_name
        ]


def _collection_path(resource: str, namespace: str | None) -> str:
    res = kmock.resource(resource)
    base = f"/api/{res.version}" if res.group == "" else f"/apis/{res.group}/{res.version}"
    return f"{base}/namespaces/{namespace}/{res.plural}" if namespace else f"{base}/{res.plural}"


def endpoint_slice(
    service: str,
    namespace: str,
    port: int,
    pods: dict[str, str],
    *,
    name: str | None = None,
    port_name: str = "http",
) -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes one for a Service: its ready
    `pods` (pod name -> address) on one port."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name or f"{service}-x7k2p",
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": True},
                "targetRef": {"kind": "Pod", "name": pod},
            }
            for pod, address in pods.items()
        ],
    }


async def serve_metrics(address: str, port: int, text: Callable[[], str]) -> web.AppRunner:
    """A stand-in runtime pod: `text()` as its /metrics on address:port (clean up the runner)."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, address, port).start()
    return runner


def endpoint(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An LLMEndpoint as a user writes it."""
    return {
        "apiVersion": "llmendpoints.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


class Operator:
    """`python -m llmendpoints_operator run -A --standalone` as a subprocess."""

    def __init__(
        self,
        kubeconfig: pathlib.Path,
        log_path: pathlib.Path,
        env: dict[str, str] | None = None,
        metrics_port: int = 0,  # 0: no /metrics
    ):
        self.kubeconfig, self.log_path, self.extra_env = kubeconfig, log_path, env or {}
        self.metrics_port = metrics_port
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> asyncio.subprocess.Process:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "LLMEP_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "PYTHONUNBUFFERED": "1",
            # The fit check reads models from a hub: never the real one from a test (a module
            # with a stand-in hub sets its own); nothing listens on port 1.
            "LLMEP_OPERATOR_HF_ENDPOINT": "http://127.0.0.1:1",
            **self.extra_env,
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self._log = self.log_path.open("ab")
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llmendpoints_operator",
            "run",
            "--all-namespaces",
            "--standalone",
            env=env,
            stdout=self._log,
            stderr=asyncio.subprocess.STDOUT,
        )
        return self.process

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def stop(self) -> int | None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it may exit on its own meanwhile
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), timeout=20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        self._log.close()
        return self.process.returncode if self.process else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def metrics(self) -> str:
        """The operator's own /metrics (it must have been started with a metrics_port)."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as response,
        ):
            return await response.text()


async def wait_for(
    predicate: Callable[[], Any], timeout: float = 60, what: str = "condition"
) -> Any:
    """Poll `predicate` until it returns something truthy (the operator works asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


async def until(
    operator: Operator, predicate: Callable[[], Any], what: str, timeout: float = 60
) -> Any:
    """wait_for, failing at once if the operator exits, with its log in the failure."""

    def check() -> Any:
        assert operator.alive, f"operator exited:\n{operator.log()[-3000:]}"
        return predicate()

    try:
        return await wait_for(check, timeout=timeout, what=what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; operator log:\n{operator.log()[-4000:]}") from None

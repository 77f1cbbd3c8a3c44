"""Static endpoints (GATEWAY_ENDPOINTS_FILE), for local runs and tests.

    endpoints:
      - name: demo                   # endpoint id: /v2/demo/... ; jobs for it
        namespace: default           # optional (default "default"): the queue's identity is
                                     # namespace + name, as the runtime pods' ENDPOINT_NAMESPACE
        models: [demo]               # OpenAI "model" values routed here
        backends: ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
        routing: prefix-aware        # optional: prefix-aware (default), least-loaded, round-robin

Each backend's readiness (``GET /ready?strict=1``: 200 only when its engine serves) is probed by
the gateway pod's reader (pod_reader.py): on the backend's control port once the backend named it
(the runtime does, in a header of its main port's answers), every GATEWAY_IDLE_PROBE_INTERVAL_SECONDS,
and every GATEWAY_PROBE_INTERVAL_SECONDS while the backend is not ready and its endpoint has
requests waiting or in flight. Only ready backends get requests, and an endpoint with none ready
holds them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from llmendpoints_common.identity import DEFAULT_NAMESPACE, check_namespace

from llmendpoints_gateway.pod_reader import PodReader
from llmendpoints_gateway.registry import Registry
from llmendpoints_gateway.routing import Strategy

logger = logging.getLogger("llmendpoints.gateway.discovery")


@dataclass(frozen=True)
class StaticEndpoint:
    name: str
    models: tuple[str, ...]
    backends: tuple[str, ...]
    routing: Strategy = Strategy.PREFIX_AWARE
    namespace: str = DEFAULT_NAMESPACE


class EndpointsFileError(ValueError):
    pass


def parse_endpoints(text: str) -> list[StaticEndpoint]:
    """PURE: the file's text -> endpoints; errors name the entry and field."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise EndpointsFileError(f"not valid YAML: {exc}") from None
    if not isinstance(document, Mapping) or not isinstance(document.get("endpoints"), list):
        raise EndpointsFileError("expected a mapping with an `endpoints` list")
    result = [_endpoint(entry, f"endpoints[{i}]") for i, entry in enumerate(document["endpoints"])]
    ids = [f"{e.namespace}/{e.name}" for e in result]
    if len(set(ids)) != len(ids):
        raise EndpointsFileError("endpoints must be unique by namespace and name")
    return result


def _endpoint(entry: Any, where: str) -> StaticEndpoint:
    if not isinstance(entry, Mapping):
        raise EndpointsFileError(f"{where}: must be a mapping with name, models, backends")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise EndpointsFileError(f"{where}.name: a non-empty string is required")
    namespace = entry.get("namespace", DEFAULT_NAMESPACE)
    try:
        check_namespace(namespace, field=f"{where}.namespace")
    except ValueError as exc:
        raise EndpointsFileError(str(exc)) from None
    models = _strings(entry.get("models", [name]), f"{where}.models")
    backends = tuple(
        b.rstrip("/") for b in _strings(entry.get("backends", []), f"{where}.backends")
    )
    for backend in backends:
        if not backend.startswith(("http://", "https://")):
            raise EndpointsFileError(f"{where}.backends: {backend!r} is not an http(s) URL")
    try:
        routing = Strategy(entry.get("routing", Strategy.PREFIX_AWARE))
    except ValueError:
        raise EndpointsFileError(
            f"{where}.routing: must be one of {[s.value for s in Strategy]}"
        ) from None
    return StaticEndpoint(name, models, backends, routing, namespace)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise EndpointsFileError(f"{where}: must be a list of non-empty strings")
    return tuple(value)


class StaticDiscovery:
    """The file's endpoints, with the readiness of their backends from the pod's reader
    (pod_reader.PodReader: probed on each backend's control port, at the rate readiness needs)."""

    def __init__(self, path: str, registry: Registry, reader: PodReader):
        self.path = path
        self.registry = registry
        self.reader = reader
        self._ready: dict[str, set[str]] = {}

    async def start(self) -> None:
        with open(self.path, encoding="utf-8") as handle:
            endpoints = parse_endpoints(handle.read())
        for position, ep in enumerate(endpoints):
            # The file's order stands for creation order: the first entry listing a model keeps it.
            endpoint = self.registry.upsert(
                ep.name, ep.models, ep.routing, namespace=ep.namespace, created=float(position)
            )
            self._ready[endpoint.id] = set()
            for backend in ep.backends:
                self.reader.watch(endpoint.id, backend, self._changed(endpoint.id))
        logger.info(
            "static endpoints from %s: %s",
            self.path,
            [f"{e.namespace}/{e.name}" for e in endpoints],
        )

    async def stop(self) -> None:
        pass  # the reader stops on its own

    def _changed(self, endpoint: str) -> Callable[[str, bool], None]:
        ready = self._ready[endpoint]

        def changed(backend: str, now: bool) -> None:
            (ready.add if now else ready.discard)(backend)
            self.registry.set_ready(endpoint, ready)

        return changed

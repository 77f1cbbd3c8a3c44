"""The fit check at work: the model from its hub, the GPU from the nodes, the verdict; cached and
bounded in time so that a reconcile never waits long and a slow hub never stops a rollout.

- A model's files are read once per (hub, model, revision, token Secret) and kept for
  LLMEP_OPERATOR_FIT_CACHE_SECONDS (a failure for a minute). A reconcile waits for a read at most
  LLMEP_OPERATOR_FIT_TIMEOUT_SECONDS; after that ModelFits is Unknown (the rollout goes on) and the
  read carries on in the background, so the next reconcile (the resync, or any change) has it.
- The nodes are listed at most once per LLMEP_OPERATOR_FIT_NODES_SECONDS.
- The verdict itself is recomputed on every reconcile: a spec change is checked at once.
- An endpoint whose pods use another hub (HF_ENDPOINT in spec.engine.env) is read there only if
  the cluster admin lists it (LLMEP_OPERATOR_FIT_ALLOWED_HUBS): the operator contacts no address
  an endpoint author picks.
- A private or gated model needs the endpoint's token: the Secret of spec.model.hfTokenSecretRef
  is read only with LLMEP_OPERATOR_FIT_READ_TOKEN_SECRETS (the chart's RBAC then allows it);
  otherwise, or when the API refuses, the model is read without a token and, if the hub refuses,
  ModelFits is Unknown saying so.

Never raises: anything unexpected is an Unknown with its message (and a log line).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from llmendpoints_operator import kube
from llmendpoints_operator.config import OperatorSettings, split_list
from llmendpoints_operator.fit import nodes
from llmendpoints_operator.fit.inputs import ModelRef, fit_inputs, gpu_memory, model_ref, placement
from llmendpoints_operator.fit.sizing import GpuMemory, ModelFacts
from llmendpoints_operator.fit.verdict import Fit, assess, unknown
from llmendpoints_operator.hub import DEFAULT_HUB, HubClient, HubError
from llmendpoints_operator.spec import Endpoint

logger = logging.getLogger(__name__)
RETRY_SECONDS = 60.0
MAX_MODELS = 256


class ClusterReads(Protocol):
    """The part of kube.KubeClient the check uses."""

    async def list_nodes(self) -> list[dict[str, Any]]: ...

    async def secret_value(self, namespace: str, name: str, key: str) -> str: ...


class _NoToken(Exception):
    """The token Secret could not be read; the message says why (for the Unknown condition)."""


@dataclass
class _Read:
    task: asyncio.Task[ModelFacts]
    started: float


class FitChecker:
    def __init__(
        self,
        *,
        cluster: Callable[[], ClusterReads],
        hub: HubClient,
        settings: OperatorSettings,
        default_hub: str = DEFAULT_HUB,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cluster, self._hub, self._settings = cluster, hub, settings
        self._default_hub = (settings.hf_endpoint or default_hub).rstrip("/")
        allowed = split_list(settings.fit_allowed_hubs) or ()
        self._hubs = {self._default_hub, *(h.rstrip("/") for h in allowed)}
        self._clock = clock
        self._models: OrderedDict[tuple[Any, ...], _Read] = OrderedDict()
        self._nodes: tuple[float, list[dict[str, Any]]] | None = None

    async def close(self) -> None:
        for read in self._models.values():
            read.task.cancel()
        await self._hub.close()

    async def check(self, ep: Endpoint) -> Fit | None:
        """ModelFits for an admitted endpoint (None when the check is switched off)."""
        if not self._settings.fit_check:
            return None
        try:
            return await self._check(ep)
        except Exception as exc:  # the check must never fail a reconcile
            logger.exception("Fit check of %s/%s failed", ep.namespace, ep.name)
            return unknown("CheckFailed", f"the fit check failed: {exc or type(exc).__name__}")

    async def _check(self, ep: Endpoint) -> Fit:
        if ep.spec.resources.gpus == 0:
            return unknown("NoGPU", "spec.resources.gpus is 0: the check sizes GPU memory")
        ref = model_ref(ep)
        if ref.local_reason is not None:
            return unknown(
                "NotOnHub", f"{ref.local_reason}: the check reads a model's files from its hub"
            )
        gpu = await self._gpu(ep)
        if isinstance(gpu, Fit):
            return gpu
        facts = await self._facts(ep, ref)
        if isinstance(facts, Fit):
            return facts
        return assess(facts, fit_inputs(ep), gpu)

    # --- the GPU ------------------------------------------------------------------------------

    async def _gpu(self, ep: Endpoint) -> GpuMemory | Fit:
        memory = gpu_memory(ep)
        if memory is not None:
            return GpuMemory(memory, None, "spec.resources.gpuMemory")
        try:
            listed = await self._list_nodes()
        except kube.ApiError as exc:
            return unknown(
                "GPUMemoryUnknown",
                f"the operator could not list nodes ({exc.status} {exc.reason}; the chart's "
                "ClusterRole grants it); set spec.resources.gpuMemory to check anyway",
            )
        where = placement(ep, self._settings.gpu_resource_name)
        found = nodes.gpus(listed, where)
        if found.memory is None:
            return unknown("GPUMemoryUnknown", _no_memory_message(found, where))
        return GpuMemory(found.memory, found.product, _labels_source(found), found.per_node)

    async def _list_nodes(self) -> list[dict[str, Any]]:
        now = self._clock()
        if self._nodes is None or now - self._nodes[0] > self._settings.fit_nodes_seconds:
            self._nodes = (now, await self._cluster().list_nodes())
        return self._nodes[1]

    # --- the model ----------------------------------------------------------------------------

    async def _facts(self, ep: Endpoint, ref: ModelRef) -> ModelFacts | Fit:
        hub = (ref.hub or self._default_hub).rstrip("/")
        if hub not in self._hubs:
            return unknown(
                "HubNotAllowed",
                f"the pods read {ref.name} from {hub} (HF_ENDPOINT in spec.engine.env), a hub the "
                "operator does not contact: the cluster admin may list it in "
                "LLMEP_OPERATOR_FIT_ALLOWED_HUBS",
            )
        secret = (ep.namespace, *ref.token_secret) if ref.token_secret else None
        key = (hub, ref.name, ref.revision, secret)
        read = self._current(key)
        if read is None:
            task = asyncio.create_task(self._read(hub, ref, secret), name=f"fit-{ref.name}")
            task.add_done_callback(_retrieve)  # a read nobody awaits any more logs no warning
            read = self._models[key] = _Read(task, self._clock())
            self._evict()
        self._models.move_to_end(key)
        timeout = self._settings.fit_timeout_seconds
        try:
            return await asyncio.wait_for(asyncio.shield(read.task), timeout)
        except TimeoutError:
            return unknown(
                "HubTimeout",
                f"{hub} did not answer about {ref.name} within {timeout:g} s: the rollout goes "
                "on unchecked, and the next reconcile looks again",
            )
        except HubError as exc:
            return _hub_unknown(exc, ref, hub)
        except _NoToken as exc:
            return unknown("PrivateModel", str(exc))

    def _current(self, key: tuple[Any, ...]) -> _Read | None:
        read = self._models.get(key)
        if read is None or not read.task.done():
            return read
        failed = read.task.cancelled() or read.task.exception() is not None
        ttl = RETRY_SECONDS if failed else self._settings.fit_cache_seconds
        return read if self._clock() - read.started <= ttl else None

    def _evict(self) -> None:
        while len(self._models) > MAX_MODELS:
            _, oldest = self._models.popitem(last=False)
            oldest.task.cancel()

    async def _read(
        self, hub: str, ref: ModelRef, secret: tuple[str, str, str] | None
    ) -> ModelFacts:
        token, why_not = await self._token(secret)
        try:
            files = await self._hub.model(hub, ref.name, ref.revision, token)
        except HubError as exc:
            if exc.kind in ("unauthorized", "not_found") and why_not is not None:
                raise _NoToken(f"{exc}: {ref.name} looks private or gated, and {why_not}") from None
            raise
        return ModelFacts(files.config, files.tensors, files.commit, files.url)

    async def _token(self, secret: tuple[str, str, str] | None) -> tuple[str | None, str | None]:
        """(the token, or None and why it is not there when the endpoint names one)."""
        if secret is None:
            return None, None
        namespace, name, key = secret
        if not self._settings.fit_read_token_secrets:
            return None, (
                f"the operator does not read Secret {name} (spec.model.hfTokenSecretRef): "
                "allow it with LLMEP_OPERATOR_FIT_READ_TOKEN_SECRETS (the chart's "
                "fit.readTokenSecrets), or set spec.resources.gpuMemory and check it yourself "
                "with `llmendpoints-operator fit`"
            )
        try:
            return await self._cluster().secret_value(namespace, name, key), None
        except kube.ApiError as exc:
            return None, f"the operator may not read Secret {name}: {exc.status} {exc.message}"


def _retrieve(task: asyncio.Task[ModelFacts]) -> None:
    if not task.cancelled():
        task.exception()


def _labels_source(found: nodes.Gpus) -> str:
    text = f"nvidia.com/gpu.memory of {found.nodes} node{'s' if found.nodes != 1 else ''}"
    if len(found.products) > 1:
        text += f"; the smallest of {', '.join(found.products)}"
    if found.unlabelled:
        text += f"; {found.unlabelled} without the label not counted"
    return text


def _no_memory_message(found: nodes.Gpus, where: nodes.Placement) -> str:
    if found.nodes == 0:
        return (
            f"no node the pods may run on offers {where.gpus} {where.gpu_resource} (with their "
            "nodeSelector, affinity and tolerations): the check cannot tell which GPU they get; "
            "set spec.resources.gpuMemory to check anyway"
        )
    return (
        f"none of the {found.nodes} nodes the pods may run on publishes nvidia.com/gpu.memory "
        "(NVIDIA GPU feature discovery labels GPU nodes with it): set spec.resources.gpuMemory "
        "to one GPU's memory to check anyway"
    )


def _hub_unknown(exc: HubError, ref: ModelRef, hub: str) -> Fit:
    if exc.kind == "unauthorized":
        who = "the token in spec.model.hfTokenSecretRef" if ref.token_secret else "no token"
        return unknown(
            "PrivateModel",
            f"{exc} with {who}: {ref.name} is private or gated; set spec.model.hfTokenSecretRef "
            "to a token that may read it",
        )
    reason = {"not_found": "ModelNotFound", "invalid": "ModelUnreadable"}.get(
        exc.kind, "HubUnavailable"
    )
    return unknown(reason, f"{exc} (hub {hub})")

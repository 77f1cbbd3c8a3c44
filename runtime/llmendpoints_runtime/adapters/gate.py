"""What a request for an adapter gets while the adapter is not serving.

* declared but not loaded yet (downloading, loading, or failed and waiting for its retry):
  503 with ``Retry-After`` and the adapter's state or last error;
* not declared at all: vLLM's own 404 (``The model `x` does not exist``) on the OpenAI routes,
  a 404 naming ``input.model`` for jobs (``jobs.models.check_model``, fed by
  ``unavailable_adapters``);
* loaded: vLLM serves it (``model: <adapter>`` selects the LoRA on every OpenAI route).

``AdapterGate`` wraps vLLM's app itself, so every way in -- ``/v1/...``, ``openai_route`` jobs,
SageMaker's ``/invocations`` -- gets the same answer. It looks at a body only while some declared
adapter is not serving, and then only at bodies that mention such an adapter's name.
"""

from __future__ import annotations

import json
from typing import Any

from llmendpoints_common.errors import ServiceUnavailableError
from llmendpoints_edge.asgi import ASGIApp, Receive, Scope, Send, send_error
from llmendpoints_edge.body import read_before

from llmendpoints_runtime.adapters.reconciler import AdapterReconciler, AdapterStatus


def not_ready_error(
    reconciler: AdapterReconciler, status: AdapterStatus
) -> ServiceUnavailableError:
    name = status.adapter.name
    retry = reconciler.retry_after(status)
    if status.state == "failed":
        message = (
            f"adapter {name!r} is declared but failed to load ({status.error}); "
            f"next attempt in {retry} s"
        )
    else:
        message = f"adapter {name!r} is declared and still {status.state}; retry shortly"
    return ServiceUnavailableError(message, param="model", headers={"retry-after": str(retry)})


def unavailable_adapters(reconciler: AdapterReconciler | None) -> dict[str, tuple[str, int]]:
    """Declared adapters that do not serve yet: name -> (why, Retry-After seconds)."""
    if reconciler is None:
        return {}
    unavailable = {}
    for name, status in list(reconciler.statuses.items()):
        if status.state != "ready":
            error = not_ready_error(reconciler, status)
            unavailable[name] = (error.message, int(error.headers["retry-after"]))
    return unavailable


class AdapterGate:
    """vLLM's OpenAI app, with 503 + Retry-After for adapters that are declared but not ready."""

    def __init__(self, app: ASGIApp, reconciler: AdapterReconciler):
        self.app = app
        self.reconciler = reconciler

    @property
    def state(self) -> Any:  # vLLM's app.state (serving objects), read by engine/
        return self.app.state  # type: ignore[attr-defined]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not self.reconciler.has_pending:
            await self.app(scope, receive, send)
            return
        # Every way in read the body before it got here (the edge, or an in-process call).
        body = read_before(scope) or b""
        status = self._pending_for(body)
        if status is not None:
            await send_error(send, not_ready_error(self.reconciler, status))
            return
        await self.app(scope, receive, send)

    def _pending_for(self, body: bytes) -> AdapterStatus | None:
        pending = [s for s in self.reconciler.statuses.values() if s.state != "ready"]
        if not any(s.adapter.name.encode() in body for s in pending):
            return None  # the cheap test: no pending adapter's name anywhere in the body
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            return None  # vLLM answers malformed bodies itself
        return self.reconciler.pending(model) if isinstance(model, str) else None

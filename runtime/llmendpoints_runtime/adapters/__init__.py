"""LoRA adapters declared in the endpoint, loaded and unloaded while the runtime serves.

``declared`` reads the mounted list (pure), ``reconciler`` keeps the engine's adapters equal to
it, ``gate`` answers requests for adapters that are not serving yet, ``demo`` writes a demo
adapter. compose.py calls ``build_reconciler``, and ``start`` once the engine is ready.
"""

from __future__ import annotations

from typing import Any

from llmendpoints_runtime.adapters.gate import AdapterGate
from llmendpoints_runtime.adapters.reconciler import AdapterReconciler
from llmendpoints_runtime.engine import EngineAdapters


def build_reconciler(runtime: Any) -> AdapterReconciler:
    settings = runtime.config.settings
    return AdapterReconciler(
        EngineAdapters(runtime.engine),
        runtime.metrics.registry,
        adapters_file=settings.adapters_file,
        poll_seconds=settings.adapters_poll_seconds,
        base_names=tuple(runtime.config.served_model_names),
    )


def start(runtime: Any, reconciler: AdapterReconciler) -> None:
    """Once the engine is ready: put the gate in front of vLLM's app, start reconciling."""
    if reconciler.adapters_file is None or runtime.engine.asgi_app is None:
        return
    runtime.engine.asgi_app = AdapterGate(runtime.engine.asgi_app, reconciler)
    reconciler.start()


__all__ = ["AdapterReconciler", "build_reconciler", "start"]

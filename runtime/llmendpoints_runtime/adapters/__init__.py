"""LoRA adapters declared in the endpoint, loaded and unloaded while the runtime serves.

``declared`` reads the mounted list (pure), ``reconciler`` keeps the engine's adapters equal to
it, ``gate`` answers requests for adapters that are not serving yet, ``demo`` writes a demo
adapter. compose.py calls ``build_reconciler``, and ``start`` once the engine is ready.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from llmendpoints_runtime.adapters.gate import AdapterGate
from llmendpoints_runtime.adapters.reconciler import AdapterReconciler
from llmendpoints_runtime.config import RuntimeSettings
from llmendpoints_runtime.engine import Engine, EngineAdapters


def build_reconciler(
    engine: Engine,
    settings: RuntimeSettings,
    registry: CollectorRegistry,
    base_names: tuple[str, ...],
) -> AdapterReconciler:
    """The reconciler of LLMEP_ADAPTERS_FILE's adapters into ``engine``; ``base_names`` are
    the served model names (an adapter may not take one)."""
    return AdapterReconciler(
        EngineAdapters(engine),
        registry,
        adapters_file=settings.adapters_file,
        poll_seconds=settings.adapters_poll_seconds,
        base_names=base_names,
    )


def start(engine: Engine, reconciler: AdapterReconciler) -> None:
    """Once the engine is ready: put the gate in front of vLLM's app, start reconciling."""
    if reconciler.adapters_file is None or engine.asgi_app is None:
        return
    engine.asgi_app = AdapterGate(engine.asgi_app, reconciler)
    reconciler.start()


__all__ = ["AdapterReconciler", "build_reconciler", "start"]

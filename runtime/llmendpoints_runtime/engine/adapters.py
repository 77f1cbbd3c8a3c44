"""LoRA adapters at run time, through vLLM's own in-process loading (used by ``adapters/``)."""

from __future__ import annotations

import contextlib

from llmendpoints_runtime.engine.requests import clean_message
from llmendpoints_runtime.engine.serving import Engine


class AdapterLoadError(Exception):
    """vLLM refused to load an adapter (bad files, rank above MAX_LORA_RANK, LoRA disabled...)."""


class EngineAdapters:
    """vLLM's own in-process LoRA loading: the methods behind /v1/load_lora_adapter and
    /v1/unload_lora_adapter (``OpenAIServingModels``), without the HTTP routes or
    VLLM_ALLOW_RUNTIME_LORA_UPDATING. Loaded adapters appear in vLLM's /v1/models with their
    base model as ``parent``, and ``model: <adapter>`` selects them on every OpenAI route."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _models(self):
        app = self.engine.asgi_app
        return getattr(app.state, "openai_serving_models", None) if app is not None else None

    def lora_enabled(self) -> bool:
        return bool(getattr(self.engine.args, "enable_lora", False))

    def loaded(self) -> frozenset[str]:
        models = self._models()
        return frozenset(getattr(models, "lora_requests", None) or ())

    async def load(self, name: str, path: str, *, replace: bool) -> None:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        if not self.lora_enabled():
            raise AdapterLoadError("the engine was started without ENABLE_LORA")
        models = self._models()
        if models is None:
            raise AdapterLoadError("the engine is not ready")
        request = LoadLoRAAdapterRequest(lora_name=name, lora_path=path, load_inplace=replace)
        try:
            result = await models.load_lora_adapter(request)
        except Exception as exc:  # vLLM raises for some checks instead of answering
            raise AdapterLoadError(clean_message(exc)) from None
        if isinstance(result, ErrorResponse):
            raise AdapterLoadError(result.error.message)

    async def unload(self, name: str) -> None:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        models = self._models()
        if models is None or name not in models.lora_requests:
            return
        lora_id = models.lora_requests[name].lora_int_id
        await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        # vLLM's unload only forgets the name; free the engine's copy of the weights as well.
        with contextlib.suppress(Exception):
            await self.engine.client.remove_lora(lora_id)

    def lora_request(self, name: str):
        """The loaded adapter's LoRARequest (for generation straight on the engine), or None."""
        models = self._models()
        return (getattr(models, "lora_requests", None) or {}).get(name)

"""vLLM's engine-control routes: only admin keys may call them. PURE.

vLLM 0.32's OpenAI app carries, beside inference, routes that steer the engine itself: loading
and unloading LoRA adapters, profiling, sleeping and waking, pausing, cache resets, arbitrary
RPCs into the workers, RL weight updates, elastic scaling, fault tolerance. Most of them only
exist when a flag or a VLLM_* variable turns them on, but none of them is for a tenant's key: one
call takes the endpoint down for everybody (``/sleep``, ``/pause``), reads or changes what it
serves (``/collective_rpc``, ``/update_weights``, ``/v1/load_lora_adapter``) or aborts other
tenants' requests (``/abort_requests``).

Every route vLLM's app can have is in one of the two lists below (tests/unit/runtime/
test_control_routes.py builds vLLM's app with every option on and fails on a route that is in
neither: a vLLM upgrade cannot add a control route that ordinary keys reach unnoticed).
"""

from __future__ import annotations

import re

from llmendpoints_common.errors import PermissionDeniedError

# Route templates as vLLM declares them ({name} is one path segment).
CONTROL_ROUTES: frozenset[str] = frozenset(
    {
        # LoRA adapters at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING), and SageMaker's spelling
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/adapters",
        "/adapters/{adapter_name}",
        # profiling (--profiler-config)
        "/start_profile",
        "/stop_profile",
        # VLLM_SERVER_DEV_MODE: caches, RPC, server internals, sleep mode
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/collective_rpc",
        "/server_info",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/release_kv_cache_memory",
        # VLLM_SERVER_DEV_MODE: reinforcement learning (pause, abort, weight updates)
        "/pause",
        "/resume",
        "/is_paused",
        "/abort_requests",
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/weight_info",
        "/weight_checker",
        "/get_world_size",
        # elastic expert parallelism
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        # --enable-fault-tolerance
        "/fault_tolerance/apply",
        "/fault_tolerance/status",
        # aborts any request by id (token-in/token-out serving)
        "/inference/v1/abort_requests",
        # the engine's internal KV-event sockets (for KV-aware routers)
        "/kv_event_sources",
    }
)

# The rest of vLLM's routes: inference, tokenisation and information any key may use. (The
# runtime's own /health, /ping, /metrics and /invocations answer before vLLM's.)
SERVING_ROUTES: frozenset[str] = frozenset(
    {
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        "/health",
        "/ping",
        "/metrics",
        "/invocations",
        "/load",
        "/version",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/chat/completions/render",
        "/v1/chat/completions/derender",
        "/v1/completions",
        "/v1/completions/render",
        "/v1/completions/derender",
        "/v1/responses",
        "/v1/responses/render",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/messages/render",
        "/v1/systemone",
        "/generative_scoring",
        "/inference/v1/generate",
        "/v1/realtime",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)


def _pattern(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[^}]+\})", template)
    body = "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts if p)
    return re.compile(f"^{body}/?$")


_EXACT = frozenset(t for t in CONTROL_ROUTES if "{" not in t)
_TEMPLATED = tuple(_pattern(t) for t in CONTROL_ROUTES if "{" in t)


def is_control_path(path: str) -> bool:
    """``path`` (as the request has it) reaches one of vLLM's engine-control routes."""
    if path in _EXACT or (path.endswith("/") and path.rstrip("/") in _EXACT):
        return True
    return any(p.match(path) for p in _TEMPLATED)


def control_denied(path: str, *, admin_keys_configured: bool) -> PermissionDeniedError:
    """The 403 an ordinary caller gets on a control route."""
    if admin_keys_configured:
        why = "send an admin key (ADMIN_API_KEYS / ADMIN_API_KEYS_FILE)"
    else:
        why = (
            "this server has no admin key configured (ADMIN_API_KEYS / ADMIN_API_KEYS_FILE), "
            "so engine control is closed"
        )
    return PermissionDeniedError(f"{path} is one of vLLM's engine-control routes: {why}")

"""An admitted endpoint -> what the fit check needs to know about it. PURE.

The one place that reads the spec for the check: the model and where it comes from, the GPUs and
their memory if the user says it, the parallel layout, and the engine settings that change vLLM's
memory (from the spec's fields, and from engine.args/env through the table of vLLM's flags).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from llmendpoints_common import vllm_env

from llmendpoints_operator import manifests
from llmendpoints_operator.engine_flags import engine_settings, parse_value
from llmendpoints_operator.fit.nodes import Placement
from llmendpoints_operator.fit.weights import Parallelism
from llmendpoints_operator.spec import Endpoint

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's
_QUANTITY = re.compile(
    r"^\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([KMGTPE]i?|k|)B?\s*$"
)
_FACTORS = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
# Speculative methods that add no model to the GPU.
_NO_DRAFT_MODEL = {"ngram", "ngram_gpu", "suffix"}


def quantity_bytes(text: str | int | float) -> int:
    """A Kubernetes quantity of bytes (80Gi, 81559Mi, 80G), also as people write it (80GiB)."""
    match = _QUANTITY.match(str(text))
    if match is None:
        raise ValueError(f"{text!r} is not an amount of memory such as 80Gi or 24GiB")
    number, unit = match.groups()
    factor = 1024 ** ("KMGTPE".index(unit[0]) + 1) if unit.endswith("i") else _FACTORS[unit]
    return int(float(number) * factor)


@dataclass(frozen=True)
class ModelRef:
    name: str
    revision: str | None
    token_secret: tuple[str, str] | None  # (Secret name, key) in the endpoint's namespace
    hub: str | None  # HF_ENDPOINT the pods use (spec.engine.env), None: the operator's
    local_reason: str | None  # why the pods do not read it from a hub (None: they do)


@dataclass(frozen=True)
class FitInputs:
    parallel: Parallelism
    gpu_memory_utilization: float
    max_model_len: int | None  # None: the model's own; -1: vLLM's auto-fit
    dtype: str | None
    kv_cache_dtype: str
    quantization: str | None
    block_size: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    enforce_eager: bool
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    cpu_offload_bytes: int
    lora: tuple[int, int] | None  # (max loras, max rank)
    hybrid_kv_cache: bool
    async_scheduling: bool
    disable_sliding_window: bool
    draft_model: str | None  # why a speculative draft model's memory is not counted


def _flag_int(flags: Mapping[str, str], flag: str) -> int | None:
    value = flags.get(flag)
    if value is None or value.strip() in ("", "None"):
        return None
    return int(parse_value("human_int_or_auto", value))


def _flag_bool(flags: Mapping[str, str], flag: str) -> bool:
    return vllm_env.parse_bool(flags.get(flag, "false"))


def parallelism(ep: Endpoint) -> Parallelism:
    """THE place where the check reads the endpoint's parallel layout: the spec's sizes as the
    operator derives them (parallelism.py), over spec.resources.nodes nodes."""
    sizes = ep.spec.parallelism
    return Parallelism(
        tensor=sizes.tensor,
        pipeline=sizes.pipeline,
        data=sizes.data,
        nodes=sizes.nodes,
        expert=sizes.expert,
    )


def _lora(ep: Endpoint, flags: Mapping[str, str]) -> tuple[int, int] | None:
    lora = manifests.lora_settings(ep)
    enabled = _flag_bool(flags, "--enable-lora") or lora.get("ENABLE_LORA") == "true"
    if not enabled:
        return None
    loras = _flag_int(flags, "--max-loras") or int(lora.get("MAX_LORAS", 1))
    rank = _flag_int(flags, "--max-lora-rank") or int(lora.get("MAX_LORA_RANK", 16))
    return loras, rank


def _draft_model(flags: Mapping[str, str]) -> str | None:
    raw = flags.get("--speculative-config")
    if not raw:
        return None
    try:
        method = json.loads(raw).get("method")
    except (ValueError, AttributeError):
        method = None
    if method in _NO_DRAFT_MODEL:
        return None
    return f"speculative decoding ({method or 'a draft model'}) loads a second model"


def fit_inputs(ep: Endpoint) -> FitInputs:
    flags = engine_settings(ep)
    engine = ep.spec.engine
    offload = flags.get("--cpu-offload-gb")
    return FitInputs(
        parallel=parallelism(ep),
        gpu_memory_utilization=engine.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        max_model_len=engine.max_model_len,
        dtype=engine.dtype,
        kv_cache_dtype=flags.get("--kv-cache-dtype", "auto"),
        quantization=engine.quantization,
        block_size=_flag_int(flags, "--block-size"),
        max_num_seqs=_flag_int(flags, "--max-num-seqs"),
        max_num_batched_tokens=_flag_int(flags, "--max-num-batched-tokens"),
        enforce_eager=_flag_bool(flags, "--enforce-eager"),
        kv_cache_memory_bytes=_flag_int(flags, "--kv-cache-memory-bytes"),
        num_gpu_blocks_override=_flag_int(flags, "--num-gpu-blocks-override"),
        cpu_offload_bytes=int(float(offload) * (1 << 30)) if offload else 0,
        lora=_lora(ep, flags),
        hybrid_kv_cache=not _flag_bool(flags, "--disable-hybrid-kv-cache-manager"),
        async_scheduling=vllm_env.parse_bool(flags.get("--async-scheduling", "true")),
        disable_sliding_window=_flag_bool(flags, "--disable-sliding-window"),
        draft_model=_draft_model(flags),
    )


def placement(ep: Endpoint, gpu_resource: str) -> Placement:
    res = ep.spec.resources
    return Placement(
        gpu_resource=res.gpu_resource_name or gpu_resource,
        gpus=res.gpus,
        node_selector=dict(res.node_selector),
        affinity=res.affinity,
        tolerations=[t.model_dump(by_alias=True, exclude_none=True) for t in res.tolerations],
    )


def _local_reason(ep: Endpoint, env: Mapping[str, str]) -> str | None:
    name = ep.spec.model.name
    if ep.spec.model.baked_into_image:
        return "the weights are baked into the image (spec.model.bakedIntoImage)"
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return f"{name} is a path in the pod, not a model on a hub"
    offline = env.get("HF_HUB_OFFLINE", "")
    if offline.strip() and vllm_env.parse_bool(offline):
        return "the pods do not use a hub (HF_HUB_OFFLINE in spec.engine.env)"
    return None


def model_ref(ep: Endpoint) -> ModelRef:
    model = ep.spec.model
    env = {var.name: var.value for var in ep.spec.engine.env if var.value is not None}
    secret = model.hf_token_secret_ref
    return ModelRef(
        name=model.name,
        revision=model.revision,
        token_secret=(secret.name, secret.key) if secret else None,
        hub=env.get("HF_ENDPOINT") or None,
        local_reason=_local_reason(ep, env),
    )


def gpu_memory(ep: Endpoint) -> int | None:
    """spec.resources.gpuMemory in bytes, when the user says it."""
    memory = ep.spec.resources.gpu_memory
    return quantity_bytes(memory) if memory is not None else None


def defaults(**changes: object) -> FitInputs:
    """vLLM's defaults on one GPU, with `changes` (for callers without an endpoint)."""
    plain = FitInputs(
        parallel=Parallelism(),
        gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION,
        max_model_len=None,
        dtype=None,
        kv_cache_dtype="auto",
        quantization=None,
        block_size=None,
        max_num_seqs=None,
        max_num_batched_tokens=None,
        enforce_eager=False,
        kv_cache_memory_bytes=None,
        num_gpu_blocks_override=None,
        cpu_offload_bytes=0,
        lora=None,
        hybrid_kv_cache=True,
        async_scheduling=True,
        disable_sliding_window=False,
        draft_model=None,
    )
    return dataclasses.replace(plain, **changes)  # type: ignore[arg-type]

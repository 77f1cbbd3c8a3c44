"""config.json -> the attention and sizes vLLM 0.32 builds for a model, or why the check cannot
tell. PURE.

Where the numbers come from in vLLM: head size and KV heads as the model classes compute them
(`head_dim`, else hidden_size / num_attention_heads; num_key_value_heads, else one per head); the
sliding window per layer as vllm/model_executor/models/llama.py and the Attention layer decide it
(a `layer_types` list in the config; else the model-wide `sliding_window`, for every layer); the
transformers defaults that fill `layer_types` where config.json leaves it out (Gemma 2's
alternating layers, Gemma 3's 5 local : 1 global, Qwen's `use_sliding_window` /
`max_window_layers`); MLA's latent cache (DeepSeek V2/V3: kv_lora_rank + qk_rope_head_dim, one
"head" shared by every query head); the longest context as model_arch_config_convertor.py and
ModelConfig derive it (the smallest of the length keys, times a linear or dynamic RoPE factor).

Architectures outside KNOWN are UnknownModel: another attention (linear, chunked local, state
space), a vision encoder whose profiling vLLM adds, or a class this module has not been checked
against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Architecture -> its attention family.
KNOWN: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "GraniteForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen",
    "Qwen2MoeForCausalLM": "qwen",
    "Qwen3ForCausalLM": "qwen",
    "Qwen3MoeForCausalLM": "qwen",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "DeepseekV2ForCausalLM": "mla",
    "DeepseekV3ForCausalLM": "mla",
}
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already the scaled length (vLLM does not multiply).
_PRESCALED_ROPE = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


class UnknownModel(Exception):
    """The check cannot size this model; the message says why (for a status condition)."""


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's (0 when every layer is MoE)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str  # the checkpoint's torch dtype name
    max_position: int  # vLLM's derived max_model_len
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    mla_dim: int | None  # MLA: kv_lora_rank + qk_rope_head_dim per token and layer
    experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int
    moe_intermediate_size: int
    tie_word_embeddings: bool
    fp8_kv_cache_scheme: bool  # the checkpoint asks for an FP8 KV cache (llm-compressor)
    quant_method: str | None  # the checkpoint's quantization_config.quant_method


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UnknownModel(f"config.json: {key} is {value!r}, not a count")
    return value


def _layer_windows(config: Mapping[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window") or None
    types = config.get("layer_types")
    if types is None:
        types = _default_layer_types(config, family, layers, window)
    if types is None:  # model-wide window (Mistral 7B v0.1, Phi-3): every layer, or none
        return (window,) * layers
    if len(types) < layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnknownModel(
            f"config.json: layer_types {sorted(set(types))} (the check knows full and sliding "
            "attention only)"
        )
    if "sliding_attention" in types and not isinstance(window, int):
        raise UnknownModel("config.json: sliding layers without a sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types[:layers])


def _default_layer_types(
    config: Mapping[str, Any], family: str, layers: int, window: int | None
) -> list[str] | None:
    """transformers' defaults where config.json leaves layer_types out (vLLM reads the config
    through transformers)."""
    if family == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if family == "gemma3":
        pattern = _int(config, "sliding_window_pattern", 6)
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    if family == "qwen":
        first = _int(config, "max_window_layers", layers)
        use = bool(config.get("use_sliding_window")) and window is not None
        return [
            "sliding_attention" if use and i >= first else "full_attention" for i in range(layers)
        ]
    return None


def _rope_factor(config: Mapping[str, Any]) -> float:
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        return 1.0
    kind = rope.get("rope_type") or rope.get("type") or "default"
    factor = rope.get("factor")
    if kind in _PRESCALED_ROPE or kind == "default" or not isinstance(factor, int | float):
        return 1.0
    return float(factor)


def derived_max_len(config: Mapping[str, Any], family: str) -> int:
    lengths = [v for k in _LENGTH_KEYS if isinstance(v := config.get(k), int) and v > 0]
    if isinstance(config.get("model_max_length"), int):
        lengths = [config["model_max_length"]]
    if not lengths:
        return 2048  # vLLM's default when no key is there
    factor = 1.0 if family == "gemma3" else _rope_factor(config)
    return int(min(lengths) * factor)


def _moe(config: Mapping[str, Any]) -> tuple[int, int, int]:
    experts = (
        config.get("n_routed_experts")
        or config.get("num_experts")
        or config.get("num_local_experts")
    )
    if not experts:
        return 0, 0, 0
    per_token = config.get("num_experts_per_tok") or config.get("num_experts_per_token") or 1
    size = config.get("moe_intermediate_size") or config.get("intermediate_size") or 0
    return int(experts), int(per_token), int(size)


def read_config(config: Mapping[str, Any]) -> ModelShape:
    """The model's shape as vLLM builds it; UnknownModel naming what the check does not know."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in KNOWN), None)
    if arch is None:
        named = ", ".join(map(str, archs)) or "none"
        raise UnknownModel(
            f"architecture {named}: the check knows {', '.join(sorted(KNOWN))} (other "
            "attention kinds, and vision encoders, are sized by vLLM's own profiling)"
        )
    family = KNOWN[arch]
    layers = _int(config, "num_hidden_layers")
    heads = _int(config, "num_attention_heads")
    hidden = _int(config, "hidden_size")
    if not layers or not heads or not hidden:
        raise UnknownModel("config.json: a model without layers, heads or hidden units")
    mla = None
    if family == "mla":
        mla = _int(config, "kv_lora_rank") + _int(config, "qk_rope_head_dim")
    quant = config.get("quantization_config") or {}
    experts, per_token, moe_size = _moe(config)
    return ModelShape(
        architecture=arch,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(config.get("intermediate_size") or 0),
        num_heads=heads,
        num_kv_heads=_int(config, "num_key_value_heads", heads) or heads,
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab_size=_int(config, "vocab_size"),
        dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
        max_position=derived_max_len(config, family),
        windows=(None,) * layers if family == "mla" else _layer_windows(config, family, layers),
        mla_dim=mla,
        experts=experts,
        experts_per_token=per_token,
        moe_intermediate_size=moe_size,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        fp8_kv_cache_scheme=isinstance(quant, Mapping) and quant.get("kv_cache_scheme") is not None,
        quant_method=str(quant["quant_method"])
        if isinstance(quant, Mapping) and quant.get("quant_method")
        else None,
    )


def model_dtype(shape: ModelShape, requested: str | None) -> tuple[str, int]:
    """The dtype vLLM runs the model in, and its bytes: spec.engine.dtype, or for `auto` the
    checkpoint's, with float32 checkpoints run in bfloat16 (vLLM's _resolve_auto_dtype on GPUs)."""
    name = requested if requested not in (None, "auto") else shape.dtype
    if requested in (None, "auto") and name in ("float32", "float"):
        name = "bfloat16"
    if name not in DTYPE_BYTES:
        raise UnknownModel(f"dtype {name}: the check knows {', '.join(sorted(DTYPE_BYTES))}")
    return name, DTYPE_BYTES[name]

"""Real models' config.json and checkpoint layout, without their weights: for the fit check's tests.

Llama-3-70B and Llama-3.1-8B as Meta publishes them on the Hugging Face Hub (config.json verbatim;
tensor names and shapes as in their safetensors files, 30 and 4 shards; the sum of the tensors'
bytes equals the `total_size` of their model.safetensors.index.json: 141,107,412,992 and
16,060,522,496). `headers` writes the safetensors header of each shard exactly as the format
lays it out (8-byte little-endian length, then JSON with dtype, shape and data_offsets).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

LLAMA_3_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_3_70B_SHARDS = 30
LLAMA_3_70B_TOTAL = 141_107_412_992

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_31_8B_SHARDS = 4
LLAMA_31_8B_TOTAL = 16_060_522_496

_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


def llama_tensors(config: dict[str, Any], dtype: str = "BF16") -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor of a Llama checkpoint, in the checkpoint's order."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    tensors = [("model.embed_tokens.weight", dtype, [vocab, h])]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", dtype, [h]),
            (p + "mlp.down_proj.weight", dtype, [h, inter]),
            (p + "mlp.gate_proj.weight", dtype, [inter, h]),
            (p + "mlp.up_proj.weight", dtype, [inter, h]),
            (p + "post_attention_layernorm.weight", dtype, [h]),
            (p + "self_attn.k_proj.weight", dtype, [kv, h]),
            (p + "self_attn.o_proj.weight", dtype, [h, q]),
            (p + "self_attn.q_proj.weight", dtype, [q, h]),
            (p + "self_attn.v_proj.weight", dtype, [kv, h]),
        ]
    tensors.append(("model.norm.weight", dtype, [h]))
    if not config.get("tie_word_embeddings"):
        tensors.append(("lm_head.weight", dtype, [vocab, h]))
    return tensors


def shard_names(count: int) -> list[str]:
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def shards(
    tensors: list[tuple[str, str, list[int]]], count: int
) -> dict[str, list[tuple[str, str, list[int]]]]:
    """The tensors split into `count` shards of about equal bytes, in order (as the Hub's
    save_pretrained does with its max shard size)."""
    names = shard_names(count)
    total = sum(_nbytes(t) for t in tensors)
    out: dict[str, list[tuple[str, str, list[int]]]] = {n: [] for n in names}
    done = 0
    for tensor in tensors:
        index = min(count - 1, done * count // total)
        out[names[index]].append(tensor)
        done += _nbytes(tensor)
    return out


def _nbytes(tensor: tuple[str, str, list[int]]) -> int:
    return math.prod(tensor[2]) * _BYTES[tensor[1]]


def header(tensors: list[tuple[str, str, list[int]]]) -> bytes:
    """A shard's safetensors header: the 8-byte length, then the JSON."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * _BYTES[dtype]
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text


def index(sharded: dict[str, list[tuple[str, str, list[int]]]]) -> dict[str, Any]:
    """model.safetensors.index.json for the shards."""
    weight_map = {name: shard for shard, ts in sharded.items() for name, _, _ in ts}
    total = sum(_nbytes(t) for ts in sharded.values() for t in ts)
    return {"metadata": {"total_size": total}, "weight_map": weight_map}

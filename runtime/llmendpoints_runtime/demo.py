"""A deterministic tiny Llama-architecture model for local runs and tests.

No model weights can be downloaded on the machines this project is built and tested on, so the
project writes its own model: random weights, a byte-level BPE tokenizer trained on a few
sentences, and a chat template. It loads in vLLM's CPU build in well under a minute and generates
(gibberish) text on two cores. Sizes follow the CPU attention backend's limits: head_dim must be
at least 32, so 128 hidden units over 2 heads (head_dim 64) with one KV head.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Fixed corpus: the tokenizer's merges (and so the vocabulary) depend only on this text.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serverless endpoints scale to meet demand and back down when it is gone.",
    "What is the capital of France? The capital of France is Paris.",
    "Explain quantum computing in simple terms for a curious reader.",
    "A language model predicts the next token from the tokens before it.",
    "Kubernetes schedules pods onto nodes that have the resources they request.",
    "Hello! How can I help you today? Tell me a short story about a robot.",
    "The sky is blue because air scatters blue light more than red light.",
]
VOCAB_SIZE = 384
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SEED = 1234


def _model_config(vocab_size: int, max_positions: int = 2048) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # Every byte is in the vocabulary, so any text (and any UTF-8) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return tokenizer


def _weights(config: dict) -> dict:
    import torch

    generator = torch.Generator().manual_seed(SEED)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    vocab = config["vocab_size"]

    dtype = getattr(torch, config["torch_dtype"])

    def randn(*shape: int):
        return (torch.randn(*shape, generator=generator) * 0.02).to(dtype).contiguous()

    def ones(size: int):
        return torch.ones(size, dtype=dtype)

    tensors = {"model.embed_tokens.weight": randn(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = randn(q_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = randn(kv_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = randn(kv_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = randn(hidden, q_dim)
        tensors[p + "mlp.gate_proj.weight"] = randn(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = randn(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = randn(hidden, inter)
        tensors[p + "input_layernorm.weight"] = ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = ones(hidden)
    tensors["model.norm.weight"] = ones(hidden)
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = randn(vocab, hidden)
    return tensors


def write_demo_model(
    path: str | Path, max_positions: int = 2048, shape: Mapping[str, Any] | None = None
) -> Path:
    """Write the demo model to `path` (created if missing) and return it.

    The same call always writes the same bytes for weights, config and tokenizer.
    ``max_positions``: the longest sequence it takes (RoPE: any length it is built for; tests
    of long streams ask for more than the default). ``shape``: config.json entries that replace
    the demo's (layers, heads, KV heads, head_dim, hidden and intermediate sizes, torch_dtype,
    tie_word_embeddings, sliding_window and layer_types, a vocab_size above the tokenizer's):
    the weights follow them (the fit check's test against vLLM sizes several such models).
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    config = {**_model_config(tokenizer.get_vocab_size(), max_positions), **(shape or {})}

    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    special_tokens_map = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
    }
    generation_config = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    for name, data in (
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
        ("generation_config.json", generation_config),
    ):
        (out / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    save_file(_weights(config), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(
        "# llmendpoints demo model\n\n"
        "A tiny Llama-architecture model with RANDOM weights, written by "
        "`llmendpoints-runtime demo-model`. It exists so the runtime can be run and tested "
        "without downloading weights; its output is gibberish.\n"
    )
    return out

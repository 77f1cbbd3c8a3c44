"""A deterministic LoRA adapter for the demo model (``llmendpoints-runtime demo-adapter PATH``).

Rank 8 on every layer's ``q_proj`` and ``v_proj``, in the PEFT layout vLLM loads. Its weights are
large enough next to the demo model's (std 0.02) that greedy output differs from the base model's
for the same prompt -- which is what lets a test tell which one answered. ``seed`` gives distinct
adapters; the same seed always writes the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmendpoints_runtime.demo import model_config

RANK = 8
ALPHA = 16
TARGET_MODULES = ("q_proj", "v_proj")
# Element std of A and B; the update's std is about ALPHA/RANK * RANK**0.5 * STD**2 = 0.11,
# five times the demo model's own weights: the adapter visibly steers the output.
_STD = 0.2


def write_demo_adapter(path: str | Path, *, seed: int = 1, base_model: str = "demo") -> Path:
    """Write a LoRA adapter for the demo model to ``path`` (created if missing); return it."""
    # torch is imported when an adapter is written: the CLI's other commands do not pay for it.
    import torch
    from safetensors.torch import save_file

    config = model_config(vocab_size=0)  # only the layer shapes are used
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    out_features = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int):
        return (torch.randn(*shape, generator=generator) * _STD).contiguous()

    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = randn(RANK, hidden)
            tensors[f"{prefix}.lora_B.weight"] = randn(out_features[module], RANK)

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(
        f"# llmendpoints demo adapter (seed {seed})\n\n"
        "A rank-8 LoRA on q_proj/v_proj with RANDOM weights for the demo model, written by "
        "`llmendpoints-runtime demo-adapter`. It exists so adapters can be tried and tested "
        "without downloads; it changes the demo model's (gibberish) output.\n"
    )
    return out

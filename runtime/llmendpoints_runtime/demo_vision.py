"""A deterministic tiny image+text model (Idefics3, the SmolVLM architecture) for local runs and tests.

Like the text demo model (demo.py) it has random weights and a tokenizer trained on a few
sentences, so it downloads nothing and its answers are gibberish -- but vLLM treats it as a real
vision-language model: it fetches and decodes images, runs them through a vision tower and
feeds the image embeddings to the language model.

Why Idefics3: vLLM 0.32's code for LLaVA, Qwen2-VL, Gemma3, Pixtral, PaliGemma and the like
imports torchvision, which the CPU build cannot use here; Idefics3's image processor has a pure
PIL implementation (``Idefics3ImageProcessorPil``). Sizes: the vision tower has 64 hidden units,
2 layers, 1 head (head_dim 64: the CPU attention backend refuses less than 32); images are
resized to 32x32 pixels in 8-pixel patches, and a pixel shuffle with scale factor 2 leaves
``(32 / 8)**2 / 2**2 = 4`` image tokens per image. No image splitting, so every image costs the
same 7 prompt tokens (``<fake_token_around_image><global-img>`` + 4 x ``<image>`` +
``<fake_token_around_image>``). The language model is the text demo model's Llama.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmendpoints_runtime.demo import SEED, SPECIAL_TOKENS, model_config, train_tokenizer

IMAGE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 4

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
END_OF_UTTERANCE = "<end_of_utterance>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
# Idefics3's processor looks these up even when it never splits an image.
ROW_COL_TOKENS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
VISION_SPECIAL_TOKENS = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE_TOKEN]

# One `<image>` per image part, where the part is (the processor expands it); text parts as is.
# vLLM sees the loop over `message['content']` and passes image parts as {"type": "image"}.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' or part['type'] == 'image_url' %}{{ '<image>' }}"
    "{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_utterance>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _tokenizer():
    from tokenizers import AddedToken

    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in VISION_SPECIAL_TOKENS]
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ROW_COL_TOKENS]
    )
    return tokenizer


def _config(tokenizer) -> dict:
    text = model_config(tokenizer.get_vocab_size())
    text.pop("architectures")
    text["torch_dtype"] = "bfloat16"
    vision = {
        "model_type": "idefics3_vision",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 1,
        "num_channels": 3,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": tokenizer.token_to_id(IMAGE_TOKEN),
        "scale_factor": SCALE_FACTOR,
        "tie_word_embeddings": False,
        "pad_token_id": text["pad_token_id"],
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "text_config": text,
        "vision_config": vision,
        "torch_dtype": "bfloat16",
    }


def _weights(config: dict) -> dict:
    """Random weights under the checkpoint names transformers' Idefics3 model uses."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(Idefics3Config(**config))
    return {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
    }


def _image_processor_config() -> dict:
    return {
        "image_processor_type": "Idefics3ImageProcessorPil",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": IMAGE_SIZE},
        "max_image_size": {"longest_edge": IMAGE_SIZE},
        "do_image_splitting": False,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
        "resample": 1,
    }


def write_vision_demo_model(path: str | Path) -> Path:
    """Write the vision demo model to `path` (created if missing) and return it."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    config = _config(tokenizer)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "additional_special_tokens": [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE],
        "add_bos_token": False,
        "model_max_length": config["text_config"]["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "processor_class": "Idefics3Processor",
    }
    special_tokens_map = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "additional_special_tokens": [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE],
    }
    processor_config = {
        "processor_class": "Idefics3Processor",
        "image_seq_len": IMAGE_TOKENS_PER_IMAGE,
    }
    generation_config = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    for name, data in (
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
        ("preprocessor_config.json", _image_processor_config()),
        ("processor_config.json", processor_config),
        ("generation_config.json", generation_config),
    ):
        (out / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    save_file(_weights(config), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(
        "# llmendpoints vision demo model\n\n"
        "A tiny Idefics3 (SmolVLM architecture) image+text model with RANDOM weights, written by "
        "`llmendpoints-runtime demo-model --vision`. Images are resized to "
        f"{IMAGE_SIZE}x{IMAGE_SIZE} pixels and cost {IMAGE_TOKENS_PER_IMAGE + 3} prompt tokens "
        "each. It exists so images can be sent through the runtime without downloading "
        "weights; its output is gibberish.\n"
    )
    return out

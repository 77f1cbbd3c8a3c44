"""A model in a local folder (config.json and *.safetensors): the facts the check needs, read from
the files' headers only. For `llmendpoints-operator fit ./folder` and the tests; the operator
itself reads models from a hub (checker.py)."""

from __future__ import annotations

import json
from pathlib import Path

from llmendpoints_operator.fit.safetensors import LENGTH_BYTES, header_length, parse_header
from llmendpoints_operator.fit.sizing import ModelFacts


def read_folder(path: str | Path) -> ModelFacts:
    folder = Path(path)
    config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # the shards vLLM loads (a repo may also hold consolidated copies)
        shards = set(json.loads(index.read_text())["weight_map"].values())
        files = [folder / name for name in sorted(shards)]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    tensors = []
    for file in files:
        with file.open("rb") as handle:
            length = header_length(handle.read(LENGTH_BYTES), file.name)
            tensors += parse_header(handle.read(length), file.name)
    return ModelFacts(config=config, tensors=tuple(tensors), revision=None, source=str(folder))

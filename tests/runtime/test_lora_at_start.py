"""LoRA adapters served from the start, the worker-vllm way: ENABLE_LORA=1 with LORA_MODULES.

The demo adapters (`llmendpoints-runtime demo-adapter PATH --seed N`, rank 8) on the real
engine, MAX_LORA_RANK=8, and MAX_LORAS=1: two adapters, one batch slot, so serving one after
the other swaps them in the engine. An adapter above MAX_LORA_RANK is refused before the engine
starts, naming the variable.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from runtime_process import RUNTIME_BIN, RuntimeServer, free_port, running_runtime, runtime_env

pytestmark = pytest.mark.engine

PROMPT = "The quick brown fox"


def write_adapter(path: Path, seed: int) -> Path:
    subprocess.run(
        [str(RUNTIME_BIN), "demo-adapter", str(path), "--seed", str(seed)],
        check=True,
        capture_output=True,
    )
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("start-adapters")
    return {name: write_adapter(root / name, seed) for name, seed in (("a1", 1), ("a2", 2))}


@pytest.fixture(scope="module")
def server(demo_model, runtime_logs, adapters) -> Iterator[RuntimeServer]:
    modules = [
        {"name": "a1", "path": str(adapters["a1"]), "base_model_name": "demo"},
        {"name": "a2", "path": str(adapters["a2"])},
    ]
    with running_runtime(
        demo_model,
        runtime_logs,
        ENABLE_LORA="1",
        LORA_MODULES=json.dumps(modules),
        MAX_LORAS="1",
        MAX_LORA_RANK="8",
    ) as running:
        yield running


def complete(server: RuntimeServer, model: str) -> str:
    response = httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_start_adapters_are_listed_with_their_base(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    models = {m.id: getattr(m, "parent", None) for m in client.models.list().data}
    assert models == {"demo": None, "a1": "demo", "a2": "demo"}


def test_each_adapter_is_served_and_differs_from_the_base_and_from_the_other(server):
    base, first, second = (complete(server, m) for m in ("demo", "a1", "a2"))
    assert first != base and second != base and first != second
    # MAX_LORAS=1: a2 took the engine's only slot; a1 comes back with the same weights.
    assert complete(server, "a1") == first
    assert complete(server, "demo") == base


def test_the_openai_sdk_reaches_a_start_adapter_on_chat_too(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="a2", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "a2" and chat.choices[0].message.content


def test_an_adapter_above_max_lora_rank_is_refused_before_the_engine_starts(
    demo_model, adapters, tmp_path
):
    big = tmp_path / "rank-16"
    big.mkdir()
    for item in adapters["a1"].iterdir():
        (big / item.name).write_bytes(item.read_bytes())
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    env = runtime_env(
        demo_model,
        free_port(),
        ENABLE_LORA="1",
        MAX_LORA_RANK="8",
        LORA_MODULES=json.dumps([{"name": "big", "path": str(big)}]),
    )
    done = subprocess.run(
        [str(RUNTIME_BIN), "serve"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "configuration error: MAX_LORA_RANK:" in done.stderr
    assert "adapter 'big'" in done.stderr and "rank 16" in done.stderr
    assert "Worker" not in done.stdout  # no engine was started

"""LoRA adapters declared in a mounted file, reconciled into the running engine without restarts.

One real runtime on the demo model (one engine for the whole module) with LLMEP_ADAPTERS_FILE, as
the operator's ConfigMap provides it. The file is rewritten by the tests the way the kubelet
refreshes a ConfigMap (a whole new file swapped in), and the runtime must follow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fake_hub import FakeHub
from runtime_process import RUNTIME_BIN, RuntimeServer, check_model_server, running_runtime

pytestmark = pytest.mark.engine

PROMPT = "The quick brown fox"
HUB_REPO = "acme/slow-lora"
# The hub adapter (~30 kB) trickles in over ~10 s: long enough to see "declared, not loaded".
HUB_BYTES_PER_SECOND = 3_000


def write_adapter(path: Path, seed: int) -> Path:
    """Through the CLI users run: `llmendpoints-runtime demo-adapter PATH --seed N`."""
    subprocess.run(
        [str(RUNTIME_BIN), "demo-adapter", str(path), "--seed", str(seed)],
        check=True,
        capture_output=True,
    )
    return path


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = {name: write_adapter(root / name, seed) for name, seed in (("a1", 1), ("a2", 2))}
    dirs["a3"] = write_adapter(root / "a3", 3)
    dirs["hub"] = write_adapter(root / "hub", 4)
    broken = write_adapter(root / "broken", 5)
    # A rank the engine was not started for (MAX_LORA_RANK=8): vLLM refuses to load it.
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    dirs["broken"] = broken
    return dirs


@pytest.fixture(scope="module")
def adapters_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapters-configmap") / "adapters.json"


def declare(path: Path, *entries: dict) -> None:
    """Replace the file in one step, as the kubelet swaps a refreshed ConfigMap in."""
    staged = path.with_suffix(".tmp")
    staged.write_text(json.dumps({"adapters": list(entries)}))
    os.replace(staged, path)


def local(name: str, dirs: dict[str, Path]) -> dict:
    return {"name": name, "source": str(dirs[name])}


@pytest.fixture(scope="module")
def hub(adapter_dirs) -> Iterator[FakeHub]:
    with FakeHub(adapter_dirs["hub"], HUB_REPO, bytes_per_second=HUB_BYTES_PER_SECOND) as fake:
        yield fake


@pytest.fixture(scope="module")
def server(
    demo_model, runtime_logs, adapter_dirs, adapters_file, hub, tmp_path_factory
) -> Iterator[RuntimeServer]:
    declare(
        adapters_file,
        local("a1", adapter_dirs),
        local("a2", adapter_dirs),
        local("broken", adapter_dirs),
    )
    with running_runtime(
        demo_model,
        runtime_logs,
        ENABLE_LORA="1",
        MAX_LORAS="4",
        MAX_LORA_RANK="8",
        LLMEP_ADAPTERS_FILE=str(adapters_file),
        LLMEP_ADAPTERS_POLL_SECONDS="0.5",
        BASE_PATH=str(tmp_path_factory.mktemp("model-cache")),
        HF_ENDPOINT=hub.url,
        HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_TELEMETRY="1",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def completion(server: RuntimeServer, model: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
        timeout=60,
    )


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def served_ids(client: openai.OpenAI) -> dict[str, str | None]:
    return {m.id: getattr(m, "parent", None) for m in client.models.list().data}


def metrics(server: RuntimeServer) -> str:
    return httpx.get(server.url + "/metrics").text


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_declared_adapters_are_listed_with_their_base(server, client):
    def both_listed():
        ids = served_ids(client)
        return ids if {"a1", "a2"} <= ids.keys() else None

    models = wait_for(both_listed, 60, "a1 and a2 in /v1/models")
    assert models["demo"] is None
    assert models["a1"] == models["a2"] == "demo"
    assert "broken" not in models
    assert re.search(r'llmendpoints_adapter_ready\{adapter="a1"\} 1\.0', metrics(server))


def test_each_adapter_answers_differently_from_the_base(server, client):
    texts = {
        model: client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        .choices[0]
        .text
        for model in ("demo", "a1", "a2")
    }
    assert len(set(texts.values())) == 3, texts
    # Deterministic at temperature 0: the same adapter gives the same text again.
    assert text_of(completion(server, "a1")) == texts["a1"]
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0
    )
    assert chat.model == "a1"


def test_jobs_and_sagemaker_payloads_use_the_adapter(server):
    expected = text_of(completion(server, "a2"))
    native = httpx.post(
        server.url + "/runsync",
        json={
            "input": {
                "model": "a2",
                "prompt": PROMPT,
                "sampling_params": {"max_tokens": 12, "temperature": 0},
            }
        },
        timeout=60,
    ).json()
    assert native["status"] == "COMPLETED", native
    assert native["output"][0]["choices"][0]["tokens"][0] == expected
    routed = httpx.post(
        server.url + "/runsync",
        json={
            "input": {
                "openai_route": "/v1/completions",
                "openai_input": {
                    "model": "a2",
                    "prompt": PROMPT,
                    "max_tokens": 12,
                    "temperature": 0,
                },
            }
        },
        timeout=60,
    ).json()
    assert routed["status"] == "COMPLETED", routed
    assert routed["output"]["choices"][0]["text"] == expected
    invoked = httpx.post(
        server.url + "/invocations",
        json={"model": "a2", "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
        timeout=60,
    )
    assert text_of(invoked) == expected


def test_a_broken_adapter_is_reported_and_the_base_keeps_serving(server):
    def error_exported():
        text = metrics(server)
        return text if 'llmendpoints_adapter_error_info{adapter="broken"' in text else None

    exported = wait_for(error_exported, 60, "the broken adapter's error on /metrics")
    assert re.search(r'llmendpoints_adapter_ready\{adapter="broken"\} 0\.0', exported)
    assert re.search(
        r'llmendpoints_adapter_load_failures_total\{adapter="broken"\} [1-9]', exported
    )
    error = re.search(
        r'llmendpoints_adapter_error_info\{adapter="broken",message="([^"]*)"', exported
    )
    assert error and "rank" in error.group(1).lower(), exported
    assert "adapter broken" in server.log() and "the base model keeps serving" in server.log()

    refused = completion(server, "broken")
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) >= 1
    assert "failed to load" in refused.json()["error"]["message"]
    assert text_of(completion(server, "demo"))  # the base model is unaffected
    assert text_of(completion(server, "a1"))


def test_an_adapter_still_downloading_answers_503_then_serves(server, adapter_dirs, adapters_file):
    base_text = text_of(completion(server, "demo"))
    declare(
        adapters_file,
        local("a1", adapter_dirs),
        local("a2", adapter_dirs),
        local("broken", adapter_dirs),
        {"name": "hub", "source": HUB_REPO},
    )
    waiting = wait_for(
        lambda: r if (r := completion(server, "hub")).status_code == 503 else None,
        10,
        "503 for the declared hub adapter",
    )
    assert waiting.headers["retry-after"].isdigit()
    assert "still downloading" in waiting.json()["error"]["message"]
    job = httpx.post(server.url + "/run", json={"input": {"model": "hub", "prompt": PROMPT}})
    assert job.status_code == 503 and "retry-after" in job.headers
    assert job.json()["error"]["param"] == "input.model"

    served = wait_for(
        lambda: r if (r := completion(server, "hub")).status_code == 200 else None,
        60,
        "the hub adapter to serve",
    )
    assert text_of(served) != base_text
    # Downloaded into the model cache (BASE_PATH), where the next pod start finds it.
    cache = Path(server.env["BASE_PATH"]) / "hub" / "models--acme--slow-lora" / "snapshots"
    assert {p.name for p in cache.glob("*/*")} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }


def test_an_adapter_added_at_run_time_is_served_within_seconds(
    server, adapter_dirs, adapters_file, client
):
    pid = server.process.pid
    assert completion(server, "a3").status_code == 404  # not declared yet
    declared_at = time.monotonic()
    declare(
        adapters_file,
        local("a1", adapter_dirs),
        local("a2", adapter_dirs),
        local("a3", adapter_dirs),
        local("broken", adapter_dirs),
        {"name": "hub", "source": HUB_REPO},
    )
    wait_for(lambda: completion(server, "a3").status_code == 200, 15, "a3 to serve")
    print(f"a3 served {time.monotonic() - declared_at:.1f} s after it was declared")
    assert server.process.pid == pid and server.process.poll() is None  # no restart
    assert served_ids(client)["a3"] == "demo"


def test_a_removed_adapter_answers_404(server, adapter_dirs, adapters_file, client):
    declare(adapters_file, local("a1", adapter_dirs), local("a3", adapter_dirs))
    gone = wait_for(
        lambda: r if (r := completion(server, "a2")).status_code == 404 else None,
        15,
        "a2 to be unloaded",
    )
    assert "a2" in gone.json()["error"]["message"]
    assert "a2" not in served_ids(client)
    job = httpx.post(server.url + "/run", json={"input": {"model": "a2", "prompt": PROMPT}})
    assert job.status_code == 404 and job.json()["error"]["param"] == "input.model"
    assert 'adapter="a2"' not in metrics(server)
    assert text_of(completion(server, "a1"))  # the others stay


def test_the_pod_reports_its_adapters_as_an_endpoint_picker_reads_them(server):
    """With adapters served, `check-model-server` also requires vLLM's LoRA metric."""
    rows = check_model_server(server.url)
    assert "adapters a1" in rows["/v1/models"] or "adapters a2" in rows["/v1/models"]
    assert rows["vllm:lora_requests_info"].split()[1] == "pass"
    assert "max_lora=4" in rows["vllm:lora_requests_info"]

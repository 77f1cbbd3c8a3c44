"""Compile once per model, not per pod: two runtimes one after the other on one model-cache
directory (BASE_PATH), each with a HOME of its own -- the second replica of a scale from zero
on a fresh pod. The second loads what the first compiled (vLLM reports a cache hit, compiles
nothing again), and both serve the same answers. How much faster it starts -- issue 32's goal of
a load phase at most 0.6x the first's -- is a speed target, measured in bench/cold_start.py
(bench/RESULTS.md, "Cold start"), not asserted here: on a loaded machine the engine processes'
own start, which no cache shortens, moves the ratio; the test prints the phases it saw.

Why it holds (bench/RESULTS.md, "Cold start"): the compile caches live on the volume
(compile_cache.py): vLLM's model-info cache spares the second start a subprocess that imports
torch, and the compiled model is loaded instead of compiled (vllm_plugin.py makes the CPU
build's artifact loadable). What is left in both is the engine processes' own start.
"""

from __future__ import annotations

import os
import re

import httpx
import pytest
from plugin_registration import plugin_path
from runtime_process import running_runtime

pytestmark = pytest.mark.engine

PROMPT = {"model": "demo", "prompt": "The cache", "max_tokens": 8, "temperature": 0}


def _phases(metrics: str) -> dict[str, float]:
    found = re.findall(r'llmendpoints_startup_phase_seconds\{phase="(\w+)"\} ([\d.e+-]+)', metrics)
    return {phase: round(float(value), 2) for phase, value in found}


def _start(demo_model, logs, base, home, extra_path) -> dict:
    pythonpath = os.pathsep.join(
        p for p in (str(extra_path) if extra_path else "", os.environ.get("PYTHONPATH", "")) if p
    )
    with running_runtime(
        demo_model, logs, BASE_PATH=str(base), HOME=str(home), PYTHONPATH=pythonpath
    ) as server:
        reply = httpx.post(server.url + "/v1/completions", json=PROMPT, timeout=120)
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert reply.status_code == 200, reply.text
    return {
        "phases": _phases(metrics),
        "text": reply.json()["choices"][0]["text"],
        "source": re.findall(r'llmendpoints_startup_compile_source\{source="(\w+)"\} 1', metrics),
        "log": server.log(),
    }


# Two engine starts one after the other: minutes each while other engines load the machine.
@pytest.mark.timeout(2400)
def test_a_second_replica_on_the_same_cache_loads_what_the_first_compiled(
    demo_model, runtime_logs, tmp_path
):
    base = tmp_path / "model-cache"
    extra = plugin_path(tmp_path / "plugin-registration")
    first = _start(demo_model, runtime_logs, base, tmp_path / "home-a", extra)
    second = _start(demo_model, runtime_logs, base, tmp_path / "home-b", extra)

    measured = f"first: {first['phases']}, second: {second['phases']}"
    print(measured)  # pytest -s: the numbers of a passing run too (bench/RESULTS.md)
    assert first["source"] == ["compiled"], measured
    assert second["source"] == ["cache"], second["log"][-3000:]
    assert "Compiling model again" not in second["log"]
    assert second["text"] == first["text"]  # the loaded model computes what the compiled one did

    # Everything compiled went to the volume, one directory per toolchain; nothing to HOME.
    toolchains = list((base / "llmendpoints-compile-cache").iterdir())
    assert len(toolchains) == 1 and (toolchains[0] / "toolchain.json").is_file()
    assert any((toolchains[0] / "vllm" / "torch_compile_cache").rglob("model"))
    for home in ("home-a", "home-b"):
        assert not list((tmp_path / home).rglob("torch_compile_cache")), home

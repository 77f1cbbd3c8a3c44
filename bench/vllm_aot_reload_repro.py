"""Minimal reproduction for vLLM: the CPU build cannot load the AOT-compiled model it saved.

    .venv/bin/python bench/vllm_aot_reload_repro.py [MODEL]     # ~10 minutes on 2 cores

Starts vLLM's offline ``LLM`` twice, one process after the other, on one VLLM_CACHE_ROOT, with
our plugin left out (VLLM_PLUGINS=none): the first compiles and saves the artifact, the second
logs "Compiling model again due to a load failure ... 'function' object has no attribute
'finalize_loading'" and compiles again. MODEL defaults to the project's demo model (written to a
temporary folder; no download); any small model vLLM's CPU build runs reproduces it. Then the same
pair with our plugin (vllm_plugin.py, registered as a vLLM general plugin): the second start logs
"Directly load AOT compilation". bench/RESULTS.md, "Cold start", has the report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from plugin_registration import plugin_path  # noqa: E402

START = """
from vllm import LLM, SamplingParams
llm = LLM({model!r}, max_model_len=512)
print(llm.generate(["The cache"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].text)
"""
MARKERS = ("saved AOT compiled function", "Compiling model again", "Directly load AOT compilation")


def start(model: str, cache_root: Path, extra_env: dict[str, str]) -> list[str]:
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(cache_root),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        **extra_env,
    }
    result = subprocess.run(
        [sys.executable, "-c", START.format(model=model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = (result.stdout + result.stderr).splitlines()
    return [line for line in lines if any(m in line for m in MARKERS)] or lines[-5:]


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="aot-repro-"))
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        from llmendpoints_runtime.demo import write_demo_model

        model = str(write_demo_model(root / "model"))
    without = {"VLLM_PLUGINS": "none"}
    registration = plugin_path(root / "plugin-registration")
    pythonpath = os.pathsep.join(
        p for p in (str(registration or ""), os.environ.get("PYTHONPATH", "")) if p
    )
    # VLLM_PLUGINS is one of the variables vLLM hashes into the compile cache's path: each pair
    # keeps its own value.
    plugin = {"PYTHONPATH": pythonpath}
    for label, cache, env in (
        ("1st start (vLLM alone)", "plain", without),
        ("2nd start (vLLM alone)", "plain", without),
        ("1st start (with our plugin)", "plugin", plugin),
        ("2nd start (with our plugin)", "plugin", plugin),
    ):
        print(f"== {label}")
        for line in start(model, root / cache, env):
            print("   ", line if len(line) < 240 else f"{line[:110]} ... {line[-120:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

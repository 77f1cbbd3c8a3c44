"""Compile once per model: where the runtime puts vLLM's and torch's compile caches
(compile_cache.py), how vLLM's processes report their compile (startup_report.py), and the
plugin that makes the CPU build's compiled model loadable (vllm_plugin.py)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from llmendpoints_runtime import compile_cache, startup_report, vllm_plugin
from llmendpoints_runtime.compile_cache import Toolchain

TOOLCHAIN = Toolchain("0.32.0", "2.13.0+cpu", "none", "3.11.7", "cpu:x86_64:avx2,avx512f")

NVIDIA_INFO = """Model: \t\t NVIDIA H100 80GB HBM3
IRQ:   \t\t 55
GPU UUID: \t\t GPU-1234
"""
CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse sse2 avx avx2 fma f16c avx512f avx512bw hypervisor amx_tile
processor\t: 1
flags\t\t: fpu
"""


def test_the_device_is_the_gpu_model_or_the_cpus_vector_isa():
    assert compile_cache.gpu_models([NVIDIA_INFO, NVIDIA_INFO]) == ["NVIDIA H100 80GB HBM3"]
    assert compile_cache.cpu_isa(CPUINFO) == [
        "amx_tile",
        "avx2",
        "avx512bw",
        "avx512f",
        "f16c",
        "fma",
    ]
    assert compile_cache.device_identity("x86_64", ["NVIDIA H100 80GB HBM3"], []) == (
        "cuda:NVIDIA H100 80GB HBM3"
    )
    assert compile_cache.device_identity("x86_64", [], ["avx2"]) == "cpu:x86_64:avx2"


def test_each_toolchain_gets_its_own_directory():
    name = TOOLCHAIN.directory_name()
    assert name.startswith("vllm-0.32.0-torch-2.13.0+cpu-py3.11-")
    others = [
        Toolchain("0.33.0", "2.13.0+cpu", "none", "3.11.7", TOOLCHAIN.device),
        Toolchain("0.32.0", "2.14.0+cpu", "none", "3.11.7", TOOLCHAIN.device),
        Toolchain("0.32.0", "2.13.0+cpu", "3.5.0", "3.11.7", TOOLCHAIN.device),
        Toolchain("0.32.0", "2.13.0+cpu", "none", "3.12.1", TOOLCHAIN.device),
        Toolchain("0.32.0", "2.13.0+cpu", "none", "3.11.7", "cpu:x86_64:avx2"),  # no AVX-512
        Toolchain("0.32.0", "2.13.0+cpu", "none", "3.11.7", "cuda:NVIDIA L4"),
    ]
    assert len({name, *(t.directory_name() for t in others)}) == 1 + len(others)
    same = Toolchain("0.32.0", "2.13.0+cpu", "none", "3.11.7", "cpu:x86_64:avx2,avx512f")
    assert same.directory_name() == name  # stable


def test_the_root_is_on_the_model_cache_unless_told_otherwise():
    assert compile_cache.chosen_root({}, TOOLCHAIN) is None  # no volume: vLLM's own (HOME)
    base = compile_cache.chosen_root({"BASE_PATH": "/models"}, TOOLCHAIN)
    assert base == Path("/models/llmendpoints-compile-cache") / TOOLCHAIN.directory_name()
    mine = compile_cache.chosen_root(
        {"BASE_PATH": "/models", "LLMEP_COMPILE_CACHE_DIR": "/fast"}, TOOLCHAIN
    )
    assert mine == Path("/fast") / TOOLCHAIN.directory_name()
    off = {"BASE_PATH": "/models", "LLMEP_COMPILE_CACHE_DIR": "none"}
    assert compile_cache.chosen_root(off, TOOLCHAIN) is None


def test_every_cache_moves_except_the_ones_the_user_set():
    env = compile_cache.cache_environment(Path("/c"), {"TRITON_CACHE_DIR": "/mine"})
    assert env["VLLM_CACHE_ROOT"] == "/c/vllm"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/c/inductor"
    assert "TRITON_CACHE_DIR" not in env
    assert set(env) == set(compile_cache.CACHE_VARIABLES) - {"TRITON_CACHE_DIR"}


def test_apply_sets_the_environment_and_describes_the_toolchain(tmp_path):
    env = {"BASE_PATH": str(tmp_path)}
    root = compile_cache.apply(env)
    assert root is not None and root.parent == tmp_path / "llmendpoints-compile-cache"
    assert env["VLLM_CACHE_ROOT"] == str(root / "vllm")
    described = json.loads((root / "toolchain.json").read_text())
    assert described["vllm"] == "0.32.0" and described["device"].startswith(("cpu:", "cuda:"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a read-only directory")
def test_a_read_only_volume_leaves_the_caches_in_home(tmp_path, caplog):
    tmp_path.chmod(0o555)
    try:
        env = {"BASE_PATH": str(tmp_path)}
        with caplog.at_level(logging.WARNING):
            assert compile_cache.apply(env) is None
        assert "VLLM_CACHE_ROOT" not in env and "not writable" in caplog.text
    finally:
        tmp_path.chmod(0o755)


def test_a_volume_that_cannot_be_written_leaves_the_caches_in_home(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = {"BASE_PATH": str(blocker)}  # as a read-only mount does: mkdir fails
    with caplog.at_level(logging.WARNING):
        assert compile_cache.apply(env) is None
    assert "VLLM_CACHE_ROOT" not in env and "every replica compiles the model again" in caplog.text


# --- what vLLM's processes report --------------------------------------------------------------


def test_vllms_records_become_events():
    cpu = "vllm.v1.worker.cpu_model_runner"
    assert startup_report.interpret(cpu, "Warming up model for the compilation...", (), 10.0) == {
        "event": "compile_begin",
        "at": 10.0,
    }
    core = "vllm.v1.engine.core"
    template = (
        "init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s)"
    )
    assert startup_report.interpret(core, template, (50.0, 21.5), 1.0)["compile_seconds"] == 21.5
    assert startup_report.interpret("vllm.other", "Warming up", (), 1.0) is None


def test_a_start_up_report_prefers_vllms_own_figure():
    span = [
        {"event": "compile_begin", "at": 100.0},
        {"event": "compiled", "at": 130.0},
        {"event": "compile_end", "at": 131.5},
    ]
    assert startup_report.summarize(span) == startup_report.StartupReport(31.5, "compiled")
    own = [*span, {"event": "init", "at": 140.0, "compile_seconds": 20.0}]
    assert startup_report.summarize(own).compile_seconds == 20.0
    reloaded = [{"event": "cache_hit", "at": 1.0}]
    assert startup_report.summarize(reloaded).compile_source == "cache"
    failed = [{"event": "cache_load_failed", "at": 1.0}, {"event": "compiled", "at": 2.0}]
    assert startup_report.summarize(failed).compile_source == "reload_failed"
    assert startup_report.summarize([]) == startup_report.StartupReport()


def test_the_plugins_filter_reports_through_the_file(tmp_path):
    path = tmp_path / "report.jsonl"
    startup_report.observe_vllm_logs({startup_report.ENV: str(path)})
    startup_report.observe_vllm_logs({startup_report.ENV: str(path)})  # once per logger
    runner = logging.getLogger("vllm.v1.worker.cpu_model_runner")
    decorators = logging.getLogger("vllm.compilation.decorators")
    try:
        runner.warning("Warming up model for the compilation...")
        decorators.warning("%sDirectly load AOT compilation from path %s", "", "/x")
        runner.warning("Warming up done.")
        runner.warning("something else")
        report = startup_report.read(str(path))
        assert report.compile_source == "cache" and report.compile_seconds is not None
        assert len(path.read_text().splitlines()) == 3
    finally:
        for logger in (runner, decorators):
            logger.filters.clear()
    assert startup_report.read(str(tmp_path / "missing")) == startup_report.StartupReport()


def test_prepare_names_a_fresh_report_file():
    env: dict[str, str] = {}
    path = startup_report.prepare(env)
    assert env[startup_report.ENV] == path and Path(path).read_text() == ""
    startup_report.discard(path)
    assert not Path(path).exists()
    startup_report.discard(path)  # gone already: nothing to do


def test_process_age_is_measured_from_proc():
    age = startup_report.process_age()
    assert age is not None and 0 <= age < 24 * 3600


# --- the plugin ----------------------------------------------------------------------------------


def test_the_plugin_makes_torchs_bundled_artifact_finalizable():
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    added = vllm_plugin.make_bundled_artifacts_loadable()
    try:
        assert "finalize_loading" in vars(Bundled)
        assert not vllm_plugin.make_bundled_artifacts_loadable()  # idempotent
        loaded = Bundled(type("Compiled", (), {"serialize": None})())
        assert loaded.finalize_loading(object()) is None  # nothing to do, and no error
    finally:
        if added:
            del Bundled.finalize_loading

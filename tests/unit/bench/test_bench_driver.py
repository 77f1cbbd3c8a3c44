"""The `make bench` driver (bench/run_all.py) and the runtime-vs-vLLM comparison's arithmetic."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while defined
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


run_all = _load("run_all")
runtime_vs_vllm = _load("runtime_vs_vllm")


def test_discovers_benchmarks_but_not_the_driver_or_helpers(tmp_path):
    for name in ("b.py", "a.py", "_helper.py", "run_all.py", "notes.md"):
        (tmp_path / name).write_text("")
    assert run_all.discover(tmp_path) == ["a", "b"]


def test_selects_all_by_default_and_named_ones_in_order():
    available = ["autoscaler", "operator_scale", "runtime_vs_vllm"]
    assert run_all.select(available, [], []) == available
    assert run_all.select(available, ["runtime_vs_vllm.py", "autoscaler"], []) == [
        "autoscaler",
        "runtime_vs_vllm",
    ]
    assert run_all.select(available, [], ["operator_scale"]) == ["autoscaler", "runtime_vs_vllm"]


def test_unknown_name_is_an_error_that_lists_the_benchmarks():
    with pytest.raises(ValueError, match="unknown benchmark\\(s\\): nope; available: a, b"):
        run_all.select(["a", "b"], ["nope"], [])


def test_a_failing_benchmark_is_reported_with_its_exit_code(tmp_path, capsys):
    (tmp_path / "good.py").write_text("import sys; print('args', sys.argv[1:])\n")
    (tmp_path / "bad.py").write_text("print('trying'); raise SystemExit(3)\n")
    logs = tmp_path / "out"
    logs.mkdir()
    good = run_all.run("good", logs, ["--rounds", "1"], folder=tmp_path)
    bad = run_all.run("bad", logs, [], folder=tmp_path)
    assert (good.returncode, bad.returncode) == (0, 3)
    assert "args ['--rounds', '1']" in (logs / "good.log").read_text()
    assert "trying" in (logs / "bad.log").read_text()
    lines = run_all.report([good, bad]).splitlines()
    assert lines[0].startswith("good  ok")
    assert lines[1].startswith("bad   FAILED (exit 3)")


def _run(server: str, round_: int, rps: float, ttft: float, failed: int = 0):
    return runtime_vs_vllm.RunResult(
        server=server,
        round=round_,
        completed=200,
        failed=failed,
        duration_s=200 / rps,
        request_throughput=rps,
        output_throughput=rps * 32,
        median_ttft_ms=ttft,
        p99_ttft_ms=ttft * 2,
        mean_ttft_ms=ttft,
        median_tpot_ms=5.0,
        median_e2el_ms=300.0,
        api_cpu_ms_per_request=2.0,
        engine_cpu_ms_per_request=20.0,
    )


def test_ratios_are_the_median_over_rounds_of_each_rounds_ratio():
    ours, plain = runtime_vs_vllm.OURS, runtime_vs_vllm.PLAIN
    runs = [
        _run(ours, 1, 48.0, 104.0),
        _run(plain, 1, 50.0, 100.0),
        # Both sides slowed by other work in this round: the ratio is what counts.
        _run(ours, 2, 24.5, 208.0),
        _run(plain, 2, 25.0, 200.0),
        # One disturbed run does not decide the result.
        _run(ours, 3, 10.0, 900.0),
        _run(plain, 3, 50.0, 100.0),
    ]
    result = runtime_vs_vllm.compare(runs)
    assert result["request_throughput_ratio"] == pytest.approx(0.96)
    assert result["median_ttft_ratio"] == pytest.approx(1.04)
    assert result["range_over_rounds"]["request_throughput_ratio"] == pytest.approx([0.2, 0.98])
    assert result["ratio_of_medians"]["request_throughput_ratio"] == pytest.approx(24.5 / 50.0)
    assert result["throughput_target_met"] is False
    assert result["ttft_target_met"] is True
    assert [r["round"] for r in result["per_round"]] == [1, 2, 3]


def test_a_round_without_both_sides_is_not_compared():
    ours, plain = runtime_vs_vllm.OURS, runtime_vs_vllm.PLAIN
    result = runtime_vs_vllm.compare(
        [_run(ours, 1, 50.0, 100.0), _run(plain, 1, 50.0, 100.0), _run(ours, 2, 1.0, 1.0)]
    )
    assert [r["round"] for r in result["per_round"]] == [1]
    assert result["request_throughput_ratio"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least one round with a run of each server"):
        runtime_vs_vllm.compare([_run(ours, 1, 50.0, 100.0), _run(plain, 2, 50.0, 100.0)])


def test_server_cpu_over_a_run_is_reported_per_request():
    before = runtime_vs_vllm.CpuUse(api_seconds=10.0, engine_seconds=100.0)
    after = runtime_vs_vllm.CpuUse(api_seconds=10.6, engine_seconds=106.0)
    data = {
        "completed": 300,
        "duration": 6.0,
        "request_throughput": 50.0,
        "output_throughput": 1600.0,
        "median_ttft_ms": 100.0,
        "p99_ttft_ms": 150.0,
        "mean_ttft_ms": 105.0,
        "median_tpot_ms": 6.0,
        "median_e2el_ms": 300.0,
    }
    run = runtime_vs_vllm.RunResult.from_vllm_json("runtime", 1, data, after - before, 300)
    assert run.api_cpu_ms_per_request == pytest.approx(2.0)
    assert run.engine_cpu_ms_per_request == pytest.approx(20.0)
    assert run.failed == 0


LOAD = runtime_vs_vllm.Load(200, 64, 32, 16, 16, 0)
FACTS = {
    "cpus": 2,
    "cpu_model": "test CPU",
    "memory_gib": 24,
    "load_before": "1.00 1.00 1.00",
    "load_after": "2.00 1.00 1.00",
    "python": "3.11",
    "vllm": "0.32.0",
    "servers": "all up for all rounds",
}
OVERHEAD = {
    "chunks_per_request": 34,
    "direct_us": 10.0,
    "runtime_stack_us": 100.0,
    "overhead_us": 90.0,
}


def test_summary_names_every_ratio_and_the_verdicts():
    ours, plain = runtime_vs_vllm.OURS, runtime_vs_vllm.PLAIN
    runs = [_run(ours, 1, 49.0, 100.0), _run(plain, 1, 50.0, 100.0)]
    text = runtime_vs_vllm.markdown(
        runs, runtime_vs_vllm.compare(runs), LOAD, FACTS, "cmd", dict(OVERHEAD)
    )
    assert "request throughput (target >= 0.97): **0.980**" in text
    assert "median TTFT (target <= 1.05): **1.000**" in text
    assert "CPU per request of the HTTP/API process: **1.000**" in text
    assert "**90 µs** added per request" in text
    assert "order A B (A = " in text


def test_an_older_runtime_runs_next_to_ours_each_round_first_in_turn():
    ours, old, plain = runtime_vs_vllm.OURS, runtime_vs_vllm.OLD, runtime_vs_vllm.PLAIN
    order = runtime_vs_vllm.round_order
    assert [order(r, False, True) for r in (1, 2, 3)] == [
        [ours, old, plain],
        [old, ours, plain],
        [ours, old, plain],
    ]
    assert order(2, True, True) == [plain, old, ours]
    assert order(2, False, False) == [ours, plain]


def test_the_summary_compares_ours_with_the_older_runtime():
    ours, old, plain = runtime_vs_vllm.OURS, runtime_vs_vllm.OLD, runtime_vs_vllm.PLAIN
    runs = [_run(ours, 1, 45.0, 110.0), _run(old, 1, 50.0, 100.0), _run(plain, 1, 50.0, 100.0)]
    facts = {**FACTS, "before": "/old"}
    others = {"Ratios ours/older runtime (A/A')": runtime_vs_vllm.compare(runs, ours, old)}
    overhead = {
        **OVERHEAD,
        "before": {"direct_us": 10.0, "runtime_stack_us": 70.0, "overhead_us": 60.0},
    }
    text = runtime_vs_vllm.markdown(
        runs, runtime_vs_vllm.compare(runs), LOAD, facts, "cmd", overhead, others
    )
    assert "order A A' B (A = " in text and "A' = the runtime of /old" in text
    assert "| 2 (round 1) | A' runtime (before) | 50.00 |" in text
    ours_vs_old = text.split("Ratios ours/older runtime (A/A')")[1]
    assert (
        "request throughput (target >= 0.97): **0.900** (0.900-0.900; 0.900): **no**" in ours_vs_old
    )
    assert "**60 µs** added per request (ours/older: 1.50)" in text


gateway_streams = _load("gateway_streams")
abuse = _load("abuse")


def test_the_older_gateway_runs_next_to_ours_and_first_every_other_round():
    targets = ["gateway", "asgi", "aiohttp"]
    assert gateway_streams.round_targets(targets, 1, True) == [
        "gateway",
        "gateway-before",
        "asgi",
        "aiohttp",
    ]
    assert gateway_streams.round_targets(targets, 2, True)[:2] == ["gateway-before", "gateway"]
    assert gateway_streams.round_targets(targets, 2, False) == targets
    assert gateway_streams.round_targets(["asgi"], 1, True) == ["asgi"]


def test_an_older_checkout_without_the_edge_package_runs_from_its_own_folders(tmp_path):
    for folder in ("gateway", "common", "runtime"):
        (tmp_path / folder).mkdir()
    assert gateway_streams.gateway_code_path(tmp_path).split(":") == [
        str(tmp_path / "gateway"),
        str(tmp_path / "common"),
    ]
    assert abuse.pythonpath(tmp_path).split(":") == [
        str(tmp_path / f) for f in ("runtime", "gateway", "common")
    ]
    assert [label for label, _ in abuse.code_trees(tmp_path)] == ["before", "after"]
    assert abuse.code_trees(None) == [("this code", abuse.REPO)]


@pytest.mark.parametrize("size", [2048, 1024 * 1024 + 1])
def test_a_held_chat_body_is_exactly_its_size_and_a_chat_request(size):
    body = abuse.chat_body(size, "cold")
    assert len(body) == size
    request = json.loads(body)
    assert request["model"] == "cold" and request["messages"][0]["role"] == "user"
    with pytest.raises(ValueError, match="cannot be as small"):
        abuse.chat_body(10, "cold")


def test_each_gateway_is_summarised_against_the_same_direct_rounds():
    gateway_vs_direct = _load("gateway_vs_direct")
    direct = [
        {"request_throughput": 10.0, "median_ttft_ms": 20.0},
        {"request_throughput": 20.0, "median_ttft_ms": 10.0},
    ]
    through = [
        {
            "request_throughput": 9.0,
            "median_ttft_ms": 21.0,
            "gateway_cpu_ms_per_request": 0.5,
            "runtime_api_cpu_ms_per_request": 5.0,
        },
        {
            "request_throughput": 20.0,
            "median_ttft_ms": 13.0,
            "gateway_cpu_ms_per_request": 0.7,
            "runtime_api_cpu_ms_per_request": 3.5,
        },
    ]
    summary = gateway_vs_direct.gateway_summary(direct, through, "_before")
    assert summary["throughput_ratios_before"] == [0.9, 1.0]
    assert summary["throughput_ratio_median_before"] == pytest.approx(0.95)
    assert summary["ttft_added_ms_before"] == [1.0, 3.0]
    assert summary["gateway_cpu_ms_per_request_before"] == pytest.approx(0.6)
    assert summary["gateway_to_runtime_api_cpu_before"] == pytest.approx([0.1, 0.2])

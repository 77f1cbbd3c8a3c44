"""The three CLIs behave alike: `--version`, the settings listed in `serve`/`run --help` (from
the settings classes), and a bad setting stops every subcommand at once with exit status 2 and
a message naming the variable -- never a traceback, never a silent success."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from llmendpoints_common.settings_doc import setting_rows

CLIS = {
    "runtime": "llmendpoints_runtime",
    "operator": "llmendpoints_operator",
    "gateway": "llmendpoints_gateway",
}


def _run(
    component: str, *args: str, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LLMEP_", "KUBE"))}
    return subprocess.run(
        [sys.executable, "-m", CLIS[component], *args],
        capture_output=True, text=True, timeout=timeout, env={**clean, **env},
        cwd=Path(__file__).resolve().parent,
    )  # fmt: skip


@pytest.mark.parametrize("component", sorted(CLIS))
def test_version(component: str) -> None:
    result = _run(component, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"llmendpoints-{component} 0.") or result.stdout.startswith(
        f"{CLIS[component].replace('_', '-')} "
    )
    assert "0.1.0" in result.stdout


def test_the_runtime_says_which_vllm_it_runs() -> None:
    assert "(vLLM 0.32.0)" in _run("runtime", "--version").stdout


@pytest.mark.parametrize(
    ("component", "command", "settings"),
    [
        ("runtime", "serve", "llmendpoints_runtime.config:RuntimeSettings"),
        ("operator", "run", "llmendpoints_operator.config:OperatorSettings"),
        ("gateway", "serve", "llmendpoints_gateway.config:GatewaySettings"),
    ],
)
def test_serve_help_lists_every_setting(component: str, command: str, settings: str) -> None:
    module, name = settings.split(":")
    model = getattr(__import__(module, fromlist=[name]), name)
    result = _run(component, command, "--help")
    assert result.returncode == 0, result.stderr
    for variable, default, _ in setting_rows(model):
        assert f"  {variable} (default: {default.strip('`')})" in result.stdout, variable
    # ... and where the full table is.
    assert ("README.md" if component == "runtime" else f"docs/{component}.md") in result.stdout


@pytest.mark.parametrize(
    ("component", "args", "env", "variable"),
    [
        ("runtime", ["serve"], {"MODEL_NAME": "m", "PORT": "eighty"}, "PORT"),
        ("runtime", ["download"], {"MODEL_NAME": "m", "STARTUP_LOG_INTERVAL_SECONDS": "soon"},
         "STARTUP_LOG_INTERVAL_SECONDS"),
        ("runtime", ["download"], {"MODEL_NAME": "m", "TRUST_REMOTE_CODE": "maybe"},
         "TRUST_REMOTE_CODE"),
        ("runtime", ["download"], {"MODEL_NAME": "/no/such/model"}, "MODEL_NAME"),
        ("runtime", ["download"], {"MODEL_NAME": "m", "TOKENIZER_NAME": "./gone"},
         "TOKENIZER_NAME"),
        ("runtime", ["download"], {}, "MODEL_NAME"),
        ("operator", ["run"], {"LLMEP_OPERATOR_RESYNC_SECONDS": "-1"},
         "LLMEP_OPERATOR_RESYNC_SECONDS"),
        ("gateway", ["serve"], {"GATEWAY_HOLD_TIMEOUT_SECONDS": "forever"},
         "GATEWAY_HOLD_TIMEOUT_SECONDS"),
        ("gateway", ["usage", "--since", "2026-01-01"], {}, "JOBS_QUEUE_URL"),
        ("gateway", ["usage", "--since", "2026-01-01"], {"JOBS_QUEUE_URL": "http://nats:4222"},
         "JOBS_QUEUE_URL"),
    ],
)  # fmt: skip
def test_a_bad_setting_exits_2_naming_the_variable(
    component: str, args: list[str], env: dict[str, str], variable: str
) -> None:
    result = _run(component, *args, **env)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert f"{variable}:" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_explicit_bad_kubeconfig_stops_the_operator_at_once(tmp_path: Path) -> None:
    """kopf would retry its login forever: the operator would run and do nothing."""
    not_yaml = tmp_path / "garbage"
    not_yaml.write_text("{{{ not: yaml")
    no_context = tmp_path / "no-context"
    no_context.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\n")
    for path, says in (
        (tmp_path / "missing", "No such file"),
        (not_yaml, "not valid YAML"),
        (no_context, "no current-context"),
    ):
        began = time.monotonic()
        result = _run("operator", "run", "--standalone", KUBECONFIG=str(path), timeout=30)
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"KUBECONFIG: {path}" in result.stderr and says in result.stderr
        assert time.monotonic() - began < 30  # (the timeout above is the real bound)


def test_a_kubeconfig_whose_context_names_no_cluster_is_refused() -> None:
    from llmendpoints_operator.kubeconfig import config_problem

    good = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://10.0.0.1"}}],
    }
    assert config_problem([good], "x") is None
    assert "'c' is not among" in config_problem([{**good, "contexts": []}], "x")
    assert "names no cluster" in config_problem([{**good, "clusters": []}], "x")
    no_server = {**good, "clusters": [{"name": "k", "cluster": {}}]}
    assert "has no server" in config_problem([no_server], "x")
    # Merged as kubectl merges: the second file may define what the first names.
    first = {"current-context": "c", "contexts": good["contexts"]}
    assert config_problem([first, {"clusters": good["clusters"]}], "x") is None


# --- `llmendpoints-operator fit`: the operator's fit check, locally ------------------------------


@pytest.fixture(scope="module")
def hub():
    import model_shapes
    from fake_hub import HeaderHub, VirtualRepo

    def repo(config: dict, shards: int, **kwargs: object) -> VirtualRepo:
        sharded = model_shapes.shards(model_shapes.llama_tensors(config), shards)
        headers = {f: model_shapes.header(ts) for f, ts in sharded.items()}
        return VirtualRepo(config, headers, model_shapes.index(sharded), **kwargs)

    stand_in = HeaderHub()
    stand_in.repos["meta-llama/Meta-Llama-3-70B"] = repo(model_shapes.LLAMA_3_70B, 30)
    stand_in.repos["acme/private"] = repo(model_shapes.LLAMA_31_8B, 4, token="hf_secret")
    with stand_in:
        yield stand_in


def _fit(hub, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return _run("operator", "fit", *args, "--json", HF_ENDPOINT=hub.url, **env)


def test_fit_answers_as_the_operator_does(hub) -> None:
    import json

    import model_shapes

    refused = _fit(hub, "meta-llama/Meta-Llama-3-70B", "--gpu-memory", "81559Mi",
                   "--gpu-product", "NVIDIA-H100-80GB-HBM3")  # fmt: skip
    assert refused.returncode == 1, refused.stderr
    answer = json.loads(refused.stdout)
    assert (answer["status"], answer["reason"]) == ("False", "WeightsDoNotFit")
    assert "spec.engine.tensorParallelSize: 2" in answer["message"]
    fits = _fit(hub, "meta-llama/Meta-Llama-3-70B", "--gpus", "4", "--tensor-parallel-size",
                "4", "--gpu-memory", "80GiB")  # fmt: skip
    assert fits.returncode == 0, fits.stderr
    numbers = json.loads(fits.stdout)["fit"]
    assert numbers["weightsBytes"] == model_shapes.LLAMA_3_70B_TOTAL
    assert numbers["kvCacheBytesPerToken"] == 327_680
    assert numbers["revision"] == hub.repos["meta-llama/Meta-Llama-3-70B"].commit
    assert hub.violations == []


def test_fit_reads_private_models_with_hf_token(hub) -> None:
    import json

    without = _fit(hub, "acme/private", "--gpu-memory", "80GiB")
    assert without.returncode == 3, without.stderr
    assert "401" in json.loads(without.stdout)["message"]
    with_token = _fit(hub, "acme/private", "--gpu-memory", "80GiB", HF_TOKEN="hf_secret")
    assert with_token.returncode == 0, with_token.stderr


def test_fit_reads_a_local_folder_and_refuses_bad_arguments(tmp_path: Path) -> None:
    from llmendpoints_runtime.demo import write_demo_model

    folder = write_demo_model(tmp_path / "demo")
    result = _run("operator", "fit", str(folder), "--gpu-memory", "16Gi")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ModelFits: True (Fits)")
    bad = _run("operator", "fit", str(folder), "--gpu-memory", "lots")
    assert bad.returncode == 2
    assert "'lots' is not an amount of memory" in bad.stderr
    flag = _run("operator", "fit", str(folder), "--gpu-memory", "16Gi", "--max-num-seqs", "many")
    assert flag.returncode == 2
    assert "--max-num-seqs takes an integer" in flag.stderr

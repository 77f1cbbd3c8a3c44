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

"""`llmendpoints-operator` CLI and its settings."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from llmendpoints_operator import __version__
from llmendpoints_operator.__main__ import _parser
from llmendpoints_operator.config import DEFAULT_RUNTIME_IMAGE, OperatorSettings
from pydantic import ValidationError


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmendpoints_operator", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_run_accepts_kopfs_flags() -> None:
    args = _parser().parse_args(
        [
            "run",
            "--standalone",
            "-n",
            "a",
            "-n",
            "team-*",
            "--liveness",
            "http://0.0.0.0:8081/healthz",
            "--verbose",
        ]
    )
    assert (args.standalone, args.namespaces, args.liveness, args.verbose) == (
        True,
        ["a", "team-*"],
        "http://0.0.0.0:8081/healthz",
        True,
    )
    assert _parser().parse_args(["run", "-A"]).all_namespaces


def test_all_namespaces_and_namespace_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "-A", "-n", "a"])


def test_help_lists_the_run_options() -> None:
    result = _run("run", "--help")
    assert result.returncode == 0
    for flag in ("--standalone", "--all-namespaces", "--namespace", "--liveness", "--verbose"):
        assert flag in result.stdout


def test_a_bad_setting_stops_the_operator_naming_the_variable() -> None:
    result = _run("run", "-A", env={"LLMEP_OPERATOR_RESYNC_SECONDS": "-5"})
    assert result.returncode == 2
    assert "LLMEP_OPERATOR_RESYNC_SECONDS" in result.stderr


def test_settings_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = OperatorSettings()
    assert (
        defaults.runtime_image
        == DEFAULT_RUNTIME_IMAGE
        == f"ghcr.io/llmendpoints/runtime:{__version__}"
    )
    assert (defaults.gpu_resource_name, defaults.resync_seconds, defaults.metrics_port) == (
        "nvidia.com/gpu",
        300,
        8080,
    )
    assert defaults.runtime_pod_security_context["runAsNonRoot"] is True
    assert defaults.runtime_pod_security_context["runAsUser"] == 1000
    assert defaults.runtime_security_context["allowPrivilegeEscalation"] is False
    monkeypatch.setenv("LLMEP_OPERATOR_RUNTIME_IMAGE", "my/runtime:dev")
    monkeypatch.setenv(
        "LLMEP_OPERATOR_RUNTIME_SECURITY_CONTEXT", '{"readOnlyRootFilesystem": true}'
    )
    settings = OperatorSettings()
    assert settings.runtime_image == "my/runtime:dev"
    assert settings.runtime_security_context == {"readOnlyRootFilesystem": True}


def test_the_cluster_domain_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert OperatorSettings().cluster_domain == "cluster.local"
    monkeypatch.setenv("LLMEP_OPERATOR_CLUSTER_DOMAIN", "corp.example")
    assert OperatorSettings().cluster_domain == "corp.example"
    monkeypatch.setenv("LLMEP_OPERATOR_CLUSTER_DOMAIN", "http://corp.example")
    with pytest.raises(ValidationError, match="cluster_domain"):
        OperatorSettings()


def test_importing_the_handlers_only_registers_them() -> None:
    """No settings read, no client, no task at import: the operator's state is built by the
    startup handler (into kopf's memo), so a bad setting cannot break an import."""
    code = (
        "import kopf, llmendpoints_operator.handlers as h;"
        "r = kopf.get_default_registry();"
        # kopf adds fallback logins of its own for client libraries it finds installed (the
        # gateway's kubernetes-asyncio, in a development venv); ours replace them.
        "ours = [a for a in r._activities.get_all_handlers() if not a._fallback];"
        "print(len(ours), len(r._changing.get_all_handlers()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LLMEP_OPERATOR_RESYNC_SECONDS": "-5"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "3"]  # startup, login, cleanup; create, update, resume


def test_every_setting_is_in_the_documented_table() -> None:
    """docs/operator.md's "Operator settings" table lists every LLMEP_OPERATOR_* variable."""
    doc = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "operator.md").read_text()
    table = doc.split("## Operator settings", 1)[1].split("\n## ", 1)[0]
    missing = [
        f"LLMEP_OPERATOR_{name.upper()}"
        for name in OperatorSettings.model_fields
        if f"| `LLMEP_OPERATOR_{name.upper()}` |" not in table
    ]
    assert missing == []

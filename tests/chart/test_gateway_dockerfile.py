"""Static checks of Dockerfile.gateway (no Docker engine here): a pinned slim Python, the fixed
non-root uid the chart runs it as, the console script as entrypoint, hadolint clean."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from .helm_kit import CHART, ROOT, pyproject
from .test_dockerfiles import _ignored, exec_form, final_stage, parse

GATEWAY = parse(ROOT / "Dockerfile.gateway")


def test_built_on_a_pinned_slim_python() -> None:
    stages: set[str] = set()
    for ins in GATEWAY:
        if ins.keyword == "FROM":
            image, *alias = ins.values
            stages.update(alias[-1:])
            if image not in stages:
                assert re.fullmatch(r"python:3\.1[1-9]\.\d+-slim-\w+@sha256:[0-9a-f]{64}", image), (
                    image
                )


def test_runs_as_the_uid_the_chart_sets() -> None:
    users = [ins.args for ins in final_stage(GATEWAY) if ins.keyword == "USER"]
    assert users[-1] == "10001:10001"
    values = yaml.safe_load((CHART / "values.yaml").read_text())["gateway"]["podSecurityContext"]
    assert values["runAsUser"] == 10001 and values["runAsNonRoot"] is True


def test_entrypoint_is_the_console_script_and_installs_no_vllm() -> None:
    assert exec_form(GATEWAY, "ENTRYPOINT") == ["llmendpoints-gateway"]
    assert exec_form(GATEWAY, "CMD") == ["serve"]
    scripts = pyproject()["project"]["scripts"]
    assert scripts["llmendpoints-gateway"] == "llmendpoints_gateway.__main__:main"
    lock = (ROOT / "requirements" / "gateway.lock").read_text()
    assert "kubernetes-asyncio==" in lock and "uvicorn==" in lock
    assert "\nvllm" not in lock and "\ntorch" not in lock
    result = subprocess.run(
        [sys.executable, "-m", "llmendpoints_gateway", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and "serve" in result.stdout


def test_hadolint_finds_nothing() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run(
        [
            str(hadolint),
            "--no-color",
            "--failure-threshold",
            "style",
            str(ROOT / "Dockerfile.gateway"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_what_the_image_copies_is_in_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = [
        ins
        for ins in GATEWAY
        if ins.keyword == "COPY" and not any(f.startswith("--from=") for f in ins.flags)
    ]
    assert copies
    for ins in copies:
        for source in ins.values[:-1]:
            assert not _ignored(source.rstrip("/"), patterns), f"COPY {source} is excluded"
    assert not _ignored("common/llmendpoints_common/errors.py", patterns)
    assert _ignored("gateway/llmendpoints_gateway/__pycache__/app.cpython-311.pyc", patterns)

"""scripts/sync_crds.sh keeps the chart's CRDs (files/crds/) identical to crds/ (the source of truth)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from .helm_kit import ROOT


def _sync(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(tree / "scripts" / "sync_crds.sh")],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def test_sync_crds_copies_new_and_changed_crds_and_removes_stale_ones(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "sync_crds.sh", tmp_path / "scripts")
    (tmp_path / "crds").mkdir()
    (tmp_path / "crds" / "a.yaml").write_bytes(b"kind: CustomResourceDefinition\n# a\n")
    chart_crds = tmp_path / "charts" / "llmendpoints" / "files" / "crds"
    chart_crds.mkdir(parents=True)
    (chart_crds / "a.yaml").write_bytes(b"old\n")
    (chart_crds / "gone.yaml").write_bytes(b"stale\n")

    result = _sync(tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in chart_crds.iterdir()) == ["a.yaml"]
    assert (chart_crds / "a.yaml").read_bytes() == (tmp_path / "crds" / "a.yaml").read_bytes()
    assert _sync(tmp_path).stdout == "", "a second run has nothing to do"


def test_sync_crds_refuses_an_empty_source(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "sync_crds.sh", tmp_path / "scripts")
    (tmp_path / "crds").mkdir()
    result = _sync(tmp_path)
    assert result.returncode != 0
    assert "no CRD" in result.stderr


def _images(env: dict[str, str], path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "images.sh")],
        capture_output=True, text=True, timeout=30, check=False,
        env={"PATH": path, **env},
    )  # fmt: skip


def test_make_images_prints_the_commands_where_docker_is_absent() -> None:
    result = _images({"REGISTRY": "registry.example.com/llm", "TAG": "1.2.3"}, "/usr/bin:/bin")
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if line.startswith("docker ")]
    assert commands == [
        f"docker build -f Dockerfile.{i} -t registry.example.com/llm/{i}:1.2.3 ."
        for i in ("operator", "gateway", "runtime")
    ] + [
        f"docker push registry.example.com/llm/{i}:1.2.3"
        for i in ("operator", "gateway", "runtime")
    ]
    # Every Dockerfile it names exists; the default tag is the chart's appVersion.
    for image in ("operator", "gateway", "runtime"):
        assert (ROOT / f"Dockerfile.{image}").is_file()
    default = _images({}, "/usr/bin:/bin").stdout
    chart = yaml.safe_load((ROOT / "charts" / "llmendpoints" / "Chart.yaml").read_text())
    assert f"ghcr.io/llmendpoints/gateway:{chart['appVersion']} ." in default


def test_make_images_runs_them_where_docker_is(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f'#!/bin/sh\necho "$*" >> "{tmp_path}/ran"\n')
    (bin_dir / "docker").chmod(0o755)
    result = _images({"PUSH": "1"}, f"{bin_dir}:/usr/bin:/bin")
    assert result.returncode == 0, result.stderr
    ran = (tmp_path / "ran").read_text().splitlines()
    assert ran[0] == "info" and ran.count("info") >= 1
    builds = [line for line in ran if line.startswith("build ")]
    pushes = [line for line in ran if line.startswith("push ")]
    assert len(builds) == 3 and len(pushes) == 3

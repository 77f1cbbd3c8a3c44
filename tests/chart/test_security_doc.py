"""docs/security.md names the test that proves each defence: every test it names must exist, so
the table cannot claim a proof that was renamed or never written."""

from __future__ import annotations

import ast
import re

from .helm_kit import ROOT

DOC = ROOT / "docs" / "security.md"


def _cited() -> list[tuple[str, str | None]]:
    """(test file, test name or None) for every `tests/...py[::name]` and following `::name`."""
    cited: list[tuple[str, str | None]] = []
    for cell in re.findall(r"`([^`]+)`", DOC.read_text()):
        match = re.fullmatch(r"(tests/[\w/]+\.py)(?:::(\w+))?", cell)
        if match:
            current = match[1]
            cited.append((current, match[2]))
        elif re.fullmatch(r"::\w+", cell):
            cited.append((current, cell[2:]))
    return cited


def _tests_in(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    }


def test_every_test_the_threat_model_cites_exists() -> None:
    cited = _cited()
    assert len(cited) >= 20
    missing = [
        f"{path}::{name}" if name else path
        for path, name in cited
        if not (ROOT / path).is_file() or (name is not None and name not in _tests_in(path))
    ]
    assert missing == []


def test_every_actor_has_rows() -> None:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ")]
    for actor in ("anonymous peer", "key holder", "endpoint author", "cluster admin"):
        assert any(row.startswith(f"| {actor}") for row in rows), actor

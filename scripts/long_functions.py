"""Functions (and methods) of N lines or more in the product tree, longest first.

    .venv/bin/python scripts/long_functions.py            # 60+ lines, the project's bound
    .venv/bin/python scripts/long_functions.py --min 40 --count

A function's lines run from its ``def`` (decorators excluded) to its last line, docstring and
comments included: what a reader scrolls through. Nested functions count on their own and
inside their parent. The companion count for branching is ruff's
(``ruff check --select C901 --config 'lint.mccabe.max-complexity=10' <folders>``).
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("common", "edge", "gateway", "operator", "runtime")


def functions(path: Path) -> Iterator[tuple[str, int, int]]:
    """(qualified name, first line, length) of every function in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child.lineno, child.end_lineno - child.lineno + 1
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def long_functions(minimum: int, folders: tuple[str, ...] = PRODUCT) -> list[tuple[int, str]]:
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, line, length in functions(path):
                if length >= minimum:
                    found.append((length, f"{path.relative_to(ROOT)}:{line} {name}"))
    return sorted(found, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min", type=int, default=60, help="shortest length listed (lines)")
    parser.add_argument("--count", action="store_true", help="print the count only")
    parser.add_argument("folders", nargs="*", default=PRODUCT, help="folders under the repo")
    args = parser.parse_args()
    found = long_functions(args.min, tuple(args.folders))
    if not args.count:
        for length, where in found:
            print(f"{length:5d}  {where}")
    print(len(found))


if __name__ == "__main__":
    main()

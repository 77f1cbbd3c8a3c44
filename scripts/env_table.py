"""Print (or --write) the environment-variable tables of the three components.

Each table is generated from its settings class, the single source of truth (one renderer,
llmendpoints_common.settings_doc, so the same thing reads the same in all three):

    runtime   RuntimeSettings (+ vLLM's flags)  -> README.md          <!-- env-table:... -->
    operator  OperatorSettings                  -> docs/operator.md   <!-- operator-settings:... -->
    gateway   GatewaySettings                   -> docs/gateway.md    <!-- gateway-settings:... -->

tests/unit/runtime/test_env_table.py fails when a document and the code disagree:

    .venv/bin/python scripts/env_table.py --write           # all three
    .venv/bin/python scripts/env_table.py gateway           # print one
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from llmendpoints_common.settings_doc import markdown_table, setting_rows

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- env-table:start -->", "<!-- env-table:end -->"


def render() -> str:
    """The runtime's table (README.md)."""
    from llmendpoints_runtime.config import (
        COMMON_ENGINE_VARIABLES,
        RETIRED_VARIABLES,
        WORKER_VLLM_ALIASES,
        RuntimeSettings,
    )

    lines = [*_edge_rows(RuntimeSettings, "The runtime's own settings")]
    lines += [
        "",
        "#### worker-vllm names translated to vLLM flags",
        "",
        "| Variable | Meaning |",
        "| --- | --- |",
    ]
    for name, (_, description) in WORKER_VLLM_ALIASES.items():
        lines.append(f"| `{name}` | {description} |")
    lines += [
        "",
        "#### vLLM flags most often set (any `--flag` works as `FLAG`, and as `SM_VLLM_FLAG`)",
        "",
        "| Variable | Meaning |",
        "| --- | --- |",
    ]
    for name, description in COMMON_ENGINE_VARIABLES.items():
        lines.append(f"| `{name}` | {description} |")
    lines += [
        "",
        "#### worker-vllm variables vLLM 0.32 no longer has",
        "",
        "| Variable | At start-up | Why |",
        "| --- | --- | --- |",
    ]
    for name, (disposition, why) in RETIRED_VARIABLES.items():
        action = "ignored, with a warning" if disposition == "ignore" else "refused (exit 2)"
        lines.append(f"| `{name}` | {action} | {why} |")
    return "\n".join(lines) + "\n"


def render_operator() -> str:
    from llmendpoints_operator.config import OperatorSettings

    return markdown_table(setting_rows(OperatorSettings))


def render_gateway() -> str:
    from llmendpoints_gateway.config import GatewaySettings

    return "\n".join(_edge_rows(GatewaySettings, "The gateway's own settings")) + "\n"


def _edge_rows(model, own_title: str) -> list[str]:
    """The settings the runtime and the gateway share (the edge's: one name, one default, one
    meaning in both), then the component's own."""
    from llmendpoints_edge.settings import EdgeSettings

    shared = set(EdgeSettings.model_fields)
    rows = dict(zip(model.model_fields, setting_rows(model), strict=True))
    return [
        "#### Settings the runtime and the gateway share",
        "",
        "One name, one default and one meaning in both front doors "
        "(`llmendpoints_edge.settings.EdgeSettings`); only `PORT`'s default differs (the runtime "
        "listens on 8000, the gateway on 8080).",
        "",
        markdown_table(row for name, row in rows.items() if name in shared).rstrip("\n"),
        "",
        f"#### {own_title}",
        "",
        markdown_table(row for name, row in rows.items() if name not in shared).rstrip("\n"),
    ]


# name -> (document, start marker, end marker, renderer)
TABLES: dict[str, tuple[Path, str, str, Callable[[], str]]] = {
    "runtime": (README, START, END, render),
    "operator": (
        ROOT / "docs" / "operator.md",
        "<!-- operator-settings:start -->",
        "<!-- operator-settings:end -->",
        render_operator,
    ),
    "gateway": (
        ROOT / "docs" / "gateway.md",
        "<!-- gateway-settings:start -->",
        "<!-- gateway-settings:end -->",
        render_gateway,
    ),
}


def current_table(name: str) -> str | None:
    path, start, end, _ = TABLES[name]
    text = path.read_text()
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def current_readme_table() -> str | None:
    return current_table("runtime")


def write(name: str = "runtime") -> None:
    path, start, end, renderer = TABLES[name]
    text = path.read_text()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{renderer()}{end}{tail}")


if __name__ == "__main__":
    names = [a for a in sys.argv[1:] if not a.startswith("-")] or list(TABLES)
    for name in names:
        if "--write" in sys.argv:
            write(name)
        else:
            sys.stdout.write(TABLES[name][3]())

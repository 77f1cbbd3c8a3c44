"""Print (or --write into README.md) the runtime's environment-variable reference.

The table is generated from runtime/llmendpoints_runtime/config.py, the single source of truth;
tests/unit/test_env_table.py fails when README.md and the code disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmendpoints_edge.settings import EdgeSettings
from llmendpoints_runtime.config import (
    COMMON_ENGINE_VARIABLES,
    RETIRED_VARIABLES,
    WORKER_VLLM_ALIASES,
    RuntimeSettings,
)

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- env-table:start -->", "<!-- env-table:end -->"


def _default(info) -> str:
    if info.default is None:
        return "—"
    return f"`{info.default}`"


def render() -> str:
    shared = EdgeSettings.model_fields
    lines = [
        "#### Settings the runtime shares with the gateway",
        "",
        "One name, one default and one meaning in both front doors (`llmendpoints_edge.settings."
        "EdgeSettings`); only `PORT`'s default differs (the gateway listens on 8080).",
        "",
        "| Variable | Default | Meaning |",
        "| --- | --- | --- |",
    ]
    for name, info in shared.items():
        info = RuntimeSettings.model_fields[name]
        lines.append(f"| `{info.validation_alias}` | {_default(info)} | {info.description} |")
    lines += [
        "",
        "#### The runtime's own settings",
        "",
        "| Variable | Default | Meaning |",
        "| --- | --- | --- |",
    ]
    for name, info in RuntimeSettings.model_fields.items():
        if name in shared:
            continue
        lines.append(f"| `{info.validation_alias}` | {_default(info)} | {info.description} |")
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


def current_readme_table() -> str | None:
    text = README.read_text()
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write() -> None:
    text = README.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{render()}{END}{tail}")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
    else:
        sys.stdout.write(render())

"""Settings classes as documentation: one row per environment variable, for the generated tables
(scripts/env_table.py writes README.md, docs/operator.md and docs/gateway.md from them; tests
fail when a table and its class differ) and for each CLI's `serve --help` / `run --help`.

One renderer for the three components, so the same thing reads the same everywhere: the variable
as the process reads it, its default as the code has it (`—`: unset), the field's description.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable
from typing import Any

from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

UNSET = "—"
COMPUTED = "computed at start"


def variable_name(model: type[BaseSettings], field_name: str) -> str:
    info = model.model_fields[field_name]
    if isinstance(info.validation_alias, str):
        return info.validation_alias
    return f"{model.model_config.get('env_prefix') or ''}{field_name}".upper()


def _default_text(info: Any) -> str:
    if info.default_factory is not None:
        try:
            value = info.default_factory()
        except Exception:  # a factory that needs the running process
            return COMPUTED
        # A factory that computes from the machine (a host name) has no one default to show.
        if getattr(info.default_factory, "__name__", "") == "<lambda>":
            return COMPUTED
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if value is None:
        return UNSET
    if isinstance(value, bool):  # as one writes it in the environment
        return "`true`" if value else "`false`"
    if isinstance(value, dict | list):
        return f"`{json.dumps(value)}`"
    if hasattr(value, "get_secret_value"):
        return "(secret)"
    if value == "":
        return '`""`'
    return f"`{value.value if hasattr(value, 'value') else value}`"


def setting_rows(model: type[BaseSettings]) -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every field, in the class's order."""
    return [
        (variable_name(model, name), _default_text(info), info.description or "")
        for name, info in model.model_fields.items()
    ]


def markdown_table(rows: Iterable[tuple[str, str, str]]) -> str:
    lines = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {default} | {meaning} |" for name, default, meaning in rows]
    return "\n".join(lines) + "\n"


def help_text(rows: Iterable[tuple[str, str, str]], width: int = 100) -> str:
    """The same rows for a terminal: a variable and its default, its meaning indented below."""
    out: list[str] = []
    for name, default, meaning in rows:
        out.append(f"  {name} (default: {default.strip('`')})")
        out += textwrap.wrap(meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out)

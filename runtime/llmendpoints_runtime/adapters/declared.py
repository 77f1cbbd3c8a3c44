"""The adapters an endpoint declares, as the runtime reads them from LLMEP_ADAPTERS_FILE (pure).

The operator writes ``spec.adapters`` into a ConfigMap the pods mount; the file is JSON::

    {"adapters": [{"name": "sql", "source": "org/sql-lora", "revision": "main"},
                  {"name": "legal", "source": "/models/adapters/legal"}]}

``source`` is a Hugging Face repository id, or an absolute path (in the model cache or the image).
A malformed file is an error naming the entry and the field; the caller keeps the last good list.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# The CRD's rule too: adapter names become `model` values and label values.
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LENGTH = 63


class AdapterFileError(ValueError):
    """The adapters file cannot be used; the message names the entry and field."""


@dataclass(frozen=True)
class DeclaredAdapter:
    name: str
    source: str
    revision: str | None = None

    @property
    def is_local(self) -> bool:
        return self.source.startswith("/")

    def describe(self) -> str:
        if self.is_local:
            return self.source
        return f"{self.source}@{self.revision}" if self.revision else self.source


def parse_adapters(text: str) -> tuple[DeclaredAdapter, ...]:
    """The declared adapters, in file order; AdapterFileError for anything unusable."""
    try:
        document = json.loads(text) if text.strip() else {"adapters": []}
    except json.JSONDecodeError as exc:
        raise AdapterFileError(f"not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(document, dict) or not isinstance(document.get("adapters"), list):
        raise AdapterFileError('expected {"adapters": [{"name": ..., "source": ...}, ...]}')
    adapters: list[DeclaredAdapter] = []
    seen: set[str] = set()
    for index, entry in enumerate(document["adapters"]):
        where = f"adapters[{index}]"
        if not isinstance(entry, dict):
            raise AdapterFileError(f"{where}: must be an object with name and source")
        unknown = set(entry) - {"name", "source", "revision", "rank"}
        if unknown:
            raise AdapterFileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        name, source, revision = entry.get("name"), entry.get("source"), entry.get("revision")
        if not isinstance(name, str) or not NAME.match(name) or len(name) > MAX_NAME_LENGTH:
            raise AdapterFileError(
                f"{where}.name: {name!r} must be a lowercase DNS label of at most "
                f"{MAX_NAME_LENGTH} characters"
            )
        if name in seen:
            raise AdapterFileError(f"{where}.name: {name!r} is declared twice")
        seen.add(name)
        if not isinstance(source, str) or not source.strip():
            raise AdapterFileError(f"{where}.source: must be a Hugging Face repo id or a path")
        if revision is not None and (not isinstance(revision, str) or not revision.strip()):
            raise AdapterFileError(f"{where}.revision: must be a non-empty string")
        adapters.append(DeclaredAdapter(name=name, source=source.strip(), revision=revision))
    return tuple(adapters)


def retry_delay(failures: int, *, first: float = 5.0, cap: float = 300.0) -> float:
    """Seconds before another attempt after ``failures`` consecutive failures (pure)."""
    return min(cap, first * 2 ** max(0, failures - 1))

"""The gateway's routes as data: method + path pattern -> handler, in one place (pure).

As KubeAI's mux and Starlette's routes say it: a table, read top to bottom, the first route
whose pattern and method match answers. A pattern is a path with parameters: ``{name}`` is one
path segment, ``{name:path}`` the rest of the path (possibly empty). A route also says what a
request must show before its handler runs (``Guard``): nothing (probes), a key, or a key that
may use the endpoint the path names.

No I/O here; app.py builds the table with its handlers and does what the guards say.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Call = TypeVar("Call")

_PARAM = re.compile(r"\{([a-z_]+)(?::(path))?\}")


class Guard(enum.Enum):
    PUBLIC = "public"  # answered to anyone (probes)
    KEY = "key"  # the caller's key is checked first (from the headers alone)
    ENDPOINT = "endpoint"  # and it must be allowed the endpoint named in the path


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``/v2/{endpoint}/{rest:path}`` -> a regex with named groups (pure)."""
    out, at = ["^"], 0
    for match in _PARAM.finditer(pattern):
        out.append(re.escape(pattern[at : match.start()]))
        out.append(f"(?P<{match[1]}>.*)" if match[2] else f"(?P<{match[1]}>[^/]+)")
        at = match.end()
    out.append(re.escape(pattern[at:]) + "$")
    return re.compile("".join(out))


@dataclass(frozen=True)
class Route(Generic[Call]):
    pattern: str
    handler: Callable[[Call], Awaitable[None]]
    methods: frozenset[str] | None = None  # None: every method
    guard: Guard = Guard.KEY
    regex: re.Pattern[str] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", compile_pattern(self.pattern))

    def match(self, method: str, path: str) -> Mapping[str, str] | None:
        if self.methods is not None and method not in self.methods:
            return None
        found = self.regex.match(path)
        return found.groupdict() if found else None


class RouteTable(Generic[Call]):
    def __init__(self, routes: Iterable[Route[Call]]) -> None:
        self.routes = tuple(routes)

    def match(self, method: str, path: str) -> tuple[Route[Call], Mapping[str, str]] | None:
        """The first route that takes ``method`` on ``path``, and the path's parameters."""
        for route in self.routes:
            params = route.match(method, path)
            if params is not None:
                return route, params
        return None

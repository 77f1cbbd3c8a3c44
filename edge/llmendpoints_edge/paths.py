"""One reading of a request's path, decided once at the edge and used for everything after it:
authorisation, routing, metering, and what is forwarded upstream.

uvicorn hands the application a percent-decoded path (``/v1/%2e%2e/run`` arrives as
``/v1/../run``) and leaves dot segments and empty segments alone; an HTTP client or a router
further on may resolve them (aiohttp does, so does yarl). A front door that decides on one
reading and forwards another can be walked around: ``/v1/../run`` looks like an OpenAI route
and reaches ``/run``. So the path is normalised here -- RFC 3986's remove_dot_segments, empty
segments collapsed, never above the root -- and the normalised path replaces the original in
the request's scope.
"""

from __future__ import annotations

from urllib.parse import quote

from llmendpoints_edge.asgi import Scope


def normalize(path: str) -> str:
    """``path`` without ``.`` / ``..`` / empty segments, rooted, trailing slash kept (pure)."""
    if path.startswith("/") and "//" not in path and "/." not in path:
        # Already normal (the usual case, checked without splitting): an empty segment needs
        # "//", a dot segment "/.", and a single trailing slash is kept anyway.
        return path
    if not path.startswith("/"):
        path = "/" + path
    segments: list[str] = []
    parts = path.split("/")[1:]
    for part in parts:
        if part in ("", "."):
            continue
        if part == "..":
            if segments:
                segments.pop()
            continue
        segments.append(part)
    trailing = parts[-1] in ("", ".", "..") and bool(segments)
    return "/" + "/".join(segments) + ("/" if trailing else "")


def normalize_scope(scope: Scope) -> bool:
    """Replace the scope's path (and raw_path) by its normal form; True if it changed."""
    path = scope["path"]
    normal = normalize(path)
    if normal == path:
        return False
    scope["path"] = normal
    scope["raw_path"] = encode(normal).encode("ascii")
    return True


def encode(path: str) -> str:
    """A normalised path as it goes on the wire (percent-encoded; '/' kept). Nothing in it is
    left for a client library to re-interpret: no dot segments, no encoded slash."""
    return quote(path, safe="/:@!$&'()*+,;=-._~")

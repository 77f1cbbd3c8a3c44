"""Which client-chosen request ids are kept.

An X-Request-Id goes into log lines, vLLM's request ids and the response, so only what cannot
forge or break a line is kept (no spaces, quotes, brackets, CR/LF); anything else is replaced
by a fresh id. The runtime and the gateway apply the same rule.
"""

from __future__ import annotations

import re

_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def valid_request_id(value: str | bytes | None) -> bool:
    """Whether a client's X-Request-Id is kept (pure)."""
    if value is None:
        return False
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return _VALID.fullmatch(value) is not None

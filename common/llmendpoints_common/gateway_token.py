"""The credential the gateway presents to an endpoint's pods (never a client's key).

Derived per endpoint from one secret that the gateway and the operator both hold: the operator
writes each endpoint's token into a Secret mounted into that endpoint's pods only
(``GATEWAY_TOKEN_FILE``), the gateway computes the same token when it forwards. A pod -- which
runs the endpoint author's image -- learns its own endpoint's token and nothing that opens any
other endpoint. The runtime believes the gateway's ``x-llmep-caller`` header only from a
request that carries its token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

CALLER_HEADER = "x-llmep-caller"
_CONTEXT = b"llmendpoints gateway token v1\0"


def derive(secret: bytes, endpoint: str) -> str:
    """The gateway token of ``endpoint`` (its id, ``namespace/name``) under ``secret`` (pure)."""
    digest = hmac.new(secret, _CONTEXT + endpoint.encode(), hashlib.sha256).digest()
    return "llmep-gw-" + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def read_secret(path: str) -> bytes:
    """The secret as stored in its file (a mounted Secret): surrounding whitespace is not part
    of it; an empty file is an error, not a secret."""
    with open(path, "rb") as handle:
        secret = handle.read().strip()
    if len(secret) < 16:
        raise ValueError(f"{path}: the gateway token secret must be at least 16 bytes")
    return secret

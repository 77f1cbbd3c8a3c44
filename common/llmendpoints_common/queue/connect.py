"""The one way every process connects to the queue's NATS.

Two kinds of credential:

- a creds file (``JOBS_QUEUE_CREDS_FILE``): a NATS user JWT and its nkey seed, minted per role
  and per endpoint (queue/roles.py); the URL carries no secret. The reply inbox is the one the
  credential may subscribe to, read from its JWT, so the client's replies arrive where its
  permissions let them.
- a password in the URL (``nats://user:password@host:4222``), for a NATS you bring yourself.
  Weaker: one user's permissions are whatever that NATS gives it, usually the same for every
  pod, the gateway and the operator (docs/security.md).

nats-py reads a creds file at every (re)connect, so a rotated file is used from the next one.

``settle(nc)`` is the barrier ``nc.flush()`` is documented to be and, in nats-py, is not
(docs/contracts.md, "When a subscription starts").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.client import RawCredentials

from llmendpoints_common.queue import natsjwt
from llmendpoints_common.queue.roles import ADMIN_INBOX

log = logging.getLogger(__name__)


def permissions_of(creds_text: str) -> natsjwt.Permissions:
    """What a creds file's user may publish and subscribe to (from its JWT)."""
    token, _ = natsjwt.parse_creds(creds_text)
    return natsjwt.Permissions.from_claims(natsjwt.decode(token))


def limits_of(
    creds_file: str | Path | None = None, *, creds: str | None = None
) -> natsjwt.UserLimits:
    """The bounds a creds file's user JWT carries (none for a password user)."""
    text = read_creds(creds_file) if creds_file is not None else creds
    if text is None:
        return natsjwt.UserLimits()
    token, _ = natsjwt.parse_creds(text)
    return natsjwt.UserLimits.from_claims(natsjwt.decode(token))


def inbox_of(permissions: natsjwt.Permissions) -> str:
    """The reply inbox prefix a user may subscribe to (``_INBOX`` when any)."""
    for subject in permissions.sub_allow:
        if subject.startswith("_INBOX.") and subject.endswith(".>"):
            return subject[: -len(".>")]
    return ADMIN_INBOX


def read_creds(creds_file: str | Path) -> str:
    try:
        text = Path(creds_file).read_text()
    except OSError as exc:
        raise natsjwt.CredentialsError(
            f"JOBS_QUEUE_CREDS_FILE: cannot read {str(creds_file)!r}: {exc.strerror}"
        ) from None
    try:
        permissions_of(text)
    except natsjwt.CredentialsError as exc:
        raise natsjwt.CredentialsError(
            f"JOBS_QUEUE_CREDS_FILE {str(creds_file)!r}: {exc}"
        ) from None
    return text


def credential_options(
    creds_file: str | Path | None = None, *, creds: str | None = None
) -> tuple[dict[str, Any], natsjwt.Permissions | None]:
    """nats-py connect options for a creds file (a path) or creds text, and what the
    credential permits; ({}, None) for neither (a password in the URL: permissions unknown)."""
    if creds_file is not None:
        permissions = permissions_of(read_creds(creds_file))
        # The path, not the text: nats-py reads it again at each reconnect (rotation).
        options: dict[str, Any] = {"user_credentials": str(creds_file)}
    elif creds is not None:
        permissions = permissions_of(creds)
        options = {"user_credentials": RawCredentials(creds)}
    else:
        return {}, None
    options["inbox_prefix"] = inbox_of(permissions)
    return options, permissions


async def settle(nc: NATS, timeout: float = 10.0) -> None:
    """Return once the server has processed every command ``nc`` sent before this call: a
    subscription made before it receives whatever anyone publishes after it.

    ``nc.flush()`` alone does not promise that in nats-py (2.16, and its main branch): it writes
    its PING straight to the socket while the commands before it (a SUB, say) still wait in
    the client's own buffer for its flusher task, so the PONG can come back before the server
    has read the SUB. Here the buffer goes out first, then the PING follows it."""
    # nats-py has no public call for "write what is buffered"; this is the one its own
    # publish uses when the buffer is full (tests/queue/test_settle.py pins the wire order).
    async with asyncio.timeout(timeout):
        await nc._flush_pending(force_flush=True)
        await nc.flush(timeout=timeout)


async def _log_error(exc: Exception) -> None:
    log.warning("job queue connection: %s: %s", type(exc).__name__, exc)


def _log_event(text: str) -> Callable[[], Awaitable[None]]:
    async def callback() -> None:
        log.warning(text)

    return callback


async def connect(
    url: str,
    *,
    name: str,
    creds_file: str | Path | None = None,
    creds: str | None = None,
    connect_timeout: float = 5.0,
    reconnect: bool = True,
    **options: Any,
) -> tuple[NATS, natsjwt.Permissions | None]:
    """A NATS connection that reconnects forever (unless ``reconnect`` is False), with the
    credential given (a creds file's path, or creds text; or the URL's own password), and what
    that credential permits (None: unknown, a password user)."""
    credential, permissions = credential_options(creds_file, creds=creds)
    defaults: dict[str, Any] = {
        "name": name,
        "connect_timeout": connect_timeout,
        "error_cb": _log_error,
    }
    if reconnect:
        defaults.update(
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            allow_reconnect=True,
            disconnected_cb=_log_event("disconnected from the job queue"),
            reconnected_cb=_log_event("reconnected to the job queue"),
        )
    else:
        defaults.update(allow_reconnect=False, max_reconnect_attempts=0)
    nc = await nats.connect(url, **{**defaults, **credential, **options})
    return nc, permissions

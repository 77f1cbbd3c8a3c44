"""Contents in JetStream's object store (bucket ``LLMEP_FILES``), every object with its expiry.

The layout is NATS's own (ADR-20, what ``nats object`` and nats-py's ``ObjectStore`` read):
the stream ``OBJ_LLMEP_FILES``, an object's chunks on ``$O.LLMEP_FILES.C.<nuid>`` and its
description on ``$O.LLMEP_FILES.M.<base64url(name)>`` (rolled up: one per name). What is ours:

- every chunk and description carries a message TTL (``Nats-TTL``): an object disappears on its
  own when it expires, with no sweeper (the stream's ``max_age`` is the backstop);
- an object is removed by roll-up markers (an empty message with ``Nats-Rollup: sub``, itself
  expiring) on its chunks' subject and its description's, never by a stream purge: a purge
  request names its subject only in its body, and no role but admin may purge
  (queue/roles.py);
- reads are direct gets, the subject in the request (no consumer to create): the description,
  then each chunk in turn (``next_by_subj``), checked against the SHA-256 digest.
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime
from typing import IO

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

FILES_BUCKET = "LLMEP_FILES"
FILES_STREAM = f"OBJ_{FILES_BUCKET}"
CHUNK_BYTES = 128 * 1024
_DIGEST = "SHA-256="
_ROLLUP = {"Nats-Rollup": "sub"}
_MARKER_TTL_SECONDS = 60


class ObjectCorrupt(Exception):
    """An object's chunks do not match its description (missing, or another digest)."""


def meta_subject(name: str) -> str:
    return f"$O.{FILES_BUCKET}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def chunk_subject(nuid: str) -> str:
    return f"$O.{FILES_BUCKET}.C.{nuid}"


def _ttl(seconds: float) -> int:
    return max(1, round(seconds))


async def put_object(
    js: JetStreamContext, name: str, source: IO[bytes], *, nuid: str, ttl_seconds: float
) -> int:
    """Store ``source`` (read to its end) as object ``name`` for ``ttl_seconds``; its size.
    ``nuid``: a fresh unique token (the chunks' subject). An object of the same name is
    replaced (its old chunks removed)."""
    old = await object_info(js, name)
    subject = chunk_subject(nuid)
    digest = hashlib.sha256()
    size = chunks = 0
    ttl = _ttl(ttl_seconds)
    try:
        while data := source.read(CHUNK_BYTES):
            digest.update(data)
            await js.publish(subject, data, msg_ttl=ttl)
            size += len(data)
            chunks += 1
        info = {
            "name": name,
            "bucket": FILES_BUCKET,
            "nuid": nuid,
            "size": size,
            "chunks": chunks,
            "mtime": datetime.now(UTC).isoformat(),
            "digest": _DIGEST + base64.urlsafe_b64encode(digest.digest()).decode(),
            "options": {"max_chunk_size": CHUNK_BYTES},
        }
        await js.publish(
            meta_subject(name), json.dumps(info).encode(), headers=_ROLLUP, msg_ttl=ttl
        )
    except BaseException:
        await _drop(js, subject)
        raise
    if old is not None and old.get("nuid") and old["nuid"] != nuid:
        await _drop(js, chunk_subject(old["nuid"]))
    return size


async def object_info(js: JetStreamContext, name: str) -> dict | None:
    """An object's description (None: no such object, or removed)."""
    try:
        raw = await js.get_msg(FILES_STREAM, subject=meta_subject(name), direct=True)
    except NotFoundError:
        return None
    if not raw.data:
        return None
    info = json.loads(raw.data)
    return None if info.get("deleted") else info


async def read_object(js: JetStreamContext, name: str, sink: IO[bytes]) -> bool:
    """Write object ``name`` into ``sink``; False when there is no such object."""
    info = await object_info(js, name)
    if info is None:
        return False
    subject = chunk_subject(info["nuid"])
    digest = hashlib.sha256()
    seq = 0
    for _ in range(int(info.get("chunks") or 0)):
        try:
            raw = await js.get_msg(
                FILES_STREAM, seq=seq + 1, subject=subject, direct=True, next=True
            )
        except NotFoundError:
            raise ObjectCorrupt(f"object {name}: a chunk is missing") from None
        seq = raw.seq
        data = raw.data or b""
        digest.update(data)
        sink.write(data)
    expected = str(info.get("digest") or "").removeprefix(_DIGEST)
    if base64.urlsafe_b64encode(digest.digest()).decode() != expected:
        raise ObjectCorrupt(f"object {name}: its content does not match its digest")
    return True


async def delete_object(js: JetStreamContext, name: str) -> bool:
    """Remove object ``name`` (its chunks and its description); False when there was none."""
    info = await object_info(js, name)
    if info is None:
        return False
    await _drop(js, chunk_subject(info["nuid"]))
    gone = {**info, "deleted": True, "size": 0, "chunks": 0, "digest": ""}
    await js.publish(
        meta_subject(name), json.dumps(gone).encode(), headers=_ROLLUP, msg_ttl=_MARKER_TTL_SECONDS
    )
    return True


async def _drop(js: JetStreamContext, subject: str) -> None:
    """Roll up every message on ``subject`` into one empty marker that expires itself."""
    await js.publish(subject, b"", headers=_ROLLUP, msg_ttl=_MARKER_TTL_SECONDS)

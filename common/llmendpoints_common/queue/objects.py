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
  then each chunk in turn (``next_by_subj``), checked against the SHA-256 digest;
- both ways stream: a writer publishes each chunk as it fills (awaiting its acknowledgement), a
  reader gets each chunk when its caller asks for the next, so an upload or a download holds
  one chunk, not the object.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

FILES_BUCKET = "LLMEP_FILES"
FILES_STREAM = f"OBJ_{FILES_BUCKET}"
CHUNK_BYTES = 128 * 1024
_DIGEST = "SHA-256="
_ROLLUP = {"Nats-Rollup": "sub"}
_MARKER_TTL_SECONDS = 60
# An object is written over seconds to minutes (an upload, a batch's output): its chunks expire
# this much after its description, so none goes before the object does.
_CHUNK_SLACK_SECONDS = 3600


class ObjectCorrupt(Exception):
    """An object's chunks do not match its description (missing, or another digest)."""


def meta_subject(name: str) -> str:
    return f"$O.{FILES_BUCKET}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def chunk_subject(nuid: str) -> str:
    return f"$O.{FILES_BUCKET}.C.{nuid}"


def _ttl(seconds: float) -> int:
    return max(1, round(seconds))


class ObjectWriter:
    """An object written as its bytes arrive: every ``CHUNK_BYTES`` a chunk is published (and
    its acknowledgement awaited: the writer goes as fast as the store takes it, holding at most
    one chunk); ``close`` publishes the description, which makes the object exist for
    ``ttl_seconds`` from then. ``abort`` (or an error) rolls its chunks up: nothing of it is
    kept. An object of the same name is replaced (its old chunks removed) when the new one is
    closed."""

    def __init__(self, js: JetStreamContext, name: str, *, nuid: str, ttl_seconds: float):
        self.js = js
        self.name = name
        self.nuid = nuid
        self.ttl = _ttl(ttl_seconds)
        self.size = 0  # bytes written so far
        self._chunks = 0
        self._digest = hashlib.sha256()
        self._pending = bytearray()
        self._published = False

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        self._pending += data
        while len(self._pending) >= CHUNK_BYTES:
            piece = bytes(self._pending[:CHUNK_BYTES])
            del self._pending[:CHUNK_BYTES]
            await self._publish(piece)

    async def _publish(self, piece: bytes) -> None:
        self._published = True
        try:
            await self.js.publish(
                chunk_subject(self.nuid), piece, msg_ttl=self.ttl + _CHUNK_SLACK_SECONDS
            )
        except BaseException:
            await self.abort()
            raise
        self._digest.update(piece)
        self._chunks += 1

    async def close(self) -> int:
        """The object's size, once it exists."""
        if self._pending:
            piece, self._pending = bytes(self._pending), bytearray()
            await self._publish(piece)
        old = await object_info(self.js, self.name)
        info = {
            "name": self.name,
            "bucket": FILES_BUCKET,
            "nuid": self.nuid,
            "size": self.size,
            "chunks": self._chunks,
            "mtime": datetime.now(UTC).isoformat(),
            "digest": _DIGEST + base64.urlsafe_b64encode(self._digest.digest()).decode(),
            "options": {"max_chunk_size": CHUNK_BYTES},
        }
        try:
            await self.js.publish(
                meta_subject(self.name),
                json.dumps(info).encode(),
                headers=_ROLLUP,
                msg_ttl=self.ttl,
            )
        except BaseException:
            await self.abort()
            raise
        if old is not None and old.get("nuid") and old["nuid"] != self.nuid:
            await _drop(self.js, chunk_subject(old["nuid"]))
        return self.size

    async def abort(self) -> None:
        self._pending = bytearray()
        if self._published:
            self._published = False
            await _drop(self.js, chunk_subject(self.nuid))


async def put_object(
    js: JetStreamContext, name: str, data: bytes, *, nuid: str, ttl_seconds: float
) -> int:
    """Store ``data`` as object ``name`` for ``ttl_seconds``; its size. ``nuid``: a fresh unique
    token (the chunks' subject)."""
    writer = ObjectWriter(js, name, nuid=nuid, ttl_seconds=ttl_seconds)
    await writer.write(data)
    return await writer.close()


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


async def read_chunks(js: JetStreamContext, info: dict) -> AsyncIterator[bytes]:
    """An object's chunks, each read when the caller asks for it (a direct get: no consumer),
    checked against its digest at the end (ObjectCorrupt: the bytes already given were not
    the object's)."""
    name, subject = info.get("name"), chunk_subject(info["nuid"])
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
        yield data
    expected = str(info.get("digest") or "").removeprefix(_DIGEST)
    if base64.urlsafe_b64encode(digest.digest()).decode() != expected:
        raise ObjectCorrupt(f"object {name}: its content does not match its digest")


async def read_object(js: JetStreamContext, name: str) -> bytes | None:
    """Object ``name`` whole (a batch's part: bounded); None when there is no such object."""
    info = await object_info(js, name)
    if info is None:
        return None
    return b"".join([chunk async for chunk in read_chunks(js, info)])


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

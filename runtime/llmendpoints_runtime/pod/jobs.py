"""The in-pod job API across a pod's API processes (API_SERVER_COUNT > 1, no JOBS_QUEUE_URL).

A job lives in the process that accepted it -- its record, its stream, its engine requests --
so the work of the jobs is spread over the processes like the OpenAI requests'. Its id says
which process that is (``<uuid>-p<index>``); a verb about it that reaches another process (a
client's next connection lands anywhere) is passed to the owner as the ``JobCall`` the route
made, over a Unix socket private to the pod, and the owner's ``JobReply`` is the answer. The
caller was authenticated by the process it reached; the owner checks ownership as always.

- ``/run`` with an Idempotency-Key goes to the process the key hashes to, so a repeat finds
  the first job whichever process it reaches.
- ``/purge-queue`` purges in every process (the counts add up); RunPod's ``/health`` adds up
  every process's job counts.

Frames: one JSON object per line each way.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmendpoints_common.errors import ServiceUnavailableError, job_error_body
from llmendpoints_common.jobs.api import JobCall, JobReply, JobVerbs

logger = logging.getLogger("llmendpoints.pod.jobs")

EVERY = -1  # route(): ask every process
_OWNER = re.compile(r"-p(\d{1,3})$")
STREAM_LIMIT = 512 * 1024 * 1024  # a /status with a large output, a /run with a large input
CALL_TIMEOUT_SECONDS = 330.0  # longer than the longest /runsync wait (which is never passed on)


def job_id_suffix(index: int) -> str:
    return f"-p{index}"


def route(call: JobCall, index: int, count: int) -> int:
    """The process that answers ``call`` (its index, or EVERY), seen from process ``index``
    (pure)."""
    if call.job_id is not None:
        match = _OWNER.search(call.job_id)
        owner = int(match.group(1)) if match else index
        return owner if owner < count else index  # not ours: the local 404
    if call.verb in ("purge-queue", "health"):
        return EVERY
    if call.verb == "run" and call.idempotency_key is not None:
        digest = hashlib.sha256(f"{call.caller}\0{call.idempotency_key}".encode()).digest()
        return int.from_bytes(digest[:4], "big") % count
    return index


def merge(verb: str, replies: list[JobReply]) -> JobReply:
    """Every process's answer to ``verb`` as one (pure): the first error, else the sums."""
    for reply in replies:
        if reply.status != 200:
            return reply
    first = dict(replies[0].body)
    if verb == "purge-queue":
        first["removed"] = sum(int(r.body.get("removed", 0)) for r in replies)
        return JobReply(200, first)
    jobs: dict[str, int] = {}
    for reply in replies:
        for name, value in (reply.body.get("jobs") or {}).items():
            jobs[name] = jobs.get(name, 0) + int(value)
    first["jobs"] = jobs
    return JobReply(200, first)


def encode_call(call: JobCall) -> bytes:
    payload = {
        "method": call.method,
        "verb": call.verb,
        "caller": call.caller,
        "admin": call.admin,
        "job_id": call.job_id,
        "query": dict(call.query),
        "body": base64.b64encode(call.body).decode("ascii"),
        "idempotency_key": call.idempotency_key,
    }
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"


def decode_call(line: bytes) -> JobCall:
    raw = json.loads(line)
    return JobCall(
        method=raw["method"],
        verb=raw["verb"],
        caller=raw["caller"],
        admin=bool(raw["admin"]),
        job_id=raw["job_id"],
        query=raw["query"],
        body=base64.b64decode(raw["body"]),
        idempotency_key=raw["idempotency_key"],
    )


def encode_reply(reply: JobReply) -> bytes:
    payload = {"status": reply.status, "body": reply.body, "headers": dict(reply.headers)}
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"


def decode_reply(line: bytes) -> JobReply:
    raw: Mapping[str, Any] = json.loads(line)
    return JobReply(int(raw["status"]), raw["body"], raw["headers"])


def socket_path(directory: Path, index: int) -> Path:
    return directory / f"jobs-{index}.sock"


class PeerJobs:
    """The job verbs of process ``index`` of ``count``: its own (``local``), and the others'
    through their sockets in ``directory``. What the job routes call (``handle``)."""

    def __init__(self, local: JobVerbs, index: int, count: int, directory: Path) -> None:
        self.local = local
        self.index = index
        self.count = count
        self.directory = directory

    async def handle(self, call: JobCall) -> JobReply:
        target = route(call, self.index, self.count)
        if target == self.index:
            return await self.local.handle(call)
        if target != EVERY:
            return await self._ask(target, call)
        replies = await asyncio.gather(
            *(
                self.local.handle(call) if i == self.index else self._ask(i, call)
                for i in range(self.count)
            )
        )
        return merge(call.verb, list(replies))

    async def _ask(self, target: int, call: JobCall) -> JobReply:
        path = socket_path(self.directory, target)
        try:
            async with asyncio.timeout(CALL_TIMEOUT_SECONDS):
                reader, writer = await asyncio.open_unix_connection(path, limit=STREAM_LIMIT)
                try:
                    writer.write(encode_call(call))
                    await writer.drain()
                    line = await reader.readline()
                finally:
                    writer.close()
            if not line:
                raise ConnectionError("closed without an answer")
            return decode_reply(line)
        except (OSError, TimeoutError, ValueError, KeyError) as exc:
            logger.warning("job call to API process %d failed: %s", target, exc)
            error = ServiceUnavailableError(
                f"the API process holding this job does not answer ({exc}); retry shortly",
                headers={"retry-after": "1"},
            )
            return JobReply(503, job_error_body(error, job_id=call.job_id), dict(error.headers))

    async def serve(self) -> None:
        """Answer the other processes' calls until cancelled (the runtime's ``on_serving``)."""
        path = socket_path(self.directory, self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = await asyncio.start_unix_server(self._answer, path, limit=STREAM_LIMIT)
        try:
            async with server:
                await server.serve_forever()
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if line:
                reply = await self.local.handle(decode_call(line))
                writer.write(encode_reply(reply))
                await writer.drain()
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("a job call from another API process failed: %s", exc)
        finally:
            writer.close()

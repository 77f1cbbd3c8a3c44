"""Usage metering per key, endpoint and model, from the usage the engine reports.

- Non-streamed answers: the ``usage`` object of the JSON body (``prompt_tokens`` /
  ``completion_tokens``; ``input_tokens`` / ``output_tokens`` for /v1/responses).
- Streams: the gateway asks the replica for usage (``stream_options.include_usage``) on
  /v1/chat/completions and /v1/completions and reads the final usage chunk (``choices: []``);
  when the client did not ask for it, that chunk is taken out of the client's stream, so the
  client sees what it would have seen without the gateway. /v1/responses streams carry usage in
  their ``response.completed`` event anyway.
- Jobs: a request when accepted; the usage of the job's output (``usage.input`` /
  ``usage.output`` of its last batch, or an OpenAI route's ``usage``) when it completes, read by
  jobs.JobUsageMeter from the job records whoever ran it and however its result is fetched.

A request that failed before the engine produced anything has no usage: it counts as a request
(with its status) and zero tokens. Records go to the JetStream stream ``LLMEP_USAGE`` with the
record's id as the message id (unique per answer; a job's own id for its records), so a record
published twice (a publish retried after a lost acknowledgement, a job's result read through two
replicas) is stored once.

Pure parts first (scanner, extraction, aggregation); the NATS publisher and reader at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("llmendpoints.gateway.metering")

# Routes whose streams take stream_options.include_usage (vLLM's OpenAI server).
USAGE_OPTION_ROUTES = ("/v1/chat/completions", "/v1/completions")
# A JSON answer larger than this is relayed without being read for usage (embeddings of a big
# batch): its usage is taken from the first bytes only if the whole body fits.
MAX_METERED_BODY_BYTES = 8 * 1024 * 1024
ANONYMOUS = ""  # the key name of requests without a key (an endpoint open to all)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_of(obj: Any) -> Usage | None:
    """An OpenAI ``usage`` object (chat/completions/embeddings, or responses' input/output)."""
    if not isinstance(obj, dict):
        return None
    prompt = obj.get("prompt_tokens", obj.get("input_tokens"))
    completion = obj.get("completion_tokens", obj.get("output_tokens", 0))
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(max(0, prompt), max(0, completion or 0))


def usage_of_body(body: bytes) -> Usage | None:
    """Usage in a non-streamed JSON answer (None if it has none or is not JSON)."""
    if b'"usage"' not in body:
        return None
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(document, dict):
        return None
    return usage_of(document.get("usage"))


def usage_of_job_output(output: Any) -> Usage | None:
    """A finished job's output: a list of batches whose last ``usage`` is cumulative
    (``{"input", "output"}``), or an OpenAI route's answer (``usage``)."""
    if isinstance(output, dict):
        output = [output]
    if not isinstance(output, list):
        return None
    for item in reversed(output):
        if not isinstance(item, dict):
            continue
        usage = item.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("input"), int):
            return Usage(max(0, usage["input"]), max(0, int(usage.get("output") or 0)))
        found = usage_of(usage)
        if found is not None:
            return found
    return None


def prepare_stream_request(path: str, payload: dict[str, Any]) -> tuple[bool, bool]:
    """(ask the replica for usage, strip the usage chunk from the client's stream).

    Only for streamed chat/completions requests; a client that asked for usage itself gets it
    as it asked (nothing stripped)."""
    if payload.get("stream") is not True or path.split("?", 1)[0] not in USAGE_OPTION_ROUTES:
        return False, False
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False, False
    if options is not None and not isinstance(options, dict):
        return False, False  # the replica answers the 400 for a malformed value
    return True, True


def with_usage_option(payload: dict[str, Any]) -> bytes:
    options = dict(payload.get("stream_options") or {})
    options["include_usage"] = True
    return json.dumps({**payload, "stream_options": options}).encode()


class StreamUsage:
    """Reads an SSE answer as it passes: finds the usage, optionally drops the usage-only chunk.

    ``feed`` returns the bytes to send on to the client. Without stripping they are the bytes
    received, unchanged. With stripping, whole events are sent as they complete (vLLM writes
    one event per write, so nothing waits in practice) and a trailing partial event is held
    until its end arrives."""

    def __init__(self, strip: bool):
        self.strip = strip
        self.usage: Usage | None = None
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if not self.strip:
                # Only a partial event's head is worth keeping, and only if usage may follow.
                self._tail = data[-(1 << 20) :]
                return chunk
            self._tail = data
            return b""
        complete, self._tail = data[: cut + 2], data[cut + 2 :]
        if b'"usage"' not in complete:
            return complete if self.strip else chunk
        kept: list[bytes] = []
        for event in complete.split(b"\n\n")[:-1]:
            usage, usage_only = _event_usage(event)
            if usage is not None:
                self.usage = usage
                if self.strip and usage_only:
                    continue
            kept.append(event + b"\n\n")
        return b"".join(kept) if self.strip else chunk

    def flush(self) -> bytes:
        """What is held at the end of the stream (an unterminated last event)."""
        tail, self._tail = self._tail, b""
        return tail if self.strip else b""


def _event_usage(event: bytes) -> tuple[Usage | None, bool]:
    """(usage in this SSE event, whether it is the usage-only chunk: ``choices`` empty)."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data.startswith(b"{"):
            continue
        try:
            document = json.loads(data)
        except ValueError:
            continue
        if not isinstance(document, dict):
            continue
        if "usage" in document:
            return usage_of(document["usage"]), document.get("choices") == []
        response = document.get("response")  # /v1/responses: response.completed
        if document.get("type") == "response.completed" and isinstance(response, dict):
            return usage_of(response.get("usage")), False
    return None, False


class BodyUsage:
    """Reads a non-streamed answer as it passes (unchanged) for its ``usage``."""

    strip = False

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> bytes:
        self._size += len(chunk)
        if self._size <= MAX_METERED_BODY_BYTES:
            self._parts.append(chunk)
        return chunk

    def flush(self) -> bytes:
        return b""

    @property
    def usage(self) -> Usage | None:
        if self._size > MAX_METERED_BODY_BYTES:
            return None
        return usage_of_body(b"".join(self._parts))


# ------------------------------------------------------------------ records


@dataclass(frozen=True)
class UsageRecord:
    id: str  # unique per answer ("<request id>.<random>"), or "job-<id>"[-usage]
    time: float  # epoch seconds, when the request ended
    key: str  # the API key's name ("" without a key)
    endpoint: str
    model: str
    status: int
    prompt_tokens: int
    completion_tokens: int
    gateway: str = ""
    kind: str = "openai"  # openai | job
    # 1 for a request or a job's submission; 0 for the record of a job's tokens, written when
    # the job completes (its submission was counted already).
    requests: int = 1

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> UsageRecord | None:
        try:
            raw = json.loads(data)
            return cls(
                id=str(raw["id"]),
                time=float(raw["time"]),
                key=str(raw.get("key", "")),
                endpoint=str(raw["endpoint"]),
                model=str(raw.get("model", "")),
                status=int(raw.get("status", 0)),
                prompt_tokens=int(raw.get("prompt_tokens", 0)),
                completion_tokens=int(raw.get("completion_tokens", 0)),
                gateway=str(raw.get("gateway", "")),
                kind=str(raw.get("kind", "openai")),
                requests=int(raw.get("requests", 1)),
            )
        except (ValueError, KeyError, TypeError):
            return None


USAGE_COLUMNS = ("key", "endpoint", "model", "requests", "prompt_tokens", "completion_tokens")


def summarize(records: Iterable[UsageRecord]) -> list[dict[str, Any]]:
    """One row per key, endpoint and model (sorted), duplicates by id counted once."""
    seen: set[str] = set()
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for record in records:
        if record.id in seen:
            continue
        seen.add(record.id)
        group = (record.key, record.endpoint, record.model)
        row = rows.get(group)
        if row is None:
            row = rows[group] = dict(zip(USAGE_COLUMNS, (*group, 0, 0, 0), strict=True))
        row["requests"] += record.requests
        row["prompt_tokens"] += record.prompt_tokens
        row["completion_tokens"] += record.completion_tokens
    return [rows[k] for k in sorted(rows)]


# ------------------------------------------------------------------ NATS


class UsagePublisher:
    """Publishes usage records to ``LLMEP_USAGE`` in the background: the request path only
    appends to a bounded buffer. While NATS is unreachable records wait (up to
    ``buffer_limit``, then the oldest are dropped with a warning) and go out once it is back."""

    def __init__(
        self,
        url: str,
        gateway_id: str,
        buffer_limit: int = 100_000,
        creds_file: str | None = None,
    ):
        self.url = url
        self.creds_file = creds_file
        self.gateway_id = gateway_id
        self._buffer: deque[UsageRecord] = deque()
        self._limit = buffer_limit
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._connection = None
        self.dropped = 0
        self.published = 0

    def record(self, record: UsageRecord) -> None:
        if len(self._buffer) >= self._limit:
            self._buffer.popleft()
            self.dropped += 1
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                logger.warning("usage buffer full: %d record(s) dropped", self.dropped)
        self._buffer.append(record)
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._buffer)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, timeout: float = 3.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._buffer and self._connection is not None and loop.time() < deadline:
            self._wake.set()
            await asyncio.sleep(0.05)
        if self._buffer:
            logger.warning("%d usage record(s) not published at shutdown", len(self._buffer))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._connection is not None:
            await self._connection.close()

    async def _run(self) -> None:
        from llmendpoints_common.queue import names
        from llmendpoints_common.queue.client import QueueConnection

        while self._connection is None:
            try:
                self._connection = await QueueConnection.connect(
                    self.url, name=f"gateway-usage-{self.gateway_id}", creds_file=self.creds_file
                )
            except Exception as exc:
                logger.warning("cannot reach the queue for usage records (%s); retrying", exc)
                await asyncio.sleep(2.0)
        js = self._connection.js
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._buffer:
                batch = [self._buffer[i] for i in range(min(256, len(self._buffer)))]
                acks = await asyncio.gather(
                    *(
                        js.publish(
                            names.usage_subject(r.endpoint, r.key),
                            r.encode(),
                            headers={"Nats-Msg-Id": r.id},
                        )
                        for r in batch
                    ),
                    return_exceptions=True,
                )
                done = 0
                for ack in acks:
                    if isinstance(ack, BaseException):
                        break
                    done += 1
                for _ in range(done):
                    self._buffer.popleft()
                self.published += done
                if done < len(batch):
                    failed = next(a for a in acks if isinstance(a, BaseException))
                    logger.warning("publishing usage records failed (%s); retrying", failed)
                    await asyncio.sleep(1.0)


CONNECT_TIMEOUT_SECONDS = 10.0


async def read_usage(
    url: str, since: float, until: float | None, creds_file: str | None = None
) -> list[UsageRecord]:
    """Every record of ``LLMEP_USAGE`` that ended in [since, until): read from the first
    message stored at ``since`` (the stream's own time index) up to its last message now."""
    from datetime import UTC, datetime

    from llmendpoints_common.queue import names
    from llmendpoints_common.queue.connect import connect
    from llmendpoints_common.queue.topology import QueueLayout, ensure_streams
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    async def quiet(exc: Exception) -> None:
        pass

    # Bounded, unlike the servers' reconnect-forever (nats-py keeps retrying a first connect
    # whatever its options say): a CLI says it cannot reach the queue.
    try:
        nc, permissions = await asyncio.wait_for(
            connect(
                url,
                name="llmendpoints-gateway-usage",
                creds_file=creds_file,
                connect_timeout=5,
                reconnect=False,
                error_cb=quiet,
            ),
            CONNECT_TIMEOUT_SECONDS,
        )
    except TimeoutError:
        raise ConnectionError(
            f"no NATS server answered within {CONNECT_TIMEOUT_SECONDS:.0f} s"
        ) from None
    try:
        js = nc.jetstream(timeout=10)
        if permissions is None or permissions.may_publish(
            f"$JS.API.STREAM.CREATE.{names.USAGE_STREAM}"
        ):
            await ensure_streams(js, QueueLayout())
        info = await js.stream_info(names.USAGE_STREAM)
        last = info.state.last_seq
        records: list[UsageRecord] = []
        if info.state.messages == 0:
            return records
        # Records may be stored a moment after they ended: start a minute early, filter exactly.
        start = datetime.fromtimestamp(max(0.0, since - 60.0), tz=UTC)
        sub = await js.pull_subscribe(
            "llmep.usage.>",
            stream=names.USAGE_STREAM,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME,
                ack_policy=AckPolicy.NONE,
                opt_start_time=start.isoformat().replace("+00:00", "Z"),
                inactive_threshold=60.0,
                mem_storage=True,
            ),
        )
        try:
            while True:
                try:
                    messages = await sub.fetch(1000, timeout=1.0)
                except TimeoutError:
                    break
                seq = 0
                for msg in messages:
                    seq = msg.metadata.sequence.stream
                    record = UsageRecord.decode(msg.data)
                    if (
                        record is not None
                        and record.time >= since
                        and (until is None or record.time < until)
                    ):
                        records.append(record)
                if seq >= last:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return records
    finally:
        await nc.close()

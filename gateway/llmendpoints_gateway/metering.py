"""Usage metering per key, endpoint and model, from the usage the engine reports.

- Non-streamed answers: the ``usage`` object of the JSON body (``prompt_tokens`` /
  ``completion_tokens``; ``input_tokens`` / ``output_tokens`` for /v1/responses).
- Streams: the gateway asks the replica for usage (``stream_options.include_usage``) on
  /v1/chat/completions and /v1/completions and reads the final usage chunk (``choices: []``);
  when the client did not ask for it, that chunk is taken out of the client's stream, so the
  client sees what it would have seen without the gateway. /v1/responses streams carry usage in
  their ``response.completed`` event anyway.
- Jobs: a request when accepted; the usage of the job's output (``usage.input`` /
  ``usage.output`` of its last batch, or an OpenAI route's ``usage``) when it completes, and
  what the engine used up to the stop when it ends TIMED_OUT or CANCELLED while running (the
  record's ``usage``, written by its worker), read by usage.JobUsageMeter from the job records
  whoever ran it and however its result is fetched; one record per run of the job.

A request that failed before the engine produced anything has no usage: it counts as a request
(with its status) and zero tokens. Records go to the JetStream stream ``LLMEP_USAGE`` with the
record's id as the message id (unique per answer; a job's own id for its records), so a record
published twice (a publish retried after a lost acknowledgement, a job's result read through two
replicas) is stored once.

This module is pure (extraction, records, aggregation; stream_meter.py reads streams); usage.py
publishes the records, meters jobs and reads the records back.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from llmendpoints_common.errors import BadRequestError
from llmendpoints_common.jobs.models import JobStatus
from llmendpoints_common.jobs.record import JobRecord

# Routes whose streams take stream_options.include_usage (vLLM's OpenAI server).
USAGE_OPTION_ROUTES = ("/v1/chat/completions", "/v1/completions")


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


# A job's usage record's status: how the run ended (TIMED_OUT as HTTP's 408; CANCELLED as 499,
# "the client closed the request", the status proxies log for a request its client gave up on).
JOB_USAGE_STATUS = {JobStatus.COMPLETED: 200, JobStatus.TIMED_OUT: 408, JobStatus.CANCELLED: 499}


# The usage stream drops a record published again with the same id within its duplicate
# window (QueueLayout.usage_duplicate_window_seconds, 10 min). A finished job's record is
# written again later too -- a /stream read moving its cursor, hours after the end -- and would
# then be billed twice: only the writes of its first half window are billed at all. (Half of
# that window, written out: this module stays free of the NATS client; a test holds them equal.)
BILLED_WRITES_WITHIN_SECONDS = 300.0


def usage_of_job(record: JobRecord, written_at: float | None = None) -> Usage | None:
    """What a finished job is billed (None: nothing). COMPLETED: the usage of its output.
    TIMED_OUT, or CANCELLED while it ran: what its worker reports the engine used up to the
    stop (``record.usage``; none for a job that never started). FAILED: nothing.

    ``written_at``: when the queue stored this write of the record. A write long after the
    job ended is a rewrite of a record already billed (BILLED_WRITES_WITHIN_SECONDS)."""
    if (
        written_at is not None
        and record.finished_at is not None
        and written_at - record.finished_at > BILLED_WRITES_WITHIN_SECONDS
    ):
        return None
    if record.status is JobStatus.COMPLETED:
        return usage_of_job_output(record.output)
    if record.status in JOB_USAGE_STATUS and record.usage is not None:
        usage = Usage(record.usage.prompt_tokens, record.usage.completion_tokens)
        return usage if usage.total > 0 else None
    return None


def job_usage_id(job_id: str, run: int) -> str:
    """One usage record per run of a job: /retry starts a new run (billed on its own), while
    a record written again within a run (a /stream read moving its cursor, the worker adding
    its usage, a redelivery to the meter) has the same id and is stored once. Run 1 keeps the
    id records had before runs were counted."""
    return f"job-{job_id}-usage" if run <= 1 else f"job-{job_id}-run{run}-usage"


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


# -- what a request will cost, read as the engine will read it ---------------------------------

# Fields that change what is metered. vLLM's request models coerce "true", 1 or "yes" to a
# boolean and "4" to an integer; the gateway decides on them too (stream: ask for usage or not;
# n and max_tokens: what to reserve), so it takes only what cannot be read two ways.
_BOOLEAN_FIELDS = ("stream",)
_OPTION_BOOLEANS = ("include_usage", "continuous_usage_stats")
_INTEGER_FIELDS = ("n", "best_of", "max_tokens", "max_completion_tokens", "max_output_tokens")
# A prompt's tokens, estimated before the engine counts them: about four characters a token for
# English text, and a few tokens of chat template around each message.
CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4


@dataclass(frozen=True)
class MeteredRequest:
    stream: bool
    ask_usage: bool  # ask the replica for the usage chunk (stream_options.include_usage)
    strip: bool  # take that chunk out of the client's stream (the client did not ask for it)
    reserve_tokens: int  # what the request may use: prompt estimate + n x max_tokens
    prompt_estimate: int
    # The completion tokens it asks for outright: n x max_tokens (the field it set, None when
    # it set none: a default of the gateway's is no reason to refuse it).
    asked_tokens: int = 0
    asked_field: str | None = None


def _refuse(field: str, what: str, value: Any) -> BadRequestError:
    return BadRequestError(f"{field}: must be {what}, got {json.dumps(value)}", param=field)


def metered_request(
    path: str, payload: dict[str, Any], body_bytes: int, default_max_tokens: int
) -> MeteredRequest:
    """PURE: how a request is metered; BadRequestError (naming the field) for a value the
    gateway and the engine could read differently."""
    for name in _BOOLEAN_FIELDS:
        value = payload.get(name)
        if value is not None and not isinstance(value, bool):
            raise _refuse(name, "true or false", value)
    options = payload.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _refuse("stream_options", "an object", options)
        for name in _OPTION_BOOLEANS:
            value = options.get(name)
            if value is not None and not isinstance(value, bool):
                raise _refuse(f"stream_options.{name}", "true or false", value)
    counts: dict[str, int] = {}
    for name in _INTEGER_FIELDS:
        value = payload.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _refuse(name, "a whole number", value)
        counts[name] = value
    stream = payload.get("stream") is True
    route = path.split("?", 1)[0]
    asked = isinstance(options, dict) and options.get("include_usage") is True
    ask_usage = stream and route in USAGE_OPTION_ROUTES and not asked
    sequences = max(counts.get("n", 1), counts.get("best_of", 1), 1)
    prompts = payload.get("prompt")
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
        sequences *= len(prompts)  # a list of prompts (not one prompt's token ids)
    field = next(
        (n for n in ("max_completion_tokens", "max_tokens", "max_output_tokens") if n in counts),
        None,
    )
    limit = counts[field] if field is not None else default_max_tokens
    prompt = prompt_estimate(payload, body_bytes)
    asked = sequences * limit if field is not None else 0
    return MeteredRequest(
        stream, ask_usage, ask_usage, prompt + sequences * limit, prompt, asked, field
    )


def prompt_estimate(payload: dict[str, Any], body_bytes: int) -> int:
    """The prompt's tokens before the engine counts them (pure): its text's characters / 4 and
    the chat template's few tokens a message; token ids count one each; a body of another shape
    by its size."""
    messages = payload.get("messages")
    prompt = payload.get("prompt", payload.get("input"))
    if isinstance(messages, list):
        chars = sum(len(_content_text(m.get("content"))) for m in messages if isinstance(m, dict))
        return -(-chars // CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages)
    if isinstance(prompt, str):
        return -(-len(prompt) // CHARS_PER_TOKEN)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)  # token ids
        return sum(prompt_estimate({"prompt": p}, 0) for p in prompt)
    return -(-body_bytes // CHARS_PER_TOKEN)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def with_usage_option(body: bytes, payload: dict[str, Any]) -> bytes:
    """``body`` asking for the usage chunk. The usual case (no ``stream_options`` yet) is a
    splice into the bytes, so a held request keeps no second, re-serialised copy of itself."""
    if "stream_options" not in payload:
        start = body.index(b"{") + 1
        rest = body[start:].lstrip()
        separator = b"" if rest.startswith(b"}") else b","
        return body[:start] + b'"stream_options":{"include_usage":true}' + separator + rest
    options = dict(payload.get("stream_options") or {})
    options["include_usage"] = True
    return json.dumps({**payload, "stream_options": options}).encode()


# Answers up to this size are kept whole and parsed; of larger ones (embeddings of a big batch)
# only the last TAIL_BYTES, where the engine writes ``usage``.
WHOLE_BODY_BYTES = 1024 * 1024
TAIL_BYTES = 64 * 1024


class BodyUsage:
    """Reads a non-streamed answer as it passes (unchanged) for its ``usage``, in bounded
    memory whatever its size."""

    strip = False
    estimated = False
    ended = False  # nothing in a JSON body marks its end: the client has it with the last byte

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        self._size += len(chunk)
        if self._size <= WHOLE_BODY_BYTES:
            self._parts.append(chunk)
        else:
            if self._parts:  # from here on only the tail
                self._tail, self._parts = b"".join(self._parts), []
            self._tail = (self._tail + chunk)[-TAIL_BYTES:]
        return chunk

    def flush(self) -> bytes:
        return b""

    @property
    def usage(self) -> Usage | None:
        if self._size <= WHOLE_BODY_BYTES:
            return usage_of_body(b"".join(self._parts))
        return usage_of_tail(self._tail)


def usage_of_tail(tail: bytes) -> Usage | None:
    """The ``usage`` object in the last bytes of a JSON answer: its last occurrence, read to its
    closing brace (pure; None if it is not there whole)."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    start = tail.find(b"{", at)
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(tail)):
        byte = tail[i]
        if byte == 0x7B:  # {
            depth += 1
        elif byte == 0x7D:  # }
            depth -= 1
            if depth == 0:
                try:
                    return usage_of(json.loads(tail[start : i + 1]))
                except ValueError:
                    return None
    return None


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


# A spreadsheet reads a cell starting with one of these as a formula (OWASP, "CSV Injection").
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def csv_text(value: str) -> str:
    """A text cell of the usage export, safe to open in a spreadsheet (pure): control
    characters written as escapes (``\\n``, ``\\r``, ``\\t``, ``\\xNN``: one record, one line),
    and a leading ``=``, ``+``, ``-`` or ``@`` behind a ``'`` so it is shown, never evaluated.
    Quotes and commas are the CSV writer's to quote. The model is what a client sent."""
    text = _CONTROL.sub(lambda m: _ESCAPES.get(m[0], f"\\x{ord(m[0]):02x}"), value)
    return "'" + text if text.startswith(_FORMULA_START) else text


def usage_csv(rows: Iterable[dict[str, Any]]) -> str:
    """``summarize``'s rows as the export's CSV, a header first, text cells made safe
    (``csv_text``) (pure)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=USAGE_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: csv_text(v) if isinstance(v, str) else v for k, v in row.items()})
    return out.getvalue()

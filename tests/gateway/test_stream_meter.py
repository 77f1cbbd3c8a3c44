"""The SSE reader the gateway meters streams with (stream_meter.py), on its own: what a cut
stream of each kind of delta is billed, and what a replica's oversized or unterminated event
costs it (held bytes, what passes through). The same against the real gateway process, with CPU
time and billing measured there: tests/gateway/test_client_bounds.py."""

from __future__ import annotations

import json

import pytest
from llmendpoints_gateway.metering import Usage
from llmendpoints_gateway.stream_meter import MAX_EVENT_BYTES, StreamUsage

MiB = 1024 * 1024


def _sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def _delta(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


USAGE_CHUNK = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}


def _feed(reader: StreamUsage, stream: bytes, split: int) -> bytes:
    out = b"".join(reader.feed(stream[i : i + split]) for i in range(0, len(stream), split))
    return out + reader.flush()


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_a_cut_reasoning_stream_is_billed_a_token_an_event(field):
    """vLLM 0.32 names the delta ``reasoning``; others (and vLLM before) ``reasoning_content``.
    Before: 0 tokens billed."""
    role = _delta(role="assistant", content="")
    stream = _sse(role, *[_delta(**{field: "tok"})] * 40, *[_delta(content="x")] * 10)
    for split in (7, 10_000):
        reader = StreamUsage(strip=True, prompt_estimate=5)
        _feed(reader, stream, split)
        assert reader.usage == Usage(5, 50) and reader.estimated


def _tool_call_stream(argument_pieces: list[str]) -> bytes:
    head = _delta(
        tool_calls=[
            {
                "index": 0,
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    )
    pieces = [
        _delta(tool_calls=[{"index": 0, "function": {"arguments": piece}}])
        for piece in argument_pieces
    ]
    return _sse(_delta(role="assistant", content=""), head, *pieces)


def test_a_cut_tool_call_stream_is_billed_its_name_and_arguments():
    """One argument piece an event (vLLM's tool parsers diff the arguments every step): a
    token each; pieces of several tokens (a parser that held some back): by their characters.
    Before: nothing of a tool call was billed."""
    pieces = ['{"', "location", '":', ' "', "San", " Francisco", '",', ' "', "unit", '":', ' "c"}']
    reader = StreamUsage(strip=True)
    _feed(reader, _tool_call_stream(pieces * 10), 13)
    # the name, then each piece: 111 pieces of 431 characters in all (JSON's escapes as one)
    assert reader.usage.completion_tokens == 1 + 10 * len(pieces)
    arguments = "".join(pieces) * 20  # 20 x 11 tokens, in 4 events
    reader = StreamUsage(strip=False)
    _feed(reader, _tool_call_stream([arguments[i : i + 200] for i in range(0, 800, 200)]), 64)
    assert reader.usage.completion_tokens == -(-(len("get_weather") + 800) // 4)


@pytest.mark.parametrize("strip", [True, False])
@pytest.mark.parametrize("split", [1000, 65_536, 300_000])
def test_an_oversized_event_passes_through_and_the_stream_is_still_read(strip, split):
    """An event far past MAX_EVENT_BYTES goes on as it arrives (nothing of it held), and the
    events after it are read as usual: the usage-only chunk still found and stripped."""
    big = _delta(content="y" * (3 * MiB))
    stream = _sse(_delta(content="x"), big, _delta(content="x"), USAGE_CHUNK, "[DONE]")
    reader = StreamUsage(strip)
    out = _feed(reader, stream, split)
    assert reader.usage == Usage(7, 3) and reader.ended
    want = _sse(_delta(content="x"), big, _delta(content="x"), "[DONE]") if strip else stream
    assert out == want


@pytest.mark.parametrize("strip", [True, False])
def test_an_unterminated_event_is_never_held(strip):
    """50 MiB with no event end: every byte fed goes on at once (strip: after the first
    MAX_EVENT_BYTES, held until the event proved too large for a usage chunk); nothing waits
    for the end, so nothing is rescanned."""
    reader = StreamUsage(strip)
    reader.feed(_sse(_delta(content="x")))
    chunk = b"y" * 65_536
    fed = passed = 0
    reader.feed(b'data: {"choices": [{"delta": {"content": "')
    for _ in range(50 * 16):
        passed += len(reader.feed(chunk))
        fed += len(chunk)
    if strip:
        assert fed - passed <= MAX_EVENT_BYTES
    assert reader.flush() == b""  # nothing held
    assert reader.usage == Usage(0, 2) and not reader.ended  # two events carried text


def test_a_long_responses_completion_is_billed_from_its_tail():
    """/v1/responses ends with ``response.completed`` carrying the whole output, then usage:
    past MAX_EVENT_BYTES it is read from its tail, and it still ends the stream."""
    completed = {
        "type": "response.completed",
        "response": {
            "output": [{"content": [{"text": "z" * (2 * MiB)}]}],
            "usage": {"input_tokens": 4, "output_tokens": 9},
        },
    }
    stream = b"event: response.completed\ndata: " + json.dumps(completed).encode() + b"\n\n"
    for split in (4096, 10 * MiB):
        reader = StreamUsage(strip=True)
        assert _feed(reader, stream, split) == stream
        assert reader.usage == Usage(4, 9) and reader.ended


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_an_event_end_split_across_reads_is_found(split):
    stream = _sse(_delta(content="x"), USAGE_CHUNK, "[DONE]")
    reader = StreamUsage(strip=True)
    assert _feed(reader, stream, split) == _sse(_delta(content="x"), "[DONE]")
    assert reader.usage == Usage(7, 3) and reader.ended

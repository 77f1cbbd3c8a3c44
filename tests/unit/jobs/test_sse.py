import pytest
from llmendpoints_runtime.jobs.sse import SSECutter

STREAM = (
    'data: {"text": "héllo ✓ 🙂"}\n\n'
    ": keep-alive comment\n\n"
    'data: {"text": "two"}\n\n'
    'data: {"error": {"message": "boom", "type": "InternalServerError"}}\n\n'
    "data: [DONE]\n\n"
).encode()


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 64, len(STREAM)])
def test_events_come_out_whole_however_the_bytes_are_split(piece: int) -> None:
    cutter = SSECutter()
    events = []
    for start in range(0, len(STREAM), piece):
        events += cutter.feed(STREAM[start : start + piece])
    events += cutter.finish()
    assert "".join(e.raw for e in events).encode() == STREAM
    assert [e.raw.endswith("\n\n") for e in events] == [True] * 5
    assert events[0].json() == {"text": "héllo ✓ 🙂"}
    assert events[1].data is None and events[1].json() is None
    assert events[3].error == {"message": "boom", "type": "InternalServerError"}
    assert events[4].is_done and events[4].json() is None


def test_crlf_boundaries_and_multiline_data() -> None:
    cutter = SSECutter()
    events = cutter.feed(b"data: a\r\ndata: b\r\n\r\ndata: c")
    assert [e.data for e in events] == ["a\nb"]
    last = cutter.finish()
    assert [e.data for e in last] == ["c"]


def test_incomplete_tail_is_held_back() -> None:
    cutter = SSECutter()
    assert cutter.feed('data: {"t": "✓'.encode()[:-1]) == []
    assert cutter.finish()[0].raw.startswith("data:")
    assert cutter.finish() == []

"""An OpenAI batch input file, validated line by line as OpenAI validates it."""

from __future__ import annotations

import json

import pytest
from llmendpoints_common.batch import jsonl
from llmendpoints_common.batch.limits import BatchLimits

LIMITS = BatchLimits()
CHAT = "/v1/chat/completions"


def line(custom_id="a", url=CHAT, method="POST", **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": method,
        "url": url,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
    }


def jsonl_of(*lines) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def errors(data: bytes, endpoint=CHAT, limits=LIMITS) -> list[tuple[str, int | None, str | None]]:
    return [(e.code, e.line, e.param) for e in jsonl.validate_file(data, endpoint, limits).errors]


def test_a_valid_file_counts_its_requests_model_and_tokens():
    found = jsonl.validate_file(jsonl_of(line("a", max_tokens=10), line("b")), CHAT, LIMITS)
    assert found.ok and found.count == 2 and found.model == "m" and found.model_line == 1
    # prompt bytes / 4 + max_tokens (or the default for a line without one)
    assert found.tokens > 10 + LIMITS.default_max_tokens
    check = jsonl.Validator(CHAT, LIMITS)
    requests = check.feed(jsonl_of(line("a"), b"", line("b")))
    assert check.finish() == [] and check.result.ok
    assert [(r.line, r.custom_id) for r in requests] == [(1, "a"), (3, "b")]
    assert requests[0].body["model"] == "m"


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, 10_000])
def test_a_file_read_in_chunks_of_any_size_is_read_the_same(chunk):
    data = jsonl_of(line("a"), b"", b"{not json") + jsonl_of(line("b")).replace(b"\n", b"\r\n")
    data += json.dumps(line("c")).encode()  # no line end at the end
    check = jsonl.Validator(CHAT, LIMITS)
    requests = []
    for i in range(0, len(data), chunk):
        requests += check.feed(data[i : i + chunk])
    requests += check.finish()
    found = check.result
    assert [(r.line, r.custom_id) for r in requests] == [(1, "a"), (4, "b"), (5, "c")]
    assert [(e.code, e.line) for e in found.errors] == [("invalid_json_line", 3)]
    assert found.count == 4


def test_a_line_past_the_bound_is_counted_never_held():
    reader = jsonl.LineReader(max_bytes=100)
    for _ in range(1000):  # one line of 1 MB, in 1 KB pieces
        assert reader.feed(b"x" * 1000) == []
        assert len(reader._buffer) <= 101
    (long,) = reader.feed(b"\nshort\n")[:1]
    assert (long.number, long.data, long.size) == (1, None, 1_000_000)
    assert reader.finish() == []
    counted = jsonl.UploadCount(BatchLimits(max_line_bytes=100))
    for _ in range(1000):
        counted.feed(b"y" * 1000)
    counted.finish()
    assert (counted.lines, counted.tokens) == (1, 250_000)  # bytes / 4


def test_an_upload_count_estimates_each_request_as_validation_does():
    counted = jsonl.UploadCount(LIMITS)
    data = jsonl_of(line("a", max_tokens=10), b"", b"not json but 24 bytes...")
    counted.feed(data[:5])
    counted.feed(data[5:])
    counted.finish()
    body = line("a", max_tokens=10)["body"]
    assert counted.lines == 2
    assert counted.tokens == jsonl.estimate_tokens(body, LIMITS.default_max_tokens) + 6


def test_blank_lines_and_crlf_are_fine_and_keep_line_numbers():
    data = jsonl_of(line("a")).replace(b"\n", b"\r\n") + b"\n  \n" + jsonl_of(b"oops")
    assert errors(data) == [("invalid_json_line", 4, None)]  # lines 2 and 3 are blank


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (b"{not json", ("invalid_json_line", 1, None)),
        (b"\xff\xfe", ("invalid_json_line", 1, None)),
        (b"[1, 2]", ("invalid_json_line", 1, None)),
        ({**line(), "extra": 1}, ("invalid_request", 1, "extra")),
        (
            {k: v for k, v in line().items() if k != "custom_id"},
            ("missing_custom_id", 1, "custom_id"),
        ),
        (line(custom_id=""), ("invalid_custom_id", 1, "custom_id")),
        (line(custom_id=7), ("invalid_custom_id", 1, "custom_id")),
        (line(custom_id="x" * 513), ("invalid_custom_id", 1, "custom_id")),
        (line(method="GET"), ("invalid_method", 1, "method")),
        (line(url="/v1/completions"), ("mismatched_endpoint", 1, "url")),
        ({**line(), "body": []}, ("invalid_body", 1, "body")),
        ({**line(), "body": {"messages": []}}, ("missing_model", 1, "body.model")),
        (line(stream=True), ("invalid_body", 1, "body.stream")),
    ],
)
def test_each_kind_of_bad_line_is_named_with_its_line(bad, expected):
    assert errors(jsonl_of(bad)) == [expected]


def test_a_stream_false_line_is_fine():
    assert errors(jsonl_of(line(stream=False))) == []


def test_duplicate_custom_ids_and_mixed_models_name_the_first_line():
    data = jsonl_of(line("a"), line("b"), line("a"), line("c", model="other"))
    found = jsonl.validate_file(data, CHAT, LIMITS)
    assert [(e.code, e.line) for e in found.errors] == [
        ("duplicate_custom_id", 3),
        ("mismatched_model", 4),
    ]
    assert "line 1" in found.errors[0].message and "line 1" in found.errors[1].message


def test_empty_files_too_many_requests_and_size_limits():
    assert errors(b"") == [("empty_file", None, None)]
    assert errors(b"\n\n") == [("empty_file", None, None)]
    few = BatchLimits(max_requests=2)
    data = jsonl_of(line("a"), line("b"), line("c"))
    found = jsonl.validate_file(data, CHAT, few)
    assert [(e.code, e.line) for e in found.errors] == [("too_many_requests", None)]
    assert (
        "3 requests" in found.errors[0].message
        and "LLMEP_BATCH_MAX_REQUESTS" in found.errors[0].message
    )
    small = BatchLimits(max_file_bytes=10)
    assert errors(data, limits=small) == [("file_too_large", None, None)]
    narrow = BatchLimits(max_line_bytes=20)
    assert errors(jsonl_of(line("a")), limits=narrow) == [("line_too_large", 1, None)]


def test_the_error_list_is_bounded_and_says_how_many_more():
    limits = BatchLimits(max_errors=3)
    found = jsonl.validate_file(jsonl_of(*([b"nope"] * 10)), CHAT, limits)
    listed = found.error_list()
    assert len(listed) == 4 and found.more_errors == 7
    assert listed[-1]["code"] == "too_many_errors" and "7 more" in listed[-1]["message"]
    assert set(listed[0]) == {"code", "message", "param", "line"}


def test_embeddings_batches_bound_their_inputs():
    emb = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
           "body": {"model": "m", "input": ["x"] * 30_000}}  # fmt: skip
    data = jsonl_of(emb, {**emb, "custom_id": "f"})
    assert errors(data, "/v1/embeddings") == [("too_many_embedding_inputs", None, None)]


def test_endpoints_are_the_three_a_job_can_call():
    assert jsonl.check_endpoint("/v1/completions") == "/v1/completions"
    with pytest.raises(ValueError, match="/v1/chat/completions"):
        jsonl.check_endpoint("/v1/responses")


def test_token_estimate_counts_prompt_and_what_may_be_generated():
    assert jsonl.estimate_tokens({"prompt": "x" * 400, "max_tokens": 50}, 1024) == 100 + 50
    assert jsonl.estimate_tokens({"prompt": "x" * 40, "max_tokens": 5, "n": 3}, 1024) == 10 + 15
    assert jsonl.estimate_tokens({"prompt": "", "max_completion_tokens": 7}, 1024) == 0 + 7
    assert jsonl.estimate_tokens({"input": "abcd" * 10}, 1024) == 10  # embeddings: no output
    assert jsonl.estimate_tokens({"prompt": "hi"}, 64) == 1 + 64

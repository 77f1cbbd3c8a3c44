"""The upload read as it arrives, as events: fields, one file in pieces, bounds and deadlines."""

from __future__ import annotations

import asyncio

import pytest
from llmendpoints_common.batch.files import FileEnd, FileStart, FormField
from llmendpoints_common.errors import APIError
from llmendpoints_edge.body import ClientGone
from llmendpoints_edge.multipart import MultipartReader, content_params

BOUNDARY = "----llmep-boundary"


def form(*parts: tuple[str, str | None, bytes], boundary: str = BOUNDARY) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += (
            f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
        )
    return out + f"--{boundary}--\r\n".encode()


def scope(body: bytes | None = None, content_type: str | None = None) -> dict:
    headers = [
        (b"content-type", (content_type or f"multipart/form-data; boundary={BOUNDARY}").encode())
    ]
    if body is not None:
        headers.append((b"content-length", str(len(body)).encode()))
    return {"type": "http", "headers": headers}


def receiver(body: bytes, chunk: int = 7, *, disconnect: bool = False, stall: bool = False):
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]

    async def receive():
        if stall and len(pieces) == 1:
            await asyncio.sleep(10)
        if disconnect and len(pieces) == 1:
            return {"type": "http.disconnect"}
        piece = pieces.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    return receive


async def read_multipart(scope, receive, **options) -> list:
    """Every event of the upload, in order (the file's pieces as they came)."""
    reader = MultipartReader(scope, receive, **options)
    events = [event async for event in reader.upload().events]
    assert reader.complete
    return events


async def read(body: bytes, **kwargs):
    options = {"limit": 1000, "setting": "LIMIT", "timeout": 5.0}
    chunk = kwargs.pop("chunk", 7)
    options.update(kwargs)
    return await read_multipart(scope(body), receiver(body, chunk), **options)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 10_000])
async def test_fields_and_the_file_whatever_the_chunking(chunk):
    data = b'{"custom_id": "a"}\r\n--not-the-boundary\r\n' * 5
    body = form(("purpose", None, b"batch"), ("file", "in.jsonl", data),
                ("expires_after[seconds]", None, b"7200"))  # fmt: skip
    events = await read(body, chunk=chunk)
    pieces = [e for e in events if isinstance(e, bytes)]
    assert b"".join(pieces) == data
    assert [e for e in events if not isinstance(e, bytes)] == [
        FormField("purpose", "batch"),
        FileStart("file", "in.jsonl"),
        FileEnd(),
        FormField("expires_after[seconds]", "7200"),
    ]
    # The file comes in pieces as the body does: none is held back for the whole file.
    assert max(len(p) for p in pieces) <= max(chunk, len(BOUNDARY) + 4) + len(BOUNDARY) + 4


async def test_nothing_is_read_before_its_consumer_asks():
    body = form(("purpose", None, b"batch"), ("file", "a.jsonl", b"x" * 100))
    received = []
    inner = receiver(body, 10)

    async def receive():
        received.append(1)
        return await inner()

    reader = MultipartReader(scope(body), receive, limit=1000, setting="S", timeout=5)
    assert reader.declared == len(body) and received == []
    events = reader.upload().events
    assert await anext(events) == FormField("purpose", "batch")
    read_so_far = len(received)
    assert read_so_far < len(body) // 10
    await events.aclose()
    assert len(received) == read_so_far and not reader.complete


async def test_a_file_over_the_limit_is_a_413_that_closes_the_connection():
    body = form(("file", "in.jsonl", b"x" * 2000))
    with pytest.raises(APIError) as caught:
        await read_multipart(scope(), receiver(body), limit=1000, setting="LLMEP_X", timeout=5)
    assert caught.value.status_code == 413 and "LLMEP_X" in caught.value.message
    assert caught.value.headers["connection"] == "close"
    # Declared too large: refused before reading.
    with pytest.raises(APIError) as caught:
        MultipartReader(scope(b"x" * 1_000_000), receiver(b""), limit=10, setting="S", timeout=5)
    assert caught.value.status_code == 413


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (form(("purpose", None, b"batch")), 400, "file: required"),
        (form(("file", "a", b"1"), ("file", "b", b"2")), 400, "only one file"),
        (form(("data", "a.jsonl", b"1")), 400, "unexpected file field"),
        (form(("purpose", None, b"x" * 70_000)), 400, "at most 65536 bytes"),
        (form(("purpose", None, b"\xff")), 400, "not UTF-8"),
        (form(("file", "a", b"1"))[:-20], 400, "ends before its closing boundary"),
        (
            b"--"
            + BOUNDARY.encode()
            + b"\r\nno-disposition: x\r\n\r\ndata\r\n--"
            + BOUNDARY.encode()
            + b"--",
            400,
            "no form-data name",
        ),
    ],
)
async def test_malformed_uploads_are_a_400_saying_what(body, status, words):
    with pytest.raises(APIError) as caught:
        await read(body, limit=100_000)
    assert caught.value.status_code == status and words in caught.value.message


async def test_other_content_types_and_missing_boundaries():
    body = form(("file", "a", b"1"))
    with pytest.raises(APIError) as caught:
        MultipartReader(scope(body, "application/json"), receiver(body), limit=10, setting="S", timeout=5)  # fmt: skip
    assert caught.value.status_code == 415
    with pytest.raises(APIError) as caught:
        MultipartReader(scope(body, "multipart/form-data"), receiver(body), limit=10, setting="S", timeout=5)  # fmt: skip
    assert caught.value.status_code == 400 and "boundary" in caught.value.message


async def test_a_slow_upload_is_a_408_and_a_client_that_leaves_is_gone():
    body = form(("file", "a", b"1" * 50))
    with pytest.raises(APIError) as caught:
        await read_multipart(scope(body), receiver(body, stall=True), limit=1000, setting="S",
                             timeout=0.2, timeout_setting="LLMEP_T")  # fmt: skip
    assert caught.value.status_code == 408 and "LLMEP_T" in caught.value.message
    with pytest.raises(ClientGone):
        await read_multipart(scope(body), receiver(body, disconnect=True), limit=1000, setting="S", timeout=5)  # fmt: skip


def test_content_disposition_parameters():
    assert content_params('form-data; name="file"; filename="a \\"b\\".jsonl"') == (
        "form-data", {"name": "file", "filename": 'a "b".jsonl'}
    )  # fmt: skip
    assert content_params("multipart/form-data; boundary=abc") == (
        "multipart/form-data", {"boundary": "abc"}
    )  # fmt: skip

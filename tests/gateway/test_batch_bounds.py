"""The Batch API under clients that push its bounds, through a real gateway on a real nats-server
(the stand-in backend serves the endpoint: nothing here runs a request).

- 20 uploads at once against a bound of 5 files store 5: the key's room is reserved by
  compare-and-set before any byte is stored;
- an upload the key has no room for is refused from its headers, before its body is read;
- a thousand listings leave no consumer on the batch records' stream;
- five downloads nobody reads hold a chunk each, not their files;
- a RunPod request id with a digit that is not ASCII is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from pathlib import Path

import httpx
import nats
import psutil
import pytest
import yaml
from integration.nats_kit import NatsServer

from .harness import launch_gateway, running_standins
from .upload_load import MiB, write_requests_file

KEY = "sk-bounds"
MODEL = "standin"
MAX_FILES = 5
MAX_BYTES = 100 * MiB


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batch-bounds")


@pytest.fixture(scope="module")
def nats_server(logs):
    server = NatsServer(store_dir=logs / "nats", log_path=logs / "nats.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(logs, nats_server):
    with running_standins(logs, "s1") as standins:
        endpoints = logs / "endpoints.yaml"
        endpoints.write_text(
            yaml.safe_dump(
                {
                    "endpoints": [
                        {"name": "ep", "models": [MODEL], "backends": [standins["s1"].url]}
                    ],
                    "apiKeys": [
                        {"name": "tenant", "key": KEY},
                        *({"name": f"t{i}", "key": f"sk-t{i}"} for i in range(3)),
                    ],
                }
            )
        )
        proc = launch_gateway(
            logs,
            GATEWAY_ENDPOINTS_FILE=str(endpoints),
            JOBS_QUEUE_URL=nats_server.url,
            LLMEP_BATCH_MAX_FILES_PER_KEY=str(MAX_FILES),
            LLMEP_BATCH_MAX_BYTES_PER_KEY=str(MAX_BYTES),
        )
        try:
            proc.wait_http("/health")
            deadline = time.monotonic() + 60
            while httpx.get(proc.url + "/v1/files", headers=_auth()).status_code != 200:
                assert time.monotonic() < deadline, "the Batch API never came up"
                time.sleep(0.2)
            yield proc
        finally:
            proc.stop()


def _auth(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _line(i: int) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]}
    line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(line).encode() + b"\n"


def _files(gateway, key: str) -> list[dict]:
    return httpx.get(gateway.url + "/v1/files", headers=_auth(key)).json()["data"]


async def _slow_upload(client: httpx.AsyncClient, key: str, i: int) -> httpx.Response:
    """An upload whose body takes a moment to arrive: all 20 are under way together."""
    boundary = "bounds-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="f{i}.jsonl"'
        "\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    data = _line(i)

    async def body():
        yield head
        await asyncio.sleep(0.5)
        yield data + tail

    return await client.post(
        "/v1/files",
        content=body(),
        headers={
            **_auth(key),
            "content-type": f"multipart/form-data; boundary={boundary}",
            "content-length": str(len(head) + len(data) + len(tail)),
        },
    )


def test_20_uploads_at_once_against_a_bound_of_5_store_5(gateway):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            return await asyncio.gather(*(_slow_upload(client, "sk-t0", i) for i in range(20)))

    replies = asyncio.run(run())
    assert sorted(r.status_code for r in replies) == [200] * MAX_FILES + [429] * 15
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.json()["error"]["code"] == "file_limit_exceeded"
    assert "LLMEP_BATCH_MAX_FILES_PER_KEY" in refused.json()["error"]["message"]
    stored = sorted(f["id"] for f in _files(gateway, "sk-t0"))
    assert stored == sorted(r.json()["id"] for r in replies if r.status_code == 200)


def test_an_upload_without_room_is_refused_before_its_body_is_read(gateway):
    """The key's bound is checked from the headers: a 150 MB upload against a 100 MiB bound is
    answered 429 (connection closed) after a few bytes, nothing of it stored or spooled."""
    host, port = "127.0.0.1", gateway.port
    boundary = "b"
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(
            (
                "POST /v1/files HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer sk-t1\r\nContent-Length: {150 * 1000 * 1000}\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                'filename="big.jsonl"\r\n\r\n'
            ).encode()
        )
        answer = b""
        while chunk := sock.recv(65536):  # until the gateway closes the connection
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.lower().startswith(b"http/1.1 429"), head
    assert b"connection: close" in head.lower()
    assert b"LLMEP_BATCH_MAX_BYTES_PER_KEY" in body or b"storage_limit_exceeded" in body
    assert _files(gateway, "sk-t1") == []


def test_a_thousand_listings_leave_no_consumer(gateway, nats_server):
    for i in range(2):
        data = _line(i)
        httpx.post(
            gateway.url + "/v1/files",
            headers=_auth("sk-t2"),
            data={"purpose": "batch"},
            files={"file": ("f.jsonl", data)},
        ).raise_for_status()
    with httpx.Client(base_url=gateway.url, headers=_auth("sk-t2"), timeout=30) as client:
        for i in range(1000):
            path = "/v1/files" if i % 2 else "/v1/batches"
            reply = client.get(path)
            assert reply.status_code == 200, reply.text

    async def consumers() -> int:
        nc = await nats.connect(nats_server.url)
        try:
            info = await nc.jetstream().stream_info("KV_LLMEP_BATCHES")
            return info.state.consumer_count
        finally:
            await nc.close()

    assert asyncio.run(consumers()) == 0


def test_downloads_nobody_reads_hold_a_chunk_each_not_their_files(gateway, logs):
    """Five downloads of a 40 MB file left unread: each is sent as the client takes it, so the
    gateway holds a chunk per download, not a file."""
    path = write_requests_file(logs / "download.jsonl", 20_000, 2_000, MODEL)
    with path.open("rb") as handle:
        uploaded = httpx.post(
            gateway.url + "/v1/files",
            headers=_auth(),
            data={"purpose": "batch"},
            files={"file": ("download.jsonl", handle)},
            timeout=300,
        )
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    tree = [psutil.Process(gateway.process.pid), *psutil.Process(gateway.process.pid).children()]
    before = sum(p.memory_info().rss for p in tree)
    socks = []
    try:
        for _ in range(5):
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.sendall(
                f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {KEY}\r\n\r\n".encode()
            )
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            socks.append(sock)
        time.sleep(3)  # whatever the gateway would read ahead, it has read by now
        peak = sum(p.memory_info().rss for p in tree)
        assert (peak - before) / MiB <= 32, (before / MiB, peak / MiB)
        # A download that is read arrives whole.
        whole = httpx.get(
            gateway.url + f"/v1/files/{file_id}/content", headers=_auth(), timeout=300
        )
        assert whole.content == path.read_bytes()
    finally:
        for sock in socks:
            sock.close()


def test_a_runpod_request_id_with_a_digit_that_is_not_ascii_is_a_400(gateway):
    with httpx.Client(base_url=gateway.url + "/v2/ep", headers=_auth(), timeout=30) as http:
        batch = http.post("/batch", json=[{"input": {"prompt": "a"}}]).json()
        prefix = batch["id"].removeprefix("batch_")
        for odd in ("\u00b2", "\u0661", "x"):  # superscript two, Arabic-Indic one, a letter
            reply = http.delete(f"/batch/{batch['id']}/requests/{prefix}-{odd}")
            assert reply.status_code == 400, (odd, reply.text)
            assert reply.json()["error"]["param"] == "requestId"
        listing = http.get(f"/batch/{batch['id']}/requests", params={"limit": "\u00b2"})
        assert listing.status_code == 400 and listing.json()["error"]["param"] == "limit"
        http.post(f"/batch/{batch['id']}/cancel")


def _driver_hosts(gateway) -> list[psutil.Process]:
    hosts = []
    for child in psutil.Process(gateway.process.pid).children():
        # A host just killed is a zombie until the supervisor reaps it: not a host any more.
        with contextlib.suppress(psutil.ZombieProcess, psutil.NoSuchProcess):
            if "--batch-drivers" in child.cmdline():
                hosts.append(child)
    return hosts


def _create_batch(gateway, key: str) -> str:
    uploaded = httpx.post(
        gateway.url + "/v1/files",
        headers=_auth(key),
        data={"purpose": "batch"},
        files={"file": ("f.jsonl", _line(0))},
    )
    assert uploaded.status_code == 200, uploaded.text
    created = httpx.post(
        gateway.url + "/v1/batches",
        headers=_auth(key),
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert created.status_code == 200, created.text
    return created.json()["id"]


def _status(gateway, key: str, batch_id: str) -> str:
    return httpx.get(gateway.url + f"/v1/batches/{batch_id}", headers=_auth(key)).json()["status"]


def test_only_the_driver_host_drives_batches_and_the_supervisor_brings_it_back(gateway):
    """The pod is a supervisor, its serving worker and one batch driver host; with the host
    stopped no batch moves (the worker drives none), and a host that dies is started again."""
    children = psutil.Process(gateway.process.pid).children()
    assert sum("--worker" in p.cmdline() for p in children) == 1
    (host,) = _driver_hosts(gateway)
    host.suspend()
    try:
        batch_id = _create_batch(gateway, "sk-t1")
        time.sleep(3)  # six of a driver's ticks
        assert _status(gateway, "sk-t1", batch_id) == "validating"
    finally:
        host.resume()
    deadline = time.monotonic() + 60
    while _status(gateway, "sk-t1", batch_id) == "validating":
        assert time.monotonic() < deadline, "the driver host never took the batch up"
        time.sleep(0.2)
    # Taken up: its one request may already be answered (a quiet machine, a quick stand-in).
    assert _status(gateway, "sk-t1", batch_id) in ("in_progress", "finalizing", "completed")
    host.kill()
    deadline = time.monotonic() + 60
    while not [p for p in _driver_hosts(gateway) if p.pid != host.pid]:
        assert time.monotonic() < deadline, "the supervisor did not start a new driver host"
        time.sleep(0.2)
    second = _create_batch(gateway, "sk-t1")
    deadline = time.monotonic() + 60
    while _status(gateway, "sk-t1", second) == "validating":
        assert time.monotonic() < deadline, "the new driver host never took the batch up"
        time.sleep(0.2)
    assert _status(gateway, "sk-t1", second) in ("in_progress", "finalizing", "completed")
    for batch in (batch_id, second):
        httpx.post(gateway.url + f"/v1/batches/{batch}/cancel", headers=_auth("sk-t1"))

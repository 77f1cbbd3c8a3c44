from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from llmendpoints_common.destinations import DestinationPolicy
from llmendpoints_common.webhooks import WebhookSender, final_status


class Recorder:
    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes
        self.calls = 0

    async def __call__(self, url: str, payload: dict) -> int:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def sender(post: Recorder, sleeps: list[float]) -> WebhookSender:
    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    return WebhookSender(retries=2, delay_seconds=10, timeout_seconds=1, post=post, sleep=sleep)


async def test_tried_once_and_retried_twice_ten_seconds_apart() -> None:
    sleeps: list[float] = []
    post = Recorder([ConnectionError("refused"), 502, 500])
    assert await sender(post, sleeps).send("http://x", {"id": "j"}) is False
    assert post.calls == 3 and sleeps == [10, 10]


async def test_first_2xx_ends_delivery() -> None:
    sleeps: list[float] = []
    post = Recorder([500, 204])
    assert await sender(post, sleeps).send("http://x", {"id": "j"}) is True
    assert post.calls == 2 and sleeps == [10]


async def test_a_slow_receiver_does_not_block_the_caller() -> None:
    release = asyncio.Event()

    async def slow_post(url: str, payload: dict) -> int:
        await release.wait()
        return 200

    webhooks = WebhookSender(retries=0, delay_seconds=0, timeout_seconds=1, post=slow_post)
    task = webhooks.send("http://x", {"id": "j"})  # returns at once
    assert not task.done()
    release.set()
    assert await task is True
    await webhooks.aclose()


async def test_aclose_waits_for_deliveries_and_abandons_them_past_its_timeout() -> None:
    release = asyncio.Event()
    delivered: list[str] = []

    async def post(url: str, payload: dict) -> int:
        if url == "http://stuck":
            await asyncio.Event().wait()  # never answers
        await release.wait()
        delivered.append(url)
        return 200

    webhooks = WebhookSender(retries=0, delay_seconds=0, timeout_seconds=1, post=post)
    quick = webhooks.send("http://quick", {"id": "a"})
    stuck = webhooks.send("http://stuck", {"id": "b"})
    assert webhooks.pending == 2
    asyncio.get_running_loop().call_later(0.01, release.set)
    await webhooks.aclose(timeout=0.2)
    assert delivered == ["http://quick"] and await quick is True
    assert stuck.cancelled() and webhooks.pending == 0


# -- the destination check, end to end: real HTTP on loopback, names resolved by a test resolver


class Receiver:
    """A real HTTP server on 127.0.0.1 answering each POST with the next status in ``answers``
    (then 200), recording what it received."""

    def __init__(
        self,
        answers: list[tuple[int, dict[str, str]]] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.answers = list(answers or [])
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.server: asyncio.Server | None = None
        self.tls = tls

    async def __aenter__(self) -> Receiver:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls)
        self.port: int = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {
            k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)
        }
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.requests.append((head[0], headers, body))
        status, extra = self.answers.pop(0) if self.answers else (200, {})
        lines = [f"HTTP/1.1 {status} X", "content-length: 0", "connection: close"]
        lines += [f"{k}: {v}" for k, v in extra.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        writer.close()


def resolving(table: dict[str, list[str]], calls: list[str] | None = None):
    async def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append(host)
        return table[host]

    return resolve


async def test_delivery_connects_to_the_checked_address_and_names_the_host() -> None:
    async with Receiver([(500, {})]) as receiver:
        webhooks = WebhookSender(
            retries=1,
            delay_seconds=0,
            timeout_seconds=5,
            resolver=resolving({"receiver.test": ["127.0.0.1"]}),
        )
        url = f"http://receiver.test:{receiver.port}/hook?token=t"
        assert await webhooks.send(url, {"id": "j1", "status": "COMPLETED"}) is True
        await webhooks.aclose()
    assert [r[0] for r in receiver.requests] == ["POST /hook?token=t HTTP/1.1"] * 2
    assert receiver.requests[1][1]["host"] == f"receiver.test:{receiver.port}"
    assert b'"id":"j1"' in receiver.requests[1][2].replace(b" ", b"")


async def test_a_name_resolving_to_a_refused_address_is_never_contacted(caplog) -> None:
    calls: list[str] = []
    async with Receiver() as receiver:
        # "rebinding.test" passed the submission check (a name); now it resolves to the metadata
        # address -- and to the receiver, which must not be contacted either.
        webhooks = WebhookSender(
            retries=2,
            delay_seconds=0,
            timeout_seconds=5,
            resolver=resolving({"rebinding.test": ["127.0.0.1", "169.254.169.254"]}, calls),
        )
        url = f"http://user:secret@rebinding.test:{receiver.port}/hook?token=t0ken"
        assert await webhooks.send(url, {"id": "j2"}) is False
        await webhooks.aclose()
    assert receiver.requests == []
    assert calls == ["rebinding.test"]  # refused once, not retried
    assert "169.254.169.254" in caplog.text and "metadata" in caplog.text
    assert "secret" not in caplog.text and "t0ken" not in caplog.text


async def test_redirects_are_not_followed() -> None:
    async with Receiver() as elsewhere, Receiver() as receiver:
        receiver.answers = [(307, {"location": f"http://127.0.0.1:{elsewhere.port}/"})]
        webhooks = WebhookSender(retries=0, delay_seconds=0, timeout_seconds=5)
        assert await webhooks.send(f"http://127.0.0.1:{receiver.port}/", {"id": "j3"}) is False
        await webhooks.aclose()
    assert len(receiver.requests) == 1 and elsewhere.requests == []


async def test_only_http_and_https_are_posted_to(caplog) -> None:
    webhooks = WebhookSender(retries=2, delay_seconds=0, timeout_seconds=5)
    assert await webhooks.send("ftp://127.0.0.1:9/x", {"id": "j9"}) is False
    await webhooks.aclose()
    assert "job j9 refused, not retried: scheme 'ftp' is not allowed" in caplog.text


async def test_the_allow_list_applies_at_delivery() -> None:
    async with Receiver() as receiver:
        webhooks = WebhookSender(
            retries=0,
            delay_seconds=0,
            timeout_seconds=5,
            policy=DestinationPolicy.parse("hooks.example.com"),
        )
        assert await webhooks.send(f"http://127.0.0.1:{receiver.port}/", {"id": "j4"}) is False
        await webhooks.aclose()
    assert receiver.requests == []


# -- what one receiver can cost: real receivers on 127.0.0.1 that misbehave


async def until(predicate, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


class Misbehaving:
    """A real server on 127.0.0.1: reads each request whole, then runs ``answer(writer)``;
    records whether the sender closed the connection (a write failed)."""

    def __init__(self) -> None:
        self.accepted = 0
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port: int = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        await reader.readexactly(length)
        try:
            await self.answer(writer)
        except OSError:  # the sender closed the connection (reset, broken pipe)
            self.closed.set()
        finally:
            writer.close()

    async def answer(self, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class EndlessBody(Misbehaving):
    """200, then body bytes for as long as the connection lasts; counts what it got out."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    async def answer(self, writer: asyncio.StreamWriter) -> None:
        # A small send buffer of our own, so what we count is close to what reached the sender
        # (our kernel buffer, the sender's receive buffer, what it read).
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n"
        )  # no length: until close
        chunk = b"x" * 16384
        while True:
            writer.write(chunk)
            await writer.drain()
            self.sent += len(chunk)


class Trickle(Misbehaving):
    """Never finishes its status line: a byte every 0.05 s, for as long as the connection lasts."""

    async def answer(self, writer: asyncio.StreamWriter) -> None:
        for byte in itertools.chain(b"HTTP/1.1 200 ", itertools.repeat(ord("K"))):
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)


async def test_an_endless_answer_is_not_read() -> None:
    async with EndlessBody() as receiver:
        webhooks = WebhookSender(retries=0, delay_seconds=0, timeout_seconds=60)
        async with asyncio.timeout(120):
            # Delivered on the status line, and the connection is closed unread.
            assert await webhooks.send(f"http://127.0.0.1:{receiver.port}/", {"id": "j5"}) is True
            await until(receiver.closed.is_set)
        await webhooks.aclose()
    # Reading the answer would take it all: gigabytes in the 60 s the attempt may last. What
    # got out before the close fits in the socket buffers and one read of the HTTP client.
    assert receiver.accepted == 1
    assert receiver.sent < 1024 * 1024, receiver.sent


async def test_a_trickling_receiver_fails_at_the_deadline_and_is_logged(caplog) -> None:
    async with Trickle() as receiver:
        webhooks = WebhookSender(
            retries=1,
            delay_seconds=0,
            timeout_seconds=1,
            resolver=resolving({"slow.test": ["127.0.0.1"]}),
        )
        url = f"http://user:s3cret@slow.test:{receiver.port}/hook/p4th?token=t0ken"
        with caplog.at_level(logging.WARNING, logger="llmendpoints_common.webhooks"):
            async with asyncio.timeout(60):  # no deadline per attempt: this would never end
                assert await webhooks.send(url, {"id": "job-trickle"}) is False
                await until(receiver.closed.is_set)  # the socket was let go
        await webhooks.aclose()
    assert receiver.accepted == 2  # the attempt and its retry, each given up
    failures = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()]
    assert len(failures) == 2, caplog.text
    for n, line in enumerate(failures, 1):
        assert line.startswith(f"webhook for job job-trickle to http://slow.test:{receiver.port}:")
        assert f"attempt {n}/2 failed" in line
        assert "within 1 s (WEBHOOK_TIMEOUT_SECONDS)" in line
    for secret in ("s3cret", "user", "t0ken", "token", "p4th"):
        assert secret not in caplog.text


async def test_at_most_max_concurrency_attempts_at_once_and_the_rest_wait() -> None:
    class Holding(Misbehaving):
        """Keeps each connection unanswered until the test lets one through."""

        def __init__(self) -> None:
            super().__init__()
            self.open = self.most_open = 0
            self.gate = asyncio.Semaphore(0)

        async def answer(self, writer: asyncio.StreamWriter) -> None:
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            await self.gate.acquire()
            self.open -= 1  # before answering: the sender can only reconnect after the answer
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

    async with Holding() as receiver:
        webhooks = WebhookSender(retries=0, delay_seconds=0, timeout_seconds=120)  # cap: 64
        tasks = [
            webhooks.send(f"http://127.0.0.1:{receiver.port}/{i}", {"id": f"j{i}"})
            for i in range(65)
        ]
        await until(lambda: receiver.open == 64)
        assert webhooks.pending == 65  # the one waiting for a slot counts (a drain waits for it)
        # A 65th connection would be there by now; with the cap it can never be.
        await asyncio.sleep(0.5)
        assert receiver.accepted == 64 and receiver.open == 64
        receiver.gate.release()  # one answer frees one slot: the 65th gets it
        await until(lambda: receiver.accepted == 65)
        for _ in range(64):
            receiver.gate.release()
        await webhooks.aclose(timeout=120)  # drains every delivery, the late one included
    assert all(task.result() is True for task in tasks)
    assert receiver.most_open == 64


async def test_failure_reasons_are_escaped_and_never_repeat_the_url(caplog) -> None:
    url = "http://u:pw@x.test/p?sig=abc123"

    async def post(target: str, payload: dict) -> int:
        raise RuntimeError(f"bad answer from {target}\n2026 INFO forged [sig=abc123]")

    webhooks = WebhookSender(retries=0, delay_seconds=0, timeout_seconds=1, post=post)
    assert await webhooks.send(url, {"id": "j6"}) is False
    (record,) = [r for r in caplog.records if "attempt" in r.getMessage()]
    message = record.getMessage()
    assert "\n" not in message and "\\n2026 INFO forged" in message
    assert "abc123" not in message and "pw" not in message and "/p" not in message
    assert message.startswith(
        "webhook for job j6 to http://x.test: attempt 1/1 failed: RuntimeError"
    )


def certificates(folder: Path, name: str) -> tuple[Path, Path, Path]:
    """A test CA and a certificate for ``name`` that it signed: (ca.pem, cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def build(subject: str, issuer: str, key, signer, *, ca: bool):
        now = datetime.now(UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
            )
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("test CA", "test CA", ca_key, ca_key, ca=True)
    cert = build(name, "test CA", key, ca_key, ca=False)
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


async def test_https_checks_the_certificate_for_the_url_host_at_the_checked_address(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    ca, cert, key = certificates(tmp_path, "hooks.test")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # the sender trusts the test CA (as httpx did)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    names: list[str | None] = []
    server_side.sni_callback = lambda _socket, name, _context: names.append(name)
    async with Receiver(tls=server_side) as receiver:
        webhooks = WebhookSender(
            retries=0,
            delay_seconds=0,
            timeout_seconds=30,
            resolver=resolving({"hooks.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}),
        )
        good = f"https://hooks.test:{receiver.port}/in?k=v"
        assert await webhooks.send(good, {"id": "tls-1"}) is True
        # The same address under a name its certificate does not carry: refused by TLS.
        assert await webhooks.send(f"https://other.test:{receiver.port}/", {"id": "tls-2"}) is False
        await webhooks.aclose()
    assert names == ["hooks.test", "other.test"]
    assert [(r[0], r[1]["host"]) for r in receiver.requests] == [
        ("POST /in?k=v HTTP/1.1", f"hooks.test:{receiver.port}")
    ]
    assert "job tls-2" in caplog.text and "CERTIFICATE_VERIFY_FAILED" in caplog.text


async def test_credentials_in_the_url_are_sent_as_basic_auth() -> None:
    async with Receiver() as receiver:
        webhooks = WebhookSender(retries=0, delay_seconds=0, timeout_seconds=30)
        url = f"http://us%20er:p%40ss@127.0.0.1:{receiver.port}/"
        assert await webhooks.send(url, {"id": "j7", "x": "é"}) is True
        await webhooks.aclose()
    ((_, headers, body),) = receiver.requests
    assert headers["authorization"] == "Basic dXMgZXI6cEBzcw=="  # "us er:p@ss"
    assert headers["content-type"] == "application/json"
    assert body == '{"id":"j7","x":"é"}'.encode()


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"HTTP/1.1 204 No Content\r\n", 204),
        (b"HTTP/1.0 500\r\n", 500),
        (b"HTTP/1.1 200 OK", None),  # the line is not over yet
        (b"HTT", None),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nx: y\r\n", 201),
        (b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n", None),  # its head is not over
        (b"HTTP/1.1 101 Switching Protocols\r\n", 101),  # not asked for: final, a failure
    ],
)
def test_final_status(head: bytes, status: int | None) -> None:
    assert final_status(head) == status


@pytest.mark.parametrize(
    "head", [b"SSH-2.0-OpenSSH\r\n", b"\x16\x03\x01", b"HTTP/1.1 2000 OK\r\n", b"HTTP/2 200\r\n"]
)
def test_what_is_not_an_http_answer_is_refused_early(head: bytes) -> None:
    with pytest.raises(ValueError, match=r"not an HTTP/1\.x"):
        final_status(head)


async def test_a_status_line_that_never_ends_fails_after_a_few_kib(caplog) -> None:
    class Babbling(Misbehaving):
        async def answer(self, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 " + b"K" * 65536)
            await writer.drain()
            await asyncio.Event().wait()

    async with Babbling() as receiver:
        webhooks = WebhookSender(retries=0, delay_seconds=0, timeout_seconds=60)
        assert await webhooks.send(f"http://127.0.0.1:{receiver.port}/", {"id": "j8"}) is False
        await webhooks.aclose()
    assert "no status line in the answer's first 8192 bytes" in caplog.text

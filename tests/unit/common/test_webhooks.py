from __future__ import annotations

import asyncio

from llmendpoints_common.destinations import DestinationPolicy
from llmendpoints_common.webhooks import WebhookSender


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

    def __init__(self, answers: list[tuple[int, dict[str, str]]] | None = None) -> None:
        self.answers = list(answers or [])
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Receiver:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
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

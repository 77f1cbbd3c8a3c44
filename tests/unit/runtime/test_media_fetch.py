"""The guarded media fetcher against real HTTP servers on loopback.

"Refused" destinations here are loopback addresses outside a policy's allow-list (127.0.0.2),
never real non-loopback ones: if the guard failed, the packet would still stay on this machine,
and the server there counts it. (The metadata address itself is tested in a private network
namespace: tests/runtime/test_images.py.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from llmendpoints_common.destinations import DestinationPolicy
from llmendpoints_runtime.compose import build_runtime
from llmendpoints_runtime.config import ConfigError, load_config
from llmendpoints_runtime.media_fetch import (
    MediaFetcher,
    MediaFetchError,
    MediaFetchLimits,
    media_policy,
)

PNG_BYTES = b"\x89PNG\r\n\x1a\n" + b"x" * 100


class Host:
    """An HTTP server on `address` whose routes are (status, headers, body, delay)."""

    def __init__(self, address: str):
        self.hits: list[str] = []
        self.routes: dict[str, tuple[int, dict[str, str], bytes, float]] = {}
        host = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                host.hits.append(self.path)
                status, headers, body, delay = host.routes.get(self.path, (404, {}, b"", 0))
                time.sleep(delay)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Transfer-Encoding" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if headers.get("Transfer-Encoding") == "chunked":
                    for start in range(0, len(body), 4096):
                        piece = body[start : start + 4096]
                        self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((address, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def good() -> Iterator[Host]:
    host = Host("127.0.0.1")
    yield host
    host.close()


@pytest.fixture
def forbidden() -> Iterator[Host]:
    host = Host("127.0.0.2")
    host.routes["/secret"] = (200, {}, PNG_BYTES, 0)
    yield host
    host.close()


ONLY_127_0_0_1 = DestinationPolicy(allowed=("127.0.0.1/32",))
LIMITS = MediaFetchLimits(timeout=5, attempts=1, max_bytes=1024 * 1024)


def fetch(url: str, policy=ONLY_127_0_0_1, limits=LIMITS, resolver=None) -> bytes:
    async def run() -> bytes:
        fetcher = MediaFetcher(policy, resolver=resolver)
        try:
            return await fetcher.fetch(url, limits)
        finally:
            await fetcher.close()

    return asyncio.run(run())


def test_fetches_an_allowed_url(good) -> None:
    good.routes["/a.png"] = (200, {}, PNG_BYTES, 0)
    assert fetch(good.url("/a.png")) == PNG_BYTES


def test_a_refused_literal_address_is_never_contacted(forbidden) -> None:
    with pytest.raises(MediaFetchError, match=r"refused: .*127\.0\.0\.2"):
        fetch(forbidden.url("/secret"))
    assert forbidden.hits == []


def test_a_name_is_checked_after_dns_and_never_contacted(forbidden) -> None:
    async def resolver(host: str, port: int) -> list[str]:
        return {"innocent.test": ["127.0.0.2"]}[host]

    port = forbidden.server.server_address[1]
    with pytest.raises(MediaFetchError, match=r"innocent\.test resolves to 127\.0\.0\.2"):
        fetch(f"http://innocent.test:{port}/secret", resolver=resolver)
    assert forbidden.hits == []


def test_every_redirect_hop_is_checked(good, forbidden) -> None:
    good.routes["/hop"] = (302, {"Location": forbidden.url("/secret")}, b"", 0)
    with pytest.raises(MediaFetchError, match=r"redirected from http://127\.0\.0\.1:\d+/hop"):
        fetch(good.url("/hop"))
    assert good.hits == ["/hop"] and forbidden.hits == []


def test_allowed_redirects_are_followed_relative_ones_too(good) -> None:
    good.routes["/one"] = (301, {"Location": "/two"}, b"", 0)
    good.routes["/two"] = (307, {"Location": good.url("/a.png")}, b"", 0)
    good.routes["/a.png"] = (200, {}, PNG_BYTES, 0)
    assert fetch(good.url("/one")) == PNG_BYTES
    assert good.hits == ["/one", "/two", "/a.png"]


def test_redirects_are_not_followed_when_disabled(good) -> None:
    good.routes["/hop"] = (302, {"Location": "/a.png"}, b"", 0)
    limits = MediaFetchLimits(timeout=5, attempts=1, follow_redirects=False)
    with pytest.raises(MediaFetchError, match="VLLM_MEDIA_URL_ALLOW_REDIRECTS=0"):
        fetch(good.url("/hop"), limits=limits)
    assert good.hits == ["/hop"]


def test_a_redirect_loop_ends(good) -> None:
    good.routes["/loop"] = (302, {"Location": "/loop"}, b"", 0)
    with pytest.raises(MediaFetchError, match="more than 5 redirects"):
        fetch(good.url("/loop"))
    assert len(good.hits) == 6


def test_other_schemes_are_refused() -> None:
    with pytest.raises(MediaFetchError, match="scheme 'ftp' is not allowed"):
        fetch("ftp://127.0.0.1/a.png")


def test_a_4xx_is_an_error_and_not_retried(good) -> None:
    limits = MediaFetchLimits(timeout=5, attempts=3)
    with pytest.raises(MediaFetchError, match="HTTP 404"):
        fetch(good.url("/missing.png"), limits=limits)
    assert good.hits == ["/missing.png"]


def test_a_5xx_is_retried(good) -> None:
    good.routes["/flaky"] = (503, {}, b"", 0)
    limits = MediaFetchLimits(timeout=5, attempts=2)
    with pytest.raises(MediaFetchError, match=r"HTTP 503 \(after 2 attempts\)"):
        fetch(good.url("/flaky"), limits=limits)
    assert good.hits == ["/flaky", "/flaky"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_size_bound_is_refused(good, chunked) -> None:
    headers = {"Transfer-Encoding": "chunked"} if chunked else {}
    good.routes["/big"] = (200, headers, b"x" * 100_000, 0)
    limits = MediaFetchLimits(timeout=5, attempts=1, max_bytes=50_000)
    with pytest.raises(MediaFetchError, match="larger than the media download limit of 50000"):
        fetch(good.url("/big"), limits=limits)


def test_a_slow_host_times_out(good) -> None:
    good.routes["/slow"] = (200, {}, PNG_BYTES, 2.0)
    limits = MediaFetchLimits(timeout=0.3, attempts=1)
    with pytest.raises(MediaFetchError, match=r"no complete answer within 0\.3 s"):
        fetch(good.url("/slow"), limits=limits)


def test_errors_name_the_url_without_credentials_or_query(forbidden) -> None:
    port = forbidden.server.server_address[1]
    with pytest.raises(MediaFetchError) as caught:
        fetch(f"http://user:hunter2@127.0.0.2:{port}/secret?token=abc")
    assert "hunter2" not in str(caught.value) and "token" not in str(caught.value)
    assert f"http://127.0.0.2:{port}/secret" in str(caught.value)


def test_the_blocking_path_works_inside_and_outside_an_event_loop(good) -> None:
    good.routes["/a.png"] = (200, {}, PNG_BYTES, 0)
    fetcher = MediaFetcher(ONLY_127_0_0_1)
    assert fetcher.fetch_blocking(good.url("/a.png"), LIMITS) == PNG_BYTES

    async def inside() -> bytes:
        return fetcher.fetch_blocking(good.url("/a.png"), LIMITS)

    assert asyncio.run(inside()) == PNG_BYTES


def test_allowed_media_domains_is_the_allow_list_of_every_hop(good) -> None:
    good.routes["/to-other"] = (302, {"Location": "http://other.test/a.png"}, b"", 0)

    async def resolver(host: str, port: int) -> list[str]:
        return {"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}[host]

    policy = media_policy(["images.test"])
    port = good.server.server_address[1]
    with pytest.raises(MediaFetchError, match=r"'other\.test' is not in the allowed destinations"):
        fetch(f"http://images.test:{port}/to-other", policy=policy, resolver=resolver)
    assert good.hits == ["/to-other"]


def test_a_bad_allowed_media_domains_entry_names_the_variable() -> None:
    # A URL where a host name belongs: the usual mistake.
    with pytest.raises(ValueError, match=r"'https://images\.example\.com' is neither a host name"):
        media_policy(["https://images.example.com"])
    config = load_config({"MODEL_NAME": "m", "ALLOWED_MEDIA_DOMAINS": "https://images.example.com"})
    with pytest.raises(ConfigError, match=r"ALLOWED_MEDIA_DOMAINS: 'https://images\.example\.com'"):
        build_runtime(config)

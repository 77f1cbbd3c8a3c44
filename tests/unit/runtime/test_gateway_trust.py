"""The gateway's word about who calls is believed only with the endpoint's gateway token
(GATEWAY_TOKEN_FILE): a pod never sees a client's key through the gateway, and a client that
talks to the pod directly cannot claim to be someone else (tenancy issue; the gateway's side is
tests/gateway/test_tenancy.py)."""

from __future__ import annotations

import pytest
from llmendpoints_common.gateway_token import derive
from llmendpoints_runtime.auth import APIKeyMiddleware, KeyStore, caller

SECRET = b"a-gateway-token-secret-of-32-bytes!"
TOKEN = derive(SECRET, "team-a/chat")


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "gateway-token"
    path.write_text(TOKEN + "\n")
    return str(path)


async def _call(store: KeyStore, headers: list[tuple[bytes, bytes]]):
    seen: dict = {}

    async def app(scope, receive, send):
        seen["caller"] = caller(scope)
        seen["headers"] = dict(scope["headers"])

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": headers}
    await APIKeyMiddleware(app, store, frozenset({"/health"}))(scope, None, send)
    return seen, (sent[0]["status"] if sent else None)


@pytest.mark.parametrize("keys", [(), ("user-key",)])
async def test_the_token_makes_the_named_caller_the_owner(token_file, keys):
    store = KeyStore(keys, None, gateway_token_file=token_file)
    seen, status = await _call(
        store,
        [(b"authorization", f"Bearer {TOKEN}".encode()), (b"x-llmep-caller", b"team%20a%2Fbob")],
    )
    assert status is None and seen["caller"] == ("team a/bob", False)  # never an admin


async def test_without_the_token_the_caller_header_is_dropped(token_file):
    store = KeyStore(("user-key",), None, gateway_token_file=token_file)
    seen, _ = await _call(
        store, [(b"authorization", b"Bearer user-key"), (b"x-llmep-caller", b"someone-else")]
    )
    assert seen["caller"][0].startswith("key-") and seen["caller"][0] != "someone-else"
    assert b"x-llmep-caller" not in seen["headers"]
    # an open endpoint (no API keys): still nobody but the gateway may name a caller
    open_store = KeyStore((), None, gateway_token_file=token_file)
    seen, _ = await _call(open_store, [(b"x-llmep-caller", b"someone-else")])
    assert seen["caller"] == ("", False)


async def test_another_endpoints_token_is_no_key_here(token_file):
    store = KeyStore(("user-key",), None, gateway_token_file=token_file)
    other = derive(SECRET, "team-b/chat")
    seen, status = await _call(
        store, [(b"authorization", f"Bearer {other}".encode()), (b"x-llmep-caller", b"x")]
    )
    assert status == 401 and not seen

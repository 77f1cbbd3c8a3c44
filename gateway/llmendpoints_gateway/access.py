"""Who is asking, and may they use this endpoint: the caller's key from the request's headers
(before any of its body is read), and the 401 answers.

A key (``keys.Key``) has a name -- the tenant, what logs, metrics, usage records and jobs carry,
never the secret -- the endpoints it may use, ``admin`` and its limits. With
GATEWAY_REQUIRE_KEYS (the default) every request needs a valid key, whatever keys exist: a
request without one is refused from its headers alone, and a gateway with no key at all
refuses everything (it fails closed). Otherwise an endpoint needs a key when the gateway has
keys of its own or the endpoint has some (``KeyRing.requires_key``).

A key that may not use an endpoint is told nothing about it: its models are models that do not
exist (404), its ``/v2/{endpoint}`` is an endpoint that does not exist (404).
"""

from __future__ import annotations

from llmendpoints_common.errors import APIError, AuthenticationError, ServiceUnavailableError
from llmendpoints_edge.asgi import Scope

from llmendpoints_gateway.keys import Key, KeyRing
from llmendpoints_gateway.registry import Endpoint, Registry
from llmendpoints_gateway.request import RequestLog

# The key name of requests without a key (an endpoint open to all).
ANONYMOUS = ""


class Access:
    def __init__(self, keys: KeyRing, registry: Registry):
        self.keys = keys
        self.registry = registry

    def allows(self, key: Key | None, ep: Endpoint) -> bool:
        # A key may list an endpoint as "<namespace>/<name>", or by its bare name while that
        # name is unique across namespaces: another tenant's same-named endpoint in another
        # namespace never inherits it.
        unique = ep.name if self.registry.by_unique_name(ep.name) is ep else None
        return self.keys.allows(key, ep.id, unique)

    def identify(self, scope: Scope, state: RequestLog) -> Key | None:
        """The caller's key, or None. An unknown key is as good as none: it is refused (401)
        only where a key is needed, so open endpoints stay open to clients that always send
        one (the openai SDK insists on an api_key)."""
        key, sent = self.keys.identify_headers(scope["headers"])
        if key is None:
            state.invalid_key = sent
            return None
        state.key_name = key.name
        return key

    def require(self, key: Key | None, state: RequestLog) -> None:
        """401 at once, from the headers, when every request needs a key and this has none
        valid (nothing of the body is read: the connection closes if one was announced); 503
        while the keys are not known yet (Kubernetes: before the first listing of the key
        Secrets), so no request passes before they are."""
        if self.keys.awaiting_secrets:
            raise ServiceUnavailableError(
                "the gateway has not read its API keys yet; retry shortly",
                headers={"retry-after": "2"},
            )
        if key is None and self.keys.requires_key_everywhere:
            raise self.missing_key(state)

    def check(self, key: Key | None, ep: Endpoint, state: RequestLog, hidden: APIError) -> None:
        """401 without a (valid) key where one is needed; ``hidden`` (the 404 of a thing that
        does not exist) for a key that may not use this endpoint."""
        if self.allows(key, ep):
            return
        if key is None:
            raise self.missing_key(state)
        raise hidden

    def missing_key(self, state: RequestLog) -> APIError:
        reason = "invalid API key" if state.invalid_key else "missing API key"
        return AuthenticationError(
            f"{reason}: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
            headers={"www-authenticate": "Bearer"},
        )

    def visible(self, key: Key | None, endpoints: list[Endpoint]) -> list[Endpoint]:
        return [ep for ep in endpoints if self.allows(key, ep)]

    @staticmethod
    def caller(key: Key | None) -> tuple[str, bool]:
        """(the caller's name, admin): who owns what it submits, and whether it sees all."""
        if key is None:
            return ANONYMOUS, False
        return key.name, key.admin

"""API keys and what each may use.

A key (docs/security.md, "Tenancy") has a name (the tenant: what logs, metrics, usage
records and queued jobs carry; never the secret), the endpoints it may use (None: all),
``admin``, and optional limits (quotas.py: requestsPerMinute, tokensPerMinute, maxConcurrent).

Sources, all merged into one lookup:

- ``API_KEYS``: comma-separated secrets valid on every endpoint, each named ``key-<12 hex>``
  (a short hash of the secret);
- ``API_KEYS_FILE``: the runtime's format (one secret per line, ``#`` comments) or YAML
  ``keys: [{name, key, endpoints?, admin?}]``; re-read when its modification time changes;
- ``apiKeys: [{name, key | keySha256, endpoints?, limits?, admin?}]`` in GATEWAY_ENDPOINTS_FILE
  (the local form, re-read when it changes): when the file has ``apiKeys``, every request needs
  one of them;
- in Kubernetes, Secrets labelled ``llmendpoints.dev/api-key`` (discovery/kube.py, watched: a
  new, changed or deleted Secret takes effect at once), same fields;
- in Kubernetes, each endpoint's ``spec.api.apiKeysSecretRef``: secrets valid on that endpoint
  only (the runtime's file format).

An endpoint needs a key when the gateway has keys of its own or the endpoint has some; a key
that is not valid for an endpoint cannot see it (not in /v1/models, 404 for its models).
Secrets are looked up by their SHA-256 digest, so nothing is compared byte by byte; a key may
be declared by its digest alone (``keySha256``), so the secret need not be stored anywhere the
gateway reads.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from llmendpoints_common.jobs.admission import ENDPOINT_KEY_PREFIX
from llmendpoints_common.jobs.service import key_owner
from llmendpoints_edge.keys import WatchedFile, key_from_headers, parse_key_list

from llmendpoints_gateway.quotas import NO_LIMITS, Limits, LimitsError, parse_limits

logger = logging.getLogger("llmendpoints.gateway.keys")


@dataclass(frozen=True)
class Key:
    name: str
    endpoints: frozenset[str] | None = None  # None: every endpoint
    admin: bool = False
    limits: Limits = NO_LIMITS

    def may_use(self, endpoint: str, unique_name: str | None = None) -> bool:
        """``endpoint``: its ``<namespace>/<name>``, listed as such; or -- a key that lists a
        bare name -- ``unique_name``: the endpoint's name when no other namespace has an
        endpoint of that name (a bare name that became ambiguous opens neither)."""
        if self.admin or self.endpoints is None or endpoint in self.endpoints:
            return True
        return unique_name is not None and unique_name in self.endpoints


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


def hashed_name(secret: str) -> str:
    """The name of a key that has none: the owner name the runtime gives it too (its jobs in
    the shared queue are the same tenant's whoever accepted them)."""
    return key_owner(secret)


class KeyFileError(ValueError):
    pass


def parse_keys_file(text: str) -> dict[bytes, Key]:
    """Either format; a YAML file with a ``keys`` list carries names, endpoints and admin."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        document = None
    if not (isinstance(document, Mapping) and "keys" in document):
        return {digest(s): Key(hashed_name(s)) for s in parse_key_list(text)}
    entries = document["keys"]
    if not isinstance(entries, list):
        raise KeyFileError("keys: must be a list of {name, key, endpoints, admin}")
    keys: dict[bytes, Key] = {}
    for i, entry in enumerate(entries):
        keys.update([_key_entry(entry, f"keys[{i}]")])
    return keys


def parse_api_keys(entries: Any, where: str = "apiKeys") -> dict[bytes, Key]:
    """PURE: ``apiKeys`` (GATEWAY_ENDPOINTS_FILE, labelled Secrets) -> keys by digest. Errors
    name the entry and field, never the secret."""
    if not isinstance(entries, list):
        raise KeyFileError(f"{where}: must be a list of {{name, key, endpoints, limits}}")
    keys: dict[bytes, Key] = {}
    names: dict[str, int] = {}
    for i, entry in enumerate(entries):
        d, key = _key_entry(entry, f"{where}[{i}]", require_name=True)
        if d in keys:
            raise KeyFileError(f"{where}[{i}].key: the same key is listed twice")
        if key.name in names and keys_limits_differ(keys, key):
            raise KeyFileError(
                f"{where}[{i}].name: {key.name!r} is also {where}[{names[key.name]}] with other "
                "limits; keys sharing a name share its limits and must declare the same ones"
            )
        names.setdefault(key.name, i)
        keys[d] = key
    return keys


def keys_limits_differ(keys: Mapping[bytes, Key], key: Key) -> bool:
    return any(k.name == key.name and k.limits != key.limits for k in keys.values())


def _secret_digest(entry: Mapping[str, Any], where: str) -> tuple[bytes, str | None]:
    secret = entry.get("key")
    hashed = entry.get("keySha256")
    if secret is not None and hashed is not None:
        raise KeyFileError(f"{where}: give key or keySha256, not both")
    if hashed is not None:
        text = hashed.removeprefix("sha256:") if isinstance(hashed, str) else ""
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise KeyFileError(f"{where}.keySha256: must be 64 hex digits (sha256 of the key)")
        return raw, None
    if not isinstance(secret, str) or not secret:
        raise KeyFileError(f"{where}.key: a non-empty string is required")
    return digest(secret), secret


def _key_entry(entry: Any, where: str, *, require_name: bool = False) -> tuple[bytes, Key]:
    if not isinstance(entry, Mapping):
        raise KeyFileError(f"{where}: must be a mapping with name and key")
    d, secret = _secret_digest(entry, where)
    name = entry.get("name")
    if name is None and (require_name or secret is None):
        raise KeyFileError(f"{where}.name: a non-empty string is required")
    if name is None:
        name = hashed_name(secret or "")
    if not isinstance(name, str) or not name:
        raise KeyFileError(f"{where}.name: a non-empty string is required")
    if name.startswith(ENDPOINT_KEY_PREFIX):
        # What a job accepted at an endpoint's own pod is billed to (jobs/admission.py): a
        # gateway key of that name would be billed for them.
        raise KeyFileError(
            f"{where}.name: {name!r} starts with {ENDPOINT_KEY_PREFIX!r}, which names the "
            "endpoints' own keys in usage records; choose another name"
        )
    endpoints = entry.get("endpoints")
    if endpoints is not None and not (
        isinstance(endpoints, list) and all(isinstance(e, str) for e in endpoints)
    ):
        raise KeyFileError(f"{where}.endpoints: must be a list of endpoint names")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise KeyFileError(f"{where}.admin: must be true or false")
    try:
        limits = parse_limits(entry.get("limits"), f"{where}.limits")
    except LimitsError as exc:
        raise KeyFileError(str(exc)) from None
    return d, Key(name, None if endpoints is None else frozenset(endpoints), admin, limits)


MAX_CACHED_HEADERS = 4096
KEY_SECRET_LABEL = "llmendpoints.dev/api-key"
_SECRET_LIMITS = ("requestsPerMinute", "tokensPerMinute", "maxConcurrent")


def secret_api_key(obj: Mapping[str, Any]) -> tuple[bytes, Key]:
    """PURE: one Secret labelled ``llmendpoints.dev/api-key`` -> (digest, key).

    Its data (all optional but the key): ``key`` or ``keySha256``, ``name`` (default: the
    Secret's name), ``endpoints`` (comma-separated; default all), ``requestsPerMinute``,
    ``tokensPerMinute``, ``maxConcurrent``, ``admin`` (``true``/``false``). Errors name the
    Secret and the field, never the key."""
    meta = obj.get("metadata") or {}
    where = f"Secret {meta.get('namespace', '')}/{meta.get('name', '')}"
    data = _secret_text(obj.get("data") or {}, where)
    entry: dict[str, Any] = {"name": data.get("name") or meta.get("name")}
    for field_name in ("key", "keySha256"):
        if field_name in data:
            entry[field_name] = data[field_name]
    if "endpoints" in data:
        entry["endpoints"] = [e.strip() for e in data["endpoints"].split(",") if e.strip()]
    # A number where it is one; anything else goes on as given, for _key_entry to refuse.
    limits: dict[str, Any] = {}
    for field_name in _SECRET_LIMITS:
        if field_name in data:
            raw = data[field_name]
            limits[field_name] = int(raw) if raw.isascii() and raw.isdigit() else raw
    if limits:
        entry["limits"] = limits
    if "admin" in data:
        if data["admin"].lower() not in ("true", "false"):
            raise KeyFileError(f"{where}: admin: must be true or false")
        entry["admin"] = data["admin"].lower() == "true"
    return _key_entry(entry, where, require_name=True)


def _secret_text(data: Mapping[str, str], where: str) -> dict[str, str]:
    decoded: dict[str, str] = {}
    for field_name, encoded in data.items():
        try:
            decoded[field_name] = base64.b64decode(encoded).decode("utf-8").strip()
        except (ValueError, UnicodeDecodeError):
            raise KeyFileError(f"{where}: {field_name}: not base64 UTF-8 text") from None
    return decoded


def parse_endpoints_file_keys(text: str) -> dict[bytes, Key] | None:
    """The ``apiKeys`` of GATEWAY_ENDPOINTS_FILE, or None when the file has none (the
    endpoints in it are checked by discovery/static.py)."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KeyFileError(f"not valid YAML: {exc}") from None
    if not isinstance(document, Mapping) or "apiKeys" not in document:
        return None
    return parse_api_keys(document["apiKeys"] or [], "apiKeys")


@dataclass
class KeyRing:
    static: dict[bytes, Key] = field(default_factory=dict)
    keys_file: str | None = None
    endpoints_file: str | None = None
    check_interval: float = 1.0
    # GATEWAY_REQUIRE_KEYS: every endpoint needs a key, whatever keys exist (fail closed).
    require_keys: bool = False
    # Kubernetes: labelled Secrets are a source, and until their first listing nothing is
    # known about keys -- not "there are none".
    awaiting_secrets: bool = False
    _files: list[WatchedFile[dict[bytes, Key] | None]] = field(default_factory=list)
    _endpoint_keys: dict[str, dict[bytes, Key]] = field(default_factory=dict)
    _secret_keys: dict[bytes, Key] | None = None  # Kubernetes: labelled Secrets
    _merged: dict[bytes, Key] = field(default_factory=dict)
    _by_name: dict[str, Key] = field(default_factory=dict)
    # The request path's cache: the raw key header(s) a valid key came in -> that key (emptied
    # whenever the keys change; unknown keys are never cached, so it grows with valid keys
    # only, and stops at MAX_CACHED_HEADERS), and whether every request needs a key.
    _by_header: dict[bytes, Key] = field(default_factory=dict)
    _has_keys: bool = False  # gateway_keys, as of the last change of the keys

    def __post_init__(self) -> None:
        self._has_keys = self.gateway_keys
        if self.keys_file:
            self._files.append(
                WatchedFile(self.keys_file, parse_keys_file, "API_KEYS_FILE", self.check_interval)
            )
        if self.endpoints_file:
            self._files.append(
                WatchedFile(
                    self.endpoints_file,
                    parse_endpoints_file_keys,
                    "apiKeys of GATEWAY_ENDPOINTS_FILE",
                    self.check_interval,
                )
            )

    @classmethod
    def from_settings(
        cls,
        api_keys: str | None,
        keys_file: str | None,
        endpoints_file: str | None = None,
        *,
        require_keys: bool = False,
        secrets: bool = False,
    ) -> KeyRing:
        """``secrets``: keys also come from labelled Secrets (Kubernetes discovery)."""
        ring = cls(
            {digest(s): Key(hashed_name(s)) for s in parse_key_list(api_keys or "")},
            keys_file,
            endpoints_file,
            require_keys=require_keys,
            awaiting_secrets=secrets,
        )
        for watched in ring._files:
            # A file that cannot be used at start-up stops the gateway: it never starts open.
            if not watched.load():
                raise KeyFileError(f"{watched.label}: {watched.error}")
        ring._merge()
        return ring

    @property
    def gateway_keys(self) -> bool:
        return (
            bool(self.static)
            or bool(self.keys_file)
            or self._secret_keys is not None
            or any(f.value is not None for f in self._files if f.path == self.endpoints_file)
        )

    @property
    def requires_key_everywhere(self) -> bool:
        return self.require_keys or self._has_keys

    def requires_key(self, endpoint: str) -> bool:
        return self.requires_key_everywhere or bool(self._endpoint_keys.get(endpoint))

    def by_name(self, name: str) -> Key | None:
        """A key of this name (its limits), e.g. a job's owner."""
        return self._by_name.get(name)

    def identify(self, secret: str) -> Key | None:
        self._refresh()
        return self._merged.get(digest(secret))

    def identify_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> tuple[Key | None, bool]:
        """(the key a request's headers carry, whether they carry one at all): the same answer
        as ``identify(key_from_headers(headers))``, without decoding and hashing the secret of
        a key seen before."""
        self._refresh()
        raw = None
        for name, value in headers:
            if name == b"authorization" or name == b"x-api-key":
                raw = value if raw is None else raw + b"\n" + name + b":" + value
        if raw is None:
            return None, False
        key = self._by_header.get(raw)
        if key is not None:
            return key, True
        secret = key_from_headers(headers)
        if secret is None:
            return None, False
        key = self._merged.get(digest(secret))
        if key is not None:
            if len(self._by_header) >= MAX_CACHED_HEADERS:
                self._by_header.clear()
            self._by_header[raw] = key
        return key, True

    def allows(self, key: Key | None, endpoint: str, unique_name: str | None = None) -> bool:
        """May ``key`` (None: no valid key) use ``endpoint`` (its id; ``unique_name``: its name
        when that name is unique across namespaces, see ``Key.may_use``)."""
        if key is None:
            return not self.requires_key(endpoint)
        return key.may_use(endpoint, unique_name) or not self.requires_key(endpoint)

    def set_endpoint_keys(self, endpoint: str, secrets: Iterable[str]) -> None:
        """Kubernetes: the secrets of an endpoint's apiKeysSecretRef (empty: none)."""
        keys = {digest(s): Key(hashed_name(s), frozenset([endpoint])) for s in secrets}
        if keys:
            self._endpoint_keys[endpoint] = keys
        else:
            self._endpoint_keys.pop(endpoint, None)
        self._merge()

    def set_secret_keys(self, keys: dict[bytes, Key] | None) -> None:
        """Kubernetes: every key of the labelled Secrets (None: the watch has not listed yet,
        or no such Secret exists; an empty dict still means "keys are required")."""
        self._secret_keys = keys
        self.awaiting_secrets = False
        self._merge()

    def _merge(self) -> None:
        merged: dict[bytes, Key] = {}
        for keys in self._endpoint_keys.values():
            for d, key in keys.items():
                have = merged.get(d)
                if have is not None and have.endpoints is not None and key.endpoints is not None:
                    key = Key(key.name, have.endpoints | key.endpoints)
                merged[d] = key
        # Gateway keys win: they carry names, admin, limits and the widest scope.
        merged.update(self.static)
        merged.update(self._secret_keys or {})
        for watched in self._files:
            merged.update(watched.value or {})
        self._merged = merged
        self._by_name = {key.name: key for key in merged.values()}
        self._by_header = {}
        self._has_keys = self.gateway_keys

    def _refresh(self) -> None:
        changed = False
        for watched in self._files:
            watched.check_interval = self.check_interval
            if watched.refresh():
                changed = True
                if watched.value is not None:
                    logger.info("loaded %d API key(s) from %s", len(watched.value), watched.label)
        if changed:
            self._merge()

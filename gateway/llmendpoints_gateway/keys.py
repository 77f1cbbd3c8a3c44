"""API keys and what each may use.

A key (DESIGN.md "Identity and authority") has a name (the tenant: what logs, metrics and
queued jobs carry; never the secret), the endpoints it may use (None: all), and ``admin``.
Per-key limits (quotas, metering) attach to ``Key`` later without changing callers.

Sources, all merged into one lookup:

- ``API_KEYS``: comma-separated secrets valid on every endpoint, each named ``key-<12 hex>``
  (a short hash of the secret);
- ``API_KEYS_FILE``: the runtime's format (one secret per line, ``#`` comments) or YAML
  ``keys: [{name, key, endpoints?, admin?}]``; re-read when its modification time changes;
- in Kubernetes, each endpoint's ``spec.api.apiKeysSecretRef``: secrets valid on that endpoint
  only (the runtime's file format).

An endpoint needs a key when the gateway has keys of its own or the endpoint has some; a key
that is not valid for an endpoint cannot see it (not in /v1/models, 404 for its models).
Secrets are looked up by their SHA-256 digest, so nothing is compared byte by byte.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from llmendpoints_common.jobs.service import key_owner

logger = logging.getLogger("llmendpoints.gateway.keys")


@dataclass(frozen=True)
class Key:
    name: str
    endpoints: frozenset[str] | None = None  # None: every endpoint
    admin: bool = False

    def may_use(self, endpoint: str) -> bool:
        return self.admin or self.endpoints is None or endpoint in self.endpoints


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


def hashed_name(secret: str) -> str:
    """The name of a key that has none: the owner name the runtime gives it too (its jobs in
    the shared queue are the same tenant's whoever accepted them)."""
    return key_owner(secret)


class KeyFileError(ValueError):
    pass


def parse_plain_keys(text: str) -> list[str]:
    """The runtime's API_KEYS_FILE format: keys separated by newlines or commas, # comments."""
    keys: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.extend(k.strip() for k in line.split(",") if k.strip())
    return list(dict.fromkeys(keys))


def parse_keys_file(text: str) -> dict[bytes, Key]:
    """Either format; a YAML file with a ``keys`` list carries names, endpoints and admin."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        document = None
    if not (isinstance(document, Mapping) and "keys" in document):
        return {digest(s): Key(hashed_name(s)) for s in parse_plain_keys(text)}
    entries = document["keys"]
    if not isinstance(entries, list):
        raise KeyFileError("keys: must be a list of {name, key, endpoints, admin}")
    keys: dict[bytes, Key] = {}
    for i, entry in enumerate(entries):
        keys.update([_key_entry(entry, f"keys[{i}]")])
    return keys


def _key_entry(entry: Any, where: str) -> tuple[bytes, Key]:
    if not isinstance(entry, Mapping):
        raise KeyFileError(f"{where}: must be a mapping with name and key")
    secret = entry.get("key")
    if not isinstance(secret, str) or not secret:
        raise KeyFileError(f"{where}.key: a non-empty string is required")
    name = entry.get("name", hashed_name(secret))
    endpoints = entry.get("endpoints")
    if endpoints is not None and not (
        isinstance(endpoints, list) and all(isinstance(e, str) for e in endpoints)
    ):
        raise KeyFileError(f"{where}.endpoints: must be a list of endpoint names")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise KeyFileError(f"{where}.admin: must be true or false")
    return digest(secret), Key(
        str(name), None if endpoints is None else frozenset(endpoints), admin
    )


@dataclass
class KeyRing:
    static: dict[bytes, Key] = field(default_factory=dict)
    keys_file: str | None = None
    check_interval: float = 1.0
    _file_keys: dict[bytes, Key] = field(default_factory=dict)
    _endpoint_keys: dict[str, dict[bytes, Key]] = field(default_factory=dict)
    _merged: dict[bytes, Key] = field(default_factory=dict)
    _file_mtime: float | None = None
    _checked_at: float = float("-inf")

    @classmethod
    def from_settings(cls, api_keys: str | None, keys_file: str | None) -> KeyRing:
        secrets = parse_plain_keys((api_keys or "").replace(",", "\n"))
        ring = cls({digest(s): Key(hashed_name(s)) for s in secrets}, keys_file)
        ring._refresh(force=True)
        ring._merge()
        return ring

    @property
    def gateway_keys(self) -> bool:
        return bool(self.static) or bool(self.keys_file)

    def requires_key(self, endpoint: str) -> bool:
        return self.gateway_keys or bool(self._endpoint_keys.get(endpoint))

    def identify(self, secret: str) -> Key | None:
        self._refresh()
        return self._merged.get(digest(secret))

    def allows(self, key: Key | None, endpoint: str) -> bool:
        if key is None:
            return not self.requires_key(endpoint)
        return key.may_use(endpoint) or not self.requires_key(endpoint)

    def set_endpoint_keys(self, endpoint: str, secrets: Iterable[str]) -> None:
        """Kubernetes: the secrets of an endpoint's apiKeysSecretRef (empty: none)."""
        keys = {digest(s): Key(hashed_name(s), frozenset([endpoint])) for s in secrets}
        if keys:
            self._endpoint_keys[endpoint] = keys
        else:
            self._endpoint_keys.pop(endpoint, None)
        self._merge()

    def _merge(self) -> None:
        merged: dict[bytes, Key] = {}
        for keys in self._endpoint_keys.values():
            for d, key in keys.items():
                have = merged.get(d)
                if have is not None and have.endpoints is not None and key.endpoints is not None:
                    key = Key(key.name, have.endpoints | key.endpoints)
                merged[d] = key
        # Gateway keys win: they carry names, admin and the widest scope.
        merged.update(self.static)
        merged.update(self._file_keys)
        self._merged = merged

    def _refresh(self, *, force: bool = False) -> None:
        if not self.keys_file:
            return
        now = time.monotonic()
        if not force and now - self._checked_at < self.check_interval:
            return
        self._checked_at = now
        try:
            mtime = os.stat(self.keys_file).st_mtime
            if mtime == self._file_mtime:
                return
            with open(self.keys_file, encoding="utf-8") as handle:
                self._file_keys = parse_keys_file(handle.read())
            self._file_mtime = mtime
            logger.info("loaded %d API key(s) from API_KEYS_FILE", len(self._file_keys))
        except (OSError, UnicodeDecodeError, KeyFileError) as exc:
            # Fail closed: a configured but unreadable file never opens the gateway.
            logger.error("cannot use API_KEYS_FILE (%s); keeping the previous keys", exc)
            if force:
                raise
            return
        self._merge()


def key_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None

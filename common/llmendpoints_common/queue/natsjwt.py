"""NATS decentralised authentication, the part this project needs: nkeys, the JWTs that chain
an operator to an account to a user, and the creds file a client connects with. Pure functions
(randomness only where a new key is asked for).

The format is nats-io/jwt v2's (what nats-server verifies; see docs.nats.io, "JWT"):

- a JWT is ``<header>.<claims>.<signature>``, each part base64url without padding; the header
  is ``{"typ":"JWT","alg":"ed25519-nkey"}``; the signature is the issuer nkey's ed25519
  signature of ``<header>.<claims>``;
- claims: ``iss`` (issuer public nkey), ``sub`` (subject public nkey), ``iat``, optional
  ``exp``, ``name``, ``jti`` (base32 of the SHA-512/256 of the standard claims with ``jti``
  empty: an id, which the server does not check), and ``nats`` (``type``: operator, account or
  user; ``version``: 2; the type's own fields);
- a creds file holds the user JWT and the user's nkey seed between ``-----BEGIN NATS USER
  JWT-----`` / ``-----BEGIN USER NKEY SEED-----`` markers (nats-py's ``user_credentials=``).

nkeys (``nkeys`` on PyPI, which nats-py itself uses for creds) does the key encoding and the
signing. The PyPI ``nats-jwt`` package was not used: it pins ``pytz<2025``, pulls pycryptodome,
dacite and dataclasses-json, and calls itself untested; the encoding is 100 lines.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
VERSION = 2

# nkeys' role prefixes, by the letter their public keys start with.
PREFIXES = {
    "O": nkeys.PREFIX_BYTE_OPERATOR,
    "A": nkeys.PREFIX_BYTE_ACCOUNT,
    "U": nkeys.PREFIX_BYTE_USER,
}


class CredentialsError(ValueError):
    """A key, JWT or creds file that cannot be used; the message says which and why."""


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# ---- keys -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """An nkey pair: ``seed`` (``S<role>...``, secret) and ``public`` (``O...``/``A...``/``U...``)."""

    seed: str
    public: str = field(init=False)

    def __post_init__(self) -> None:
        try:
            pair = nkeys.from_seed(self.seed.encode())
            public = pair.public_key.decode()
        except Exception as exc:  # nkeys raises its own errors and binascii's
            raise CredentialsError(f"not an nkey seed ({type(exc).__name__})") from None
        object.__setattr__(self, "public", public)

    @property
    def role(self) -> str:
        return self.public[0]

    def sign(self, data: bytes) -> bytes:
        return nkeys.from_seed(self.seed.encode()).sign(data)


def key_from_raw(raw: bytes, role: str) -> Key:
    """The nkey of role ``role`` ("O", "A" or "U") whose ed25519 seed is ``raw`` (32 bytes)."""
    if len(raw) != 32:
        raise CredentialsError(f"an nkey seed is 32 bytes, got {len(raw)}")
    if role not in PREFIXES:
        raise CredentialsError(f"nkey role must be one of {sorted(PREFIXES)}, got {role!r}")
    return Key(nkeys.encode_seed(raw, PREFIXES[role]).decode())


def new_key(role: str) -> Key:
    return key_from_raw(secrets.token_bytes(32), role)


def load_key(text: str, role: str, *, what: str) -> Key:
    """A key from its text: an nkey seed (``SO...``, ``SA...``, ``SU...``, as ``nsc`` writes
    them), or 32 random bytes in base64 (what the Helm chart generates: Helm's templates can
    make random bytes but not an nkey). ``what`` names the key in errors."""
    text = text.strip()
    # A seed is 58 characters of base32 (no "="); base64 of 32 bytes is 44 ending in "=", and
    # one in 64 of the chart's random keys starts with "S" too.
    if text.startswith("S") and not text.endswith("="):
        try:
            key = Key(text)
        except CredentialsError as exc:
            raise CredentialsError(f"{what}: {exc}") from None
        if key.role != role:
            raise CredentialsError(
                f"{what}: an nkey seed of role {role!r} was expected, got one of role {key.role!r}"
            )
        return key
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise CredentialsError(
            f"{what}: neither an nkey seed (S...) nor base64 of 32 random bytes"
        ) from None
    try:
        return key_from_raw(raw, role)
    except CredentialsError as exc:
        raise CredentialsError(f"{what}: {exc}") from None


# ---- JWTs -------------------------------------------------------------------------------------


def _jti(standard: dict[str, Any]) -> str:
    # nats-io/jwt hashes its ClaimsData (the standard claims, jti empty) as Go marshals it.
    order = ("aud", "exp", "jti", "iat", "iss", "name", "nbf", "sub")
    data = {k: standard[k] for k in order if standard.get(k)}
    digest = hashlib.new("sha512_256", json.dumps(data, separators=(",", ":")).encode()).digest()
    return base64.b32encode(digest).rstrip(b"=").decode()


def encode(
    issuer: Key,
    subject: str,
    nats: dict[str, Any],
    *,
    name: str,
    issued_at: int,
    expires_at: int | None = None,
) -> str:
    """A signed JWT: ``issuer`` vouches for ``subject`` (a public nkey) with ``nats`` claims."""
    standard: dict[str, Any] = {"iat": int(issued_at), "iss": issuer.public, "name": name}
    standard["sub"] = subject
    if expires_at is not None:
        standard["exp"] = int(expires_at)
    claims = {"jti": _jti(standard), **standard, "nats": {**nats, "version": VERSION}}
    head = _b64url(json.dumps(HEADER, separators=(",", ":")).encode())
    body = _b64url(json.dumps(claims, separators=(",", ":")).encode())
    signature = issuer.sign(f"{head}.{body}".encode())
    return f"{head}.{body}.{_b64url(signature)}"


def decode(token: str) -> dict[str, Any]:
    """The claims of a JWT (the signature is not checked: see ``verify``)."""
    try:
        head, body, _ = token.strip().split(".")
        header = json.loads(_unb64url(head))
        claims = json.loads(_unb64url(body))
    except (ValueError, UnicodeDecodeError):
        raise CredentialsError("not a JWT (three base64url parts of JSON)") from None
    if header.get("alg") != HEADER["alg"] or not isinstance(claims, dict):
        raise CredentialsError(f"not a NATS JWT (alg {header.get('alg')!r})")
    return claims


def verify(token: str) -> dict[str, Any]:
    """The claims, once the signature is checked against the JWT's own issuer."""
    from nacl.exceptions import BadSignatureError
    from nacl.signing import VerifyKey

    claims = decode(token)
    head, body, signature = token.strip().split(".")
    issuer = str(claims.get("iss", ""))
    try:
        # A public nkey: base32 of a role byte, the 32-byte ed25519 key and a CRC16.
        raw = base64.b32decode(issuer + "=" * (-len(issuer) % 8))[1:-2]
        VerifyKey(raw).verify(f"{head}.{body}".encode(), _unb64url(signature))
    except (ValueError, BadSignatureError):
        raise CredentialsError(f"the JWT's signature is not {issuer!r}'s") from None
    return claims


@dataclass(frozen=True)
class Permissions:
    """What a user may publish and subscribe to (NATS subjects, wildcards allowed). Everything
    not allowed is refused; a deny wins over an allow."""

    pub_allow: tuple[str, ...] = ()
    pub_deny: tuple[str, ...] = ()
    sub_allow: tuple[str, ...] = ()
    sub_deny: tuple[str, ...] = ()

    def claims(self) -> dict[str, Any]:
        def side(allow: tuple[str, ...], deny: tuple[str, ...]) -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            if allow:
                out["allow"] = list(allow)
            if deny:
                out["deny"] = list(deny)
            return out

        return {
            "pub": side(self.pub_allow, self.pub_deny),
            "sub": side(self.sub_allow, self.sub_deny),
        }

    @classmethod
    def from_claims(cls, claims: dict[str, Any]) -> Permissions:
        """The permissions a user JWT's claims grant (no allow list: everything)."""
        nats = claims.get("nats") or {}
        pub, sub = nats.get("pub") or {}, nats.get("sub") or {}
        return cls(
            pub_allow=tuple(pub.get("allow") or (">",)),
            pub_deny=tuple(pub.get("deny") or ()),
            sub_allow=tuple(sub.get("allow") or (">",)),
            sub_deny=tuple(sub.get("deny") or ()),
        )

    def may_publish(self, subject: str) -> bool:
        return _permitted(subject, self.pub_allow, self.pub_deny)

    def may_subscribe(self, subject: str) -> bool:
        return _permitted(subject, self.sub_allow, self.sub_deny)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(have) == len(want)


def _permitted(subject: str, allow: tuple[str, ...], deny: tuple[str, ...]) -> bool:
    return any(subject_matches(p, subject) for p in allow) and not any(
        subject_matches(p, subject) for p in deny
    )


@dataclass(frozen=True)
class UserLimits:
    """A user's own bounds (nats-server enforces ``payload``, the largest message it may
    publish, and ``subs``, the subscriptions it may hold; -1: the account's or the server's).
    The JWT's ``data`` limit is not enforced for client connections, so it is not offered."""

    payload: int = -1
    subs: int = -1

    @classmethod
    def from_claims(cls, claims: dict[str, Any]) -> UserLimits:
        nats = claims.get("nats") or {}
        return cls(payload=int(nats.get("payload", -1)), subs=int(nats.get("subs", -1)))


@dataclass(frozen=True)
class AccountLimits:
    """The account's JetStream bounds (nats-io/jwt ``JetStreamLimits``; -1: none). Untiered:
    a stream replicated R times counts R times against ``disk_storage``/``mem_storage``.
    ``max_bytes_required``: the server refuses a stream created without ``max_bytes``, so every
    stream is bounded (and JetStream reserves its bound on the servers when it is created)."""

    disk_storage: int = -1
    mem_storage: int = -1
    streams: int = -1
    consumer: int = -1
    max_ack_pending: int = -1
    max_bytes_required: bool = True

    def claims(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "disk_storage": self.disk_storage,
            "mem_storage": self.mem_storage,
            "streams": self.streams,
            "consumer": self.consumer,
            "max_ack_pending": self.max_ack_pending,
        }
        if self.max_bytes_required:
            out["max_bytes_required"] = True
        return out


def operator_jwt(operator: Key, *, name: str, system_account: str, issued_at: int) -> str:
    """The operator's self-signed JWT: the root every account JWT is checked against."""
    return encode(
        operator,
        operator.public,
        {"system_account": system_account, "type": "operator"},
        name=name,
        issued_at=issued_at,
    )


def account_jwt(
    operator: Key,
    account: str,
    *,
    name: str,
    signing_keys: tuple[str, ...] = (),
    jetstream: AccountLimits | None = None,
    revoked_before: int | None = None,
    issued_at: int,
) -> str:
    """An account (``account``: its public key) vouched for by the operator. Users of the
    account are signed by one of ``signing_keys`` (the account's own key stays offline).
    ``jetstream``: its JetStream bounds (None: no JetStream). ``revoked_before``: every user
    JWT issued at or before this time is refused (the revocation ``"*"``)."""
    limits: dict[str, Any] = {
        "subs": -1,
        "data": -1,
        "payload": -1,
        "imports": -1,
        "exports": -1,
        "wildcards": True,
        "conn": -1,
        "leaf": -1,
    }
    if jetstream is not None:
        limits.update(jetstream.claims())
    nats: dict[str, Any] = {"limits": limits, "default_permissions": {"pub": {}, "sub": {}}}
    if signing_keys:
        nats["signing_keys"] = list(signing_keys)
    if revoked_before is not None:
        nats["revocations"] = {"*": int(revoked_before)}
    nats["type"] = "account"
    return encode(operator, account, nats, name=name, issued_at=issued_at)


def user_jwt(
    signer: Key,
    account: str,
    user: str,
    permissions: Permissions,
    *,
    name: str,
    issued_at: int,
    expires_at: int | None = None,
    limits: UserLimits | None = None,
) -> str:
    """A user (``user``: its public key) of ``account``, signed by the account's signing key
    ``signer``, allowed exactly ``permissions`` within ``limits``; plain client connections
    only."""
    bounds = limits or UserLimits()
    nats: dict[str, Any] = {
        **permissions.claims(),
        "subs": bounds.subs,
        "data": -1,
        "payload": bounds.payload,
        "allowed_connection_types": ["STANDARD"],
        "type": "user",
    }
    if signer.public != account:
        nats["issuer_account"] = account
    return encode(signer, user, nats, name=name, issued_at=issued_at, expires_at=expires_at)


# ---- creds files ------------------------------------------------------------------------------


def creds(user_token: str, user_seed: str) -> str:
    """The creds file nats clients read (``nats.connect(user_credentials=PATH)``)."""
    if not user_seed.startswith("SU"):
        raise CredentialsError("a creds file holds a user seed (SU...)")
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_token}\n"
        "------END NATS USER JWT------\n"
        "\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n"
        "\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user_seed}\n"
        "------END USER NKEY SEED------\n"
        "\n"
        "*************************************************************\n"
    )


def parse_creds(text: str) -> tuple[str, str]:
    """(user JWT, user seed) from a creds file's text."""
    blocks: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("-----BEGIN ") and i + 1 < len(lines):
            blocks.append(lines[i + 1].strip())
    if len(blocks) != 2 or not blocks[1].startswith("SU"):
        raise CredentialsError(
            "not a NATS creds file (a '-----BEGIN NATS USER JWT-----' block and a "
            "'-----BEGIN USER NKEY SEED-----' block)"
        )
    decode(blocks[0])
    return blocks[0], blocks[1]

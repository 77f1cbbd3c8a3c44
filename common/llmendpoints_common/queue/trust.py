"""The queue's chain of trust, from an installation's keys: the NATS server's configuration
(operator JWT, accounts, resolver) and the creds each role connects with. Pure functions.

Keys (one installation; the Helm chart generates them into a Secret, or you bring them):

- ``operator``: the root; signs the account JWTs. Only the NATS servers' start-up needs it.
- ``system-account``: NATS's own system account (server events; no user of ours).
- ``account``: the one account every llmendpoints user belongs to (its public key is what
  users name; its seed signs nothing here).
- ``account-signing``: the account's signing key: signs every user JWT. The llmendpoints
  operator holds it (per-endpoint creds) and the gateway's init container (its own creds).

Each key file holds an nkey seed (``SO...``/``SA...``, as ``nsc`` makes them) or 32 random
bytes in base64 (what Helm's ``randBytes 32`` makes; a template cannot encode an nkey). The
``account`` file may also hold just the public key (``A...``): nobody here signs with it.

The server configuration is deterministic in the keys and its arguments (``issued_at``
fixed): every NATS replica renders the same, and re-rendering changes nothing. The account JWT
carries the account's JetStream bounds (``natsjwt.AccountLimits``: every stream must have a
``max_bytes``; the account's storage no more than the servers hold) and revokes every user JWT
minted before ``REVOKED_BEFORE``: credentials of the first queue layout, whose permissions
reached other roles' consumers (the operator mints its endpoints' credentials anew under a new
Secret name). User JWTs carry the time they were minted and do not expire: a credential is
revoked by rotating the signing key (every creds file then has to be minted again;
docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmendpoints_common.identity import EndpointRef, as_ref
from llmendpoints_common.queue import natsjwt, roles
from llmendpoints_common.queue.natsjwt import AccountLimits, CredentialsError, Key

KEY_FILES = ("operator", "system-account", "account", "account-signing")
ACCOUNT_NAME = "LLMEP"
# JWTs of the server configuration carry this as their issue time (deterministic output).
CONFIG_ISSUED_AT = 1_700_000_000
# User JWTs issued at or before this time are refused: the first layout's credentials (runtime
# pods could pull and rewrite the gateway's usage consumer with them; issue 28).
REVOKED_BEFORE = 1_795_900_000


@dataclass(frozen=True)
class Signer:
    """What minting user creds needs: the account's public key and its signing key."""

    account: str
    signing: Key

    @classmethod
    def from_dir(cls, keys_dir: str | Path) -> Signer:
        folder = Path(keys_dir)
        return cls(
            account=_account_public(_read(folder, "account")),
            signing=natsjwt.load_key(_read(folder, "account-signing"), "A", what="account-signing"),
        )


def _read(folder: Path, name: str) -> str:
    try:
        return (folder / name).read_text()
    except OSError as exc:
        raise CredentialsError(
            f"queue key {name!r}: cannot read {str(folder / name)!r}: {exc.strerror}"
        ) from None


def _account_public(text: str) -> str:
    text = text.strip()
    if text.startswith("A") and len(text) == 56:
        return text
    return natsjwt.load_key(text, "A", what="account").public


def credential_name(role: str, endpoint: EndpointRef | str | None = None) -> str:
    """The ``name`` claim of a role's user JWT: ``runtime:<ns>/<name>`` for a runtime pod."""
    return f"runtime:{as_ref(endpoint).id}" if role == "runtime" and endpoint else role


def mint(
    signer: Signer,
    role: str,
    endpoint: EndpointRef | str | None = None,
    *,
    issued_at: int,
    user: Key | None = None,
) -> str:
    """A creds file for ``role`` (and ``endpoint``, for a runtime pod): a new user key, allowed
    exactly what queue/roles.py gives that role."""
    permissions = roles.for_role(role, endpoint)
    user = user or natsjwt.new_key("U")
    token = natsjwt.user_jwt(
        signer.signing,
        signer.account,
        user.public,
        permissions,
        name=credential_name(role, endpoint),
        issued_at=issued_at,
        limits=roles.limits(role),
    )
    return natsjwt.creds(token, user.seed)


def check_runtime_creds(creds_text: str, endpoint: EndpointRef | str) -> None:
    """A runtime pod refuses a creds file minted for another endpoint or for a trusted role
    (a Secret planted under its name before the operator made it would be one): the JWT's name
    says whom the operator minted it for. A creds file of another naming (a NATS you manage
    yourself) is left to that NATS's own permissions."""
    token, _ = natsjwt.parse_creds(creds_text)
    name = str(natsjwt.decode(token).get("name", ""))
    expected = credential_name("runtime", endpoint)
    if name in ("gateway", "operator", "admin") or (
        name.startswith("runtime:") and name != expected
    ):
        raise CredentialsError(
            f"the creds file was minted for {name!r}, not for this pod's endpoint "
            f"({expected!r}): delete the Secret and let the operator mint it"
        )


@dataclass(frozen=True)
class Installation:
    """All four keys: what the NATS servers' configuration is made from."""

    operator: Key
    system_account: Key
    account: Key
    account_signing: Key

    @classmethod
    def from_dir(cls, keys_dir: str | Path) -> Installation:
        folder = Path(keys_dir)
        return cls(
            operator=natsjwt.load_key(_read(folder, "operator"), "O", what="operator"),
            system_account=natsjwt.load_key(
                _read(folder, "system-account"), "A", what="system-account"
            ),
            account=natsjwt.load_key(_read(folder, "account"), "A", what="account"),
            account_signing=natsjwt.load_key(
                _read(folder, "account-signing"), "A", what="account-signing"
            ),
        )

    @classmethod
    def generate(cls) -> Installation:
        return cls(
            natsjwt.new_key("O"), natsjwt.new_key("A"), natsjwt.new_key("A"), natsjwt.new_key("A")
        )

    @property
    def signer(self) -> Signer:
        return Signer(account=self.account.public, signing=self.account_signing)

    def seeds(self) -> dict[str, str]:
        """The key files' contents (nkey seeds), by file name."""
        return {
            "operator": self.operator.seed,
            "system-account": self.system_account.seed,
            "account": self.account.seed,
            "account-signing": self.account_signing.seed,
        }


ROUTE_USER = "route"


def routes_config(password: str, routes: list[str]) -> str:
    """The inside of nats.conf's ``cluster {}`` that makes routes authenticate: a server (or
    anything else) that reaches the cluster port without the password cannot join. NATS takes
    an explicit route's credentials only from its URL, hence a generated file."""
    password = password.strip()
    if len(password) < 16 or not password.isalnum():
        raise CredentialsError("cluster-password: at least 16 letters and digits")
    urls = []
    for route in routes:
        if not route.startswith("nats://") or "@" in route:
            raise CredentialsError(f"route {route!r}: nats://host:port, no credentials")
        urls.append(f'    "nats://{ROUTE_USER}:{password}@{route[len("nats://") :]}"')
    return (
        "# Generated (llmendpoints-operator queue-auth server-config).\n"
        f'authorization {{ user: {ROUTE_USER}, password: "{password}" }}\n'
        "routes: [\n" + "\n".join(urls) + "\n]\n"
    )


def server_config(installation: Installation, jetstream: AccountLimits | None = None) -> str:
    """The part of nats.conf that makes the server trust this installation's operator and
    know its two accounts (resolver MEMORY: the account JWTs are in the file; nothing to
    push to the servers at run time). ``jetstream``: the account's JetStream bounds (default:
    every stream bounded, no total beyond the servers' own)."""
    key = installation
    issued = CONFIG_ISSUED_AT
    operator = natsjwt.operator_jwt(
        key.operator, name="llmendpoints", system_account=key.system_account.public,
        issued_at=issued,
    )  # fmt: skip
    system = natsjwt.account_jwt(
        key.operator, key.system_account.public, name="SYS", issued_at=issued
    )
    account = natsjwt.account_jwt(
        key.operator,
        key.account.public,
        name=ACCOUNT_NAME,
        signing_keys=(key.account_signing.public,),
        jetstream=jetstream or AccountLimits(),
        revoked_before=REVOKED_BEFORE,
        issued_at=issued,
    )
    return (
        "# Generated from the installation's keys (llmendpoints-operator queue-auth).\n"
        f"operator: {operator}\n"
        f"system_account: {key.system_account.public}\n"
        "resolver: MEMORY\n"
        "resolver_preload: {\n"
        f"  {key.system_account.public}: {system}\n"
        f"  {key.account.public}: {account}\n"
        "}\n"
    )

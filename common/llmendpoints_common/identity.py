"""An endpoint's identity: its Kubernetes namespace and name, together.

Two endpoints named ``chat`` in two namespaces are two endpoints that share nothing: every queue
subject, record key, consumer, signal and usage record carries both (see queue/names.py). The
canonical text form is ``"<namespace>/<name>"`` (``EndpointRef.id``), as ``kubectl`` writes it.

- namespace: an RFC 1123 label (``[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?``): no dots, no ``_``;
- name: a Kubernetes object name (``[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?``).

A tenant (an API key's name) is identified the same way everywhere too: ``tenant_token``, the
token its queue subjects, record keys, object names and local folders carry.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

DEFAULT_NAMESPACE = "default"

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def check_namespace(namespace: object, *, field: str = "namespace") -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ValueError(
            f"{field}: {namespace!r} is not a Kubernetes namespace (1-63 lowercase letters, "
            "digits and '-', starting and ending with a letter or digit)"
        )
    return namespace


def check_name(name: object, *, field: str = "name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"{field}: {name!r} is not a Kubernetes object name (1-253 lowercase letters, "
            "digits, '-' and '.', starting and ending with a letter or digit)"
        )
    return name


@dataclass(frozen=True, order=True)
class EndpointRef:
    """One endpoint: ``EndpointRef("team-a", "chat").id == "team-a/chat"``."""

    namespace: str
    name: str

    def __post_init__(self) -> None:
        check_namespace(self.namespace, field="endpoint namespace")
        check_name(self.name, field="endpoint name")

    @property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"

    def __str__(self) -> str:
        return self.id

    @classmethod
    def parse(cls, text: str) -> EndpointRef:
        """``"<namespace>/<name>"`` -> EndpointRef; a ValueError that says which part is wrong."""
        if not isinstance(text, str) or text.count("/") != 1:
            raise ValueError(
                f"endpoint id {text!r} must be '<namespace>/<name>' (e.g. 'default/chat')"
            )
        namespace, name = text.split("/")
        return cls(namespace, name)


def parse(text: str) -> EndpointRef:
    return EndpointRef.parse(text)


def as_ref(endpoint: EndpointRef | str) -> EndpointRef:
    """An EndpointRef, or its ``"ns/name"`` text (a bare name is refused: which namespace?)."""
    return endpoint if isinstance(endpoint, EndpointRef) else EndpointRef.parse(endpoint)


def tenant_token(name: str) -> str:
    """An API key's name (a tenant: any text) as one key segment, subject token or path segment:
    a digest of it, so names with dots, spaces, slashes or wildcards map one to one onto safe
    tokens."""
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:24]

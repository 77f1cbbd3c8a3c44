"""The one guard for addresses we connect to because a client told us to (webhooks, media URLs).

Such a URL is a request to make this pod open a connection on the caller's behalf, from inside
the cluster: without a guard, a blind SSRF (the cloud metadata service at 169.254.169.254 hands
out credentials). Two checks, both needed:

- ``check_url`` when the URL is accepted: scheme, host, literal IPs (IPv4-mapped IPv6 included),
  the allow-list by host. Cheap, no I/O; the client hears about a bad URL at once.
- ``resolve_checked`` just before connecting: DNS, then every address checked. The caller then
  connects to one of the returned addresses -- never resolves the name again -- so a name that
  answered a harmless address at submission and a refused one now (DNS rebinding) gets nowhere.

Always refused, whatever the policy: link-local (169.254.0.0/16, fe80::/10, where the metadata
services of most clouds live), the other metadata addresses (fd00:ec2::254 on AWS IPv6,
100.100.100.200 on Alibaba Cloud), unspecified (0.0.0.0/8, ::), multicast and broadcast.
Loopback and private ranges (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7) are allowed by
default: in-cluster receivers (a Service's ClusterIP, a sidecar) are the common case. A policy
can refuse them, or name the only destinations allowed.

Pure apart from ``resolve_checked``'s DNS lookup; no web framework, no HTTP client.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# (network, why) -- checked in order; the first match is the reason given.
_ALWAYS_REFUSED: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), why)
    for net, why in (
        ("169.254.169.254/32", "a cloud metadata address"),
        ("fd00:ec2::254/128", "a cloud metadata address"),
        ("100.100.100.200/32", "a cloud metadata address"),
        ("169.254.0.0/16", "link-local"),
        ("fe80::/10", "link-local"),
        ("0.0.0.0/8", "unspecified"),
        ("::/128", "unspecified"),
        ("224.0.0.0/4", "multicast"),
        ("ff00::/8", "multicast"),
        ("255.255.255.255/32", "broadcast"),
    )
)
_LOOPBACK = tuple(ipaddress.ip_network(n) for n in ("127.0.0.0/8", "::1/128"))
_PRIVATE = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
)
_HOSTNAME = re.compile(
    r"^(\*\.)?([a-z0-9_]([a-z0-9_-]*[a-z0-9_])?\.)*[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?$"
)

# host, port -> the addresses it resolves to (the seam tests use to resolve without DNS).
Resolver = Callable[[str, int], Awaitable[list[str]]]


class DestinationRefused(ValueError):
    """A destination the policy refuses; ``str()`` says why (never userinfo or a query)."""


@dataclass(frozen=True)
class DestinationPolicy:
    """Where outbound connections may go.

    ``allowed``: hostnames (exact, or ``*.suffix`` for any name under ``suffix``) and CIDRs;
    empty means anywhere not always refused. A host that matches a hostname entry is allowed
    whatever it resolves to (the always-refused ranges, and loopback/private when disallowed,
    still apply); any other host must resolve into one of the CIDRs.
    """

    allowed: tuple[str, ...] = ()
    allow_loopback: bool = True
    allow_private: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed", tuple(_normalise_entry(e) for e in self.allowed))

    @classmethod
    def parse(cls, text: str | None, **kw: Any) -> DestinationPolicy:
        """From a comma-separated setting (``"hooks.example.com, *.svc.cluster.local,
        10.0.0.0/8"``); ValueError naming the entry that is neither a hostname nor a CIDR."""
        entries = [part.strip() for part in (text or "").split(",") if part.strip()]
        return cls(allowed=tuple(entries), **kw)

    @property
    def networks(self) -> tuple[IPNetwork, ...]:
        return tuple(n for e in self.allowed if (n := _as_network(e)) is not None)

    @property
    def hostnames(self) -> tuple[str, ...]:
        return tuple(e for e in self.allowed if _as_network(e) is None)

    def allows_host(self, host: str) -> bool:
        """Whether ``host`` (a name) matches a hostname entry of the allow-list."""
        host = host.lower().rstrip(".")
        for entry in self.hostnames:
            if entry.startswith("*."):
                if host.endswith(entry[1:]):
                    return True
            elif host == entry:
                return True
        return False


def refused_reason(address: str, policy: DestinationPolicy) -> str | None:
    """Why connecting to the IP ``address`` is refused, or None if it is allowed.

    An address reached through a host the allow-list names is checked by ``_category_reason``
    alone; this is the check for an address contacted as itself, so a non-empty allow-list
    must contain it in one of its CIDRs.
    """
    ip = _parse_ip(address)
    if ip is None:
        return f"{address!r} is not an IP address"
    if (reason := _category_reason(ip, policy)) is not None:
        return reason
    if policy.allowed and not any(
        ip in net for net in policy.networks if net.version == ip.version
    ):
        return f"{ip} is not in the allowed destinations"
    return None


def check_url(
    url: str, policy: DestinationPolicy, *, schemes: Iterable[str] = ("http", "https")
) -> None:
    """The checks that need no DNS; raise DestinationRefused saying which failed."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 -- raises ValueError for a port out of range
    except ValueError as exc:
        raise DestinationRefused(f"not a valid URL: {exc}") from None
    allowed_schemes = tuple(schemes)
    if parts.scheme.lower() not in allowed_schemes:
        raise DestinationRefused(
            f"scheme {parts.scheme or '(none)'!r} is not allowed; use {' or '.join(allowed_schemes)}"
        )
    if not host:
        raise DestinationRefused(f"{redact(url)} has no host")
    ip = _parse_ip(host)
    if ip is not None:
        if (reason := refused_reason(str(ip), policy)) is not None:
            raise DestinationRefused(f"{redact(url)}: {reason}")
        return
    if not _HOSTNAME.match(host.rstrip(".")):
        raise DestinationRefused(f"{redact(url)}: {host!r} is not a valid host name")
    if policy.allowed and not policy.allows_host(host) and not policy.networks:
        raise DestinationRefused(f"{redact(url)}: host {host!r} is not in the allowed destinations")


async def resolve_checked(
    host: str, port: int, policy: DestinationPolicy, *, resolver: Resolver | None = None
) -> list[str]:
    """``host``'s addresses, every one checked; DestinationRefused if any is refused.

    All must pass, not just the first: which address a client ends up using is not ours to
    choose once the name has answered. Connect to one of the returned addresses, never to the
    name. ``resolver`` replaces DNS (tests).
    """
    ip = _parse_ip(host)
    if ip is not None:
        if (reason := refused_reason(str(ip), policy)) is not None:
            raise DestinationRefused(f"{host}: {reason}")
        return [str(ip)]
    try:
        addresses = await (resolver or _getaddrinfo)(host, port)
    except OSError as exc:
        raise DestinationRefused(f"{host} does not resolve: {exc}") from None
    if not addresses:
        raise DestinationRefused(f"{host} does not resolve to any address")
    by_name = policy.allows_host(host)
    for address in addresses:
        parsed = _parse_ip(address)
        if parsed is None:
            raise DestinationRefused(f"{host} resolves to {address!r}, not an IP address")
        reason = _category_reason(parsed, policy) if by_name else refused_reason(address, policy)
        if reason is not None:
            raise DestinationRefused(f"{host} resolves to {parsed}: {reason}")
    return [str(_parse_ip(a)) for a in dict.fromkeys(addresses)]


def redact(url: str, *, path: bool = True) -> str:
    """``scheme://host[:port]/path``: what may go in a log line or an error message (no
    userinfo, no query, no fragment -- where tokens live). ``path=False``: ``scheme://host[:port]``
    only, for logs that an operator reads about someone else's URL (some services, Slack and
    Discord among them, put the token in the path)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "(an invalid URL)"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return f"{parts.scheme}://{netloc}{parts.path if path else ''}"


def _category_reason(ip: IPAddress, policy: DestinationPolicy) -> str | None:
    ip = _unmap(ip)
    for net, why in _ALWAYS_REFUSED:
        if ip.version == net.version and ip in net:
            return f"{ip} is {why}"
    if any(ip in net for net in _LOOPBACK if net.version == ip.version):
        return None if policy.allow_loopback else f"{ip} is loopback"
    if any(ip in net for net in _PRIVATE if net.version == ip.version):
        return None if policy.allow_private else f"{ip} is a private address"
    return None


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _unmap(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one stands for: ``::ffff:169.254.169.254`` is 169.254.169.254
    to the kernel, and ``64:ff9b::a9fe:a9fe`` to a NAT64 gateway; check them as such."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


# What C's inet_aton (so getaddrinfo, so every HTTP client) reads as an IPv4 address besides
# dotted quads: 0xa9fea9fe, 2852039166, 0251.0376.0251.0376, 169.254.43518 -- all of them the
# metadata address. Such a "host name" is an address, and is checked as one.
_LEGACY_IPV4 = re.compile(r"^[0-9a-fx.]+$", re.IGNORECASE)


def _parse_ip(text: str) -> IPAddress | None:
    text = text.strip("[]")
    text = text.split("%", 1)[0]  # a zone id (fe80::1%eth0) does not change the address
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1]  # "169.254.169.254." is the same address (a rooted name)
    try:
        return _unmap(ipaddress.ip_address(text))
    except ValueError:
        pass
    if _LEGACY_IPV4.match(text):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def _as_network(entry: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None


def _normalise_entry(entry: str) -> str:
    entry = entry.strip().lower().rstrip(".")
    network = _as_network(entry)
    if network is not None:
        return str(network)
    if not _HOSTNAME.match(entry):
        raise ValueError(
            f"{entry!r} is neither a host name (exact, or *.suffix) nor a CIDR (10.0.0.0/8)"
        )
    return entry


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return [str(info[4][0]) for info in infos]

"""The outbound-destination guard: what is refused, what is allowed, what is said about it."""

from __future__ import annotations

import pytest
from llmendpoints_common.destinations import (
    DestinationPolicy,
    DestinationRefused,
    check_url,
    redact,
    refused_reason,
    resolve_checked,
)

OPEN = DestinationPolicy()


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("169.254.169.254", "metadata"),
        ("fd00:ec2::254", "metadata"),
        ("100.100.100.200", "metadata"),
        ("169.254.10.1", "link-local"),
        ("fe80::1", "link-local"),
        ("::ffff:169.254.169.254", "metadata"),  # IPv4-mapped IPv6
        ("64:ff9b::a9fe:a9fe", "metadata"),  # NAT64 of 169.254.169.254
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("255.255.255.255", "broadcast"),
    ],
)
def test_always_refused_whatever_the_policy(address, why) -> None:
    for policy in (OPEN, DestinationPolicy(allowed=("0.0.0.0/0", "::/0", "*.example.com"))):
        reason = refused_reason(address, policy)
        assert reason is not None and why in reason


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "10.1.2.3", "192.168.0.9", "fd12::1"])
def test_loopback_and_private_are_allowed_by_default(address) -> None:
    assert refused_reason(address, OPEN) is None


def test_loopback_and_private_can_be_refused() -> None:
    strict = DestinationPolicy(allow_loopback=False, allow_private=False)
    assert "loopback" in refused_reason("127.0.0.2", strict)
    assert "loopback" in refused_reason("::ffff:127.0.0.1", strict)
    assert "private" in refused_reason("172.20.0.1", strict)
    assert "private" in refused_reason("100.64.0.1", strict)
    assert refused_reason("93.184.216.34", strict) is None


def test_a_cidr_allow_list_admits_only_its_ranges() -> None:
    policy = DestinationPolicy.parse("10.0.0.0/8, 2001:db8::/32")
    assert policy.allowed == ("10.0.0.0/8", "2001:db8::/32")
    assert refused_reason("10.9.9.9", policy) is None
    assert refused_reason("2001:db8::5", policy) is None
    assert "not in the allowed destinations" in refused_reason("192.168.1.1", policy)


def test_parse_names_the_bad_entry() -> None:
    assert DestinationPolicy.parse(None) == DestinationPolicy()
    assert DestinationPolicy.parse(" , ") == DestinationPolicy()
    policy = DestinationPolicy.parse("Hooks.Example.com., *.svc.cluster.local", allow_private=False)
    assert policy.allowed == ("hooks.example.com", "*.svc.cluster.local")
    assert policy.allow_private is False
    with pytest.raises(ValueError, match="'http://x'"):
        DestinationPolicy.parse("ok.example.com, http://x")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://example.com/x", "scheme 'ftp'"),
        ("file:///etc/passwd", "scheme 'file'"),
        ("http:///path", "has no host"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://[::ffff:169.254.169.254]/", "metadata"),
        ("http://[fe80::1%25eth0]:8080/", "link-local"),
        ("http://0.0.0.0:9000/", "unspecified"),
        ("http://exa mple.com/", "not a valid host name"),
        ("http://example.com:99999/", "not a valid URL"),
        # IPv4 as C's inet_aton reads it: still the metadata address, refused at submission
        ("http://0xa9fea9fe/latest/meta-data/", "metadata"),
        ("http://2852039166/", "metadata"),
        ("http://0251.0376.0251.0376/", "metadata"),
        ("http://169.254.43518/", "metadata"),
        ("http://169.254.169.254./", "metadata"),
        ("http://0xA9.0xFE.0xA9.0xFE/", "metadata"),
        ("http://0/", "unspecified"),
    ],
)
def test_check_url_refuses_what_it_can_see_without_dns(url, words) -> None:
    with pytest.raises(DestinationRefused, match=words):
        check_url(url, OPEN)


def test_check_url_passes_ordinary_receivers() -> None:
    for url in (
        "https://hooks.example.com/job-done?token=x",
        "http://receiver.default.svc.cluster.local:8080/hook",
        "http://127.0.0.1:9000/",
        "http://10.0.0.7/",
        "http://0x7f000001:9000/",  # loopback, however written
        "https://deadbeef.example.com/",  # a name that merely looks like hex
        "https://cafe/",
    ):
        check_url(url, OPEN)


def test_check_url_applies_the_allow_list_by_host() -> None:
    names = DestinationPolicy.parse("hooks.example.com, *.svc.cluster.local")
    check_url("https://hooks.example.com/x", names)
    check_url("http://receiver.ns.svc.cluster.local/", names)
    with pytest.raises(DestinationRefused, match="not in the allowed destinations"):
        check_url("https://evil.example.net/x", names)
    with pytest.raises(DestinationRefused, match="not in the allowed destinations"):
        check_url("https://svc.cluster.local/x", names)  # *.suffix needs a label before it
    with pytest.raises(DestinationRefused, match="not in the allowed destinations"):
        check_url("http://10.0.0.1/", names)
    # With CIDRs in the list, a name that matches no entry is judged by what it resolves to.
    check_url("https://anything.example.net/x", DestinationPolicy.parse("10.0.0.0/8"))


def test_refusals_never_repeat_userinfo_or_query() -> None:
    url = "http://user:s3cret@169.254.169.254/path?token=t0ken#frag"
    with pytest.raises(DestinationRefused) as info:
        check_url(url, OPEN)
    assert "s3cret" not in str(info.value) and "t0ken" not in str(info.value)
    assert "user" not in str(info.value)
    assert redact(url) == "http://169.254.169.254/path"
    assert redact("https://[::1]:8443/a/b?x=1") == "https://[::1]:8443/a/b"


@pytest.mark.parametrize(
    ("url", "shown", "origin"),
    [
        ("https://tok3n@hooks.test/a", "https://hooks.test/a", "https://hooks.test"),
        (
            "http://u:p4ss@hooks.test:8080/x?k=s3cret&a=1#frag",
            "http://hooks.test:8080/x",
            "http://hooks.test:8080",
        ),
        ("http://hooks.test?next=http://u:p4ss@evil/", "http://hooks.test", "http://hooks.test"),
        ("http://a@b:p4ss@hooks.test/T0KEN", "http://hooks.test/T0KEN", "http://hooks.test"),
        ("http://u:p4ss@[::1]/", "http://[::1]/", "http://[::1]"),
        ("http://hooks.test:99999/?k=s3cret", "(an invalid URL)", "(an invalid URL)"),
    ],
)
def test_redact_drops_userinfo_query_and_fragment(url: str, shown: str, origin: str) -> None:
    assert redact(url) == shown
    assert redact(url, path=False) == origin
    for secret in ("tok3n", "p4ss", "s3cret", "frag", "evil"):
        assert secret not in redact(url)
    assert "T0KEN" not in redact(url, path=False)


def _resolver(table: dict[str, list[str]]):
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return table[host]

    return resolve


async def test_resolve_checked_checks_every_address() -> None:
    resolver = _resolver(
        {
            "receiver.test": ["127.0.0.1", "::1"],
            "rebinding.test": ["10.0.0.5", "169.254.169.254"],
            "mapped.test": ["::ffff:169.254.169.254"],
        }
    )
    assert await resolve_checked("receiver.test", 80, OPEN, resolver=resolver) == [
        "127.0.0.1",
        "::1",
    ]
    with pytest.raises(DestinationRefused, match=r"rebinding\.test resolves to 169\.254\.169\.254"):
        await resolve_checked("rebinding.test", 80, OPEN, resolver=resolver)
    with pytest.raises(DestinationRefused, match="metadata"):
        await resolve_checked("mapped.test", 80, OPEN, resolver=resolver)
    with pytest.raises(DestinationRefused, match="does not resolve"):
        await resolve_checked("nowhere.test", 80, OPEN, resolver=resolver)
    assert await resolve_checked("127.0.0.1", 80, OPEN) == ["127.0.0.1"]


async def test_resolve_checked_applies_the_allow_list() -> None:
    resolver = _resolver({"named.test": ["192.168.1.1"], "other.test": ["192.168.1.1"]})
    policy = DestinationPolicy.parse("named.test, 10.0.0.0/8")
    # Named in the list: allowed whatever it resolves to (bar the always-refused).
    assert await resolve_checked("named.test", 80, policy, resolver=resolver) == ["192.168.1.1"]
    # Not named: must resolve into one of the CIDRs.
    with pytest.raises(DestinationRefused, match="not in the allowed destinations"):
        await resolve_checked("other.test", 80, policy, resolver=resolver)
    metadata = _resolver({"named.test": ["169.254.169.254"]})
    with pytest.raises(DestinationRefused, match="metadata"):
        await resolve_checked("named.test", 80, policy, resolver=metadata)

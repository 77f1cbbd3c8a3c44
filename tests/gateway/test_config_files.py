"""Parsing the static endpoints file and the keys file: errors name the entry and the field."""

from __future__ import annotations

import pytest
from llmendpoints_gateway.discovery.static import EndpointsFileError, parse_endpoints
from llmendpoints_gateway.keys import (
    Key,
    KeyFileError,
    KeyRing,
    digest,
    hashed_name,
    parse_keys_file,
)
from llmendpoints_gateway.routing import Strategy


def test_endpoints_file():
    (ep,) = parse_endpoints(
        "endpoints:\n  - name: demo\n    models: [demo]\n"
        "    backends: ['http://127.0.0.1:8001/', 'http://127.0.0.1:8002']\n"
    )
    assert ep.backends == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert ep.routing is Strategy.PREFIX_AWARE
    (rr,) = parse_endpoints(
        "endpoints: [{name: a, models: [a], backends: [], routing: round-robin}]"
    )
    assert rr.routing is Strategy.ROUND_ROBIN
    # The queue's identity is namespace + name: "default" unless the entry says.
    assert ep.namespace == "default"
    (other,) = parse_endpoints("endpoints: [{name: a, namespace: team-a, backends: []}]")
    assert other.namespace == "team-a"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("endpoints: {}", "`endpoints` list"),
        ("endpoints: [{models: [a]}]", "endpoints[0].name"),
        ("endpoints: [{name: a, models: a}]", "endpoints[0].models"),
        ("endpoints: [{name: a, backends: ['127.0.0.1:80']}]", "endpoints[0].backends"),
        ("endpoints: [{name: a, routing: random}]", "endpoints[0].routing"),
        ("endpoints: [{name: a}, {name: a}]", "unique"),
        ("endpoints: [{name: a, namespace: Team.A}]", "endpoints[0].namespace"),
        ("endpoints: [{name: a, namespace: 7}]", "endpoints[0].namespace"),
        ("endpoints: [", "not valid YAML"),
    ],
)
def test_endpoints_file_errors(text, message):
    with pytest.raises(EndpointsFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_endpoints(text)


def test_plain_keys_file_is_the_runtimes_format():
    keys = parse_keys_file("# team keys\nsk-1\nsk-2, sk-3\n")
    assert keys[digest("sk-2")] == Key(hashed_name("sk-2"))
    assert len(keys) == 3


def test_yaml_keys_file_carries_names_endpoints_and_admin():
    keys = parse_keys_file(
        "keys:\n  - {name: alice, key: sk-a, endpoints: [chat]}\n  - {name: ops, key: sk-o, admin: true}\n"
    )
    alice, ops = keys[digest("sk-a")], keys[digest("sk-o")]
    assert alice.may_use("chat") and not alice.may_use("code")
    assert ops.admin and ops.may_use("anything")
    with pytest.raises(KeyFileError, match=r"keys\[0\].key"):
        parse_keys_file("keys: [{name: x}]")
    with pytest.raises(KeyFileError, match=r"keys\[0\].endpoints"):
        parse_keys_file("keys: [{key: k, endpoints: chat}]")


def test_endpoint_keys_from_kubernetes_are_valid_on_their_endpoint_only():
    ring = KeyRing.from_settings(None, None)
    assert ring.allows(None, "a")  # nothing configured: open
    ring.set_endpoint_keys("a", ["ka"])
    ring.set_endpoint_keys("b", ["kb"])
    ka, kb = ring.identify("ka"), ring.identify("kb")
    assert ka.name == hashed_name("ka")  # the secret is never the name
    assert ring.allows(ka, "a") and not ring.allows(ka, "b") and not ring.allows(None, "a")
    assert ring.allows(kb, "b") and ring.allows(None, "c")  # c has no keys of its own
    ring.set_endpoint_keys("b", ["ka"])  # a key listed by two endpoints may use both
    assert ring.allows(ring.identify("ka"), "b")
    assert ring.identify("kb") is None


def test_docs_list_every_gateway_setting():
    from pathlib import Path

    from llmendpoints_gateway.config import GatewaySettings

    text = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    table = text.split("<!-- gateway-settings:start -->")[1].split("<!-- gateway-settings:end -->")[
        0
    ]
    for info in GatewaySettings.model_fields.values():
        assert f"| `{info.validation_alias}` |" in table, info.validation_alias
        assert info.description in table, info.validation_alias


def test_endpoint_slices_give_ready_pods_on_the_http_port():
    from llmendpoints_gateway.discovery.kube import endpoint_view, slice_backends

    slice_ = {
        "metadata": {"labels": {"kubernetes.io/service-name": "chat"}},
        "addressType": "IPv6",
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["fd00::1"], "conditions": {"ready": True}},
            {"addresses": ["fd00::2"], "conditions": {"ready": False, "terminating": True}},
            {"addresses": ["fd00::3"]},  # no conditions: ready, as Kubernetes reads it
        ],
    }
    assert slice_backends(slice_) == ("chat", ["http://[fd00::1]:8000", "http://[fd00::3]:8000"])
    assert slice_backends({**slice_, "ports": [{"name": "grpc", "port": 1}]}) == ("chat", [])
    view = endpoint_view(
        {
            "metadata": {"name": "chat", "namespace": "ml"},
            "spec": {
                "model": {"name": "org/m"},
                "routing": "least-loaded",
                "api": {"apiKeysSecretRef": {"name": "keys", "key": "k"}},
            },
        }
    )
    assert (view.models, view.routing, view.keys_secret) == (
        ("chat",),
        Strategy.LEAST_LOADED,
        ("keys", "k"),
    )
    served = endpoint_view(
        {"metadata": {"name": "chat"}, "spec": {"model": {"servedModelName": "m"}}}
    )
    assert served.models == ("m",) and served.routing is Strategy.PREFIX_AWARE

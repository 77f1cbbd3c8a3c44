"""LeaderWorkerSet v0.9.0 as the API server and LWS's admission webhook check it: the CRD's
schema (vendored, descriptions removed: tests/unit/operator/schemas/leaderworkerset-v0.9.0.yaml
names its source) and the webhook's own rules, which are Go code rather than schema."""

from __future__ import annotations

import functools
import pathlib
import re
from typing import Any

import jsonschema
import yaml

SCHEMA = pathlib.Path(__file__).parent / "unit/operator/schemas/leaderworkerset-v0.9.0.yaml"


@functools.cache
def schema() -> dict[str, Any]:
    """spec.versions[v1].schema.openAPIV3Schema of the LeaderWorkerSet CRD."""
    return yaml.load(SCHEMA.read_text(), Loader=yaml.CSafeLoader)


def check_like_the_webhook(lws: dict[str, Any]) -> None:
    """LWS v0.9.0's validating webhook (pkg/webhooks/leaderworkerset_webhook.go, generalValidate):
    the name is a DNS-1035 label (it names the headless Service), replicas >= 0, size >= 1,
    maxUnavailable and maxSurge not both 0."""
    name = lws["metadata"]["name"]
    assert len(name) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
    assert lws["spec"].get("replicas", 1) >= 0
    assert lws["spec"]["leaderWorkerTemplate"]["size"] >= 1
    config = lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
    assert (config["maxUnavailable"], config["maxSurge"]) not in {(0, 0), ("0%", "0%")}


def validate(lws: dict[str, Any]) -> None:
    """Raises when the API server (schema) or LWS's webhook would refuse `lws`."""
    jsonschema.Draft4Validator(schema()).validate(lws)
    check_like_the_webhook(lws)

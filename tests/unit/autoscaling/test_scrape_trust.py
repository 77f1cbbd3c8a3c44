"""The autoscaler fetches only from its own pods: EndpointSlices the EndpointSlice controller
manages, endpoints that are Pods. A slice anyone else writes is never a scrape target."""

from __future__ import annotations

from llmendpoints_operator.autoscaling.scrape import (
    ENDPOINTSLICE_CONTROLLER,
    MANAGED_BY_LABEL,
    ScrapeTarget,
    controller_pod_endpoints,
    targets_from_endpointslices,
)


def _slice(*endpoints, managed_by: str | None = ENDPOINTSLICE_CONTROLLER):
    labels = {"kubernetes.io/service-name": "chat"}
    if managed_by is not None:
        labels[MANAGED_BY_LABEL] = managed_by
    return {
        "metadata": {"labels": labels},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": list(endpoints),
    }


def _endpoint(address: str, kind: str | None = "Pod", name: str = "chat-a"):
    endpoint = {"addresses": [address], "conditions": {"ready": True}}
    if kind is not None:
        endpoint["targetRef"] = {"kind": kind, "name": name}
    return endpoint


def _targets(slices) -> tuple[ScrapeTarget, ...]:
    return targets_from_endpointslices(controller_pod_endpoints(slices)).ready


def test_the_controllers_pod_endpoints_are_scraped() -> None:
    assert _targets([_slice(_endpoint("10.0.0.1"))]) == (
        ScrapeTarget("chat-a", "http://10.0.0.1:8000/metrics"),
    )


def test_a_slice_someone_else_wrote_is_never_fetched() -> None:
    forged = [
        _slice(_endpoint("169.254.169.254", name="chat-x"), managed_by=None),
        _slice(_endpoint("10.96.0.1", name="chat-y"), managed_by="my-controller.example.com"),
    ]
    assert _targets(forged) == ()
    assert controller_pod_endpoints(forged) == []


def test_endpoints_that_are_not_pods_are_dropped() -> None:
    slices = [
        _slice(
            _endpoint("10.0.0.1"),
            _endpoint("10.0.0.9", kind=None, name="-"),  # an address with no object behind it
            _endpoint("10.0.0.8", kind="Node", name="node-1"),
        )
    ]
    assert [t.url for t in _targets(slices)] == ["http://10.0.0.1:8000/metrics"]


def test_the_filter_leaves_its_input_alone() -> None:
    slices = [_slice(_endpoint("10.0.0.1"), _endpoint("10.0.0.2", kind="Node"))]
    controller_pod_endpoints(slices)
    assert len(slices[0]["endpoints"]) == 2

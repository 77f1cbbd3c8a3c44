"""controller.Autoscaler.tick with a fake API client and a fake scraper: what one decision
writes (the Deployment's replicas, status.autoscaling) and which Event it posts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from llmendpoints_operator.autoscaling.controller import Autoscaler, Subject
from llmendpoints_operator.autoscaling.metrics import AutoscalerMetrics
from llmendpoints_operator.autoscaling.policy import ScalingPolicy
from llmendpoints_operator.autoscaling.scrape import ScrapeResult, ScrapeTarget, observe

SLICE = {  # as the EndpointSlice controller writes it (the only slices the autoscaler trusts)
    "metadata": {
        "labels": {
            "kubernetes.io/service-name": "chat",
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
        }
    },
    "ports": [{"name": "http", "port": 8000}],
    "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "chat-a"}}],
}


class FakeKube:
    def __init__(self) -> None:
        self.patches: list[tuple[str, str | None, Mapping[str, Any]]] = []

    async def list(
        self, api_version: str, kind: str, namespace: str, *, label_selector: str
    ) -> list[dict[str, Any]]:
        assert (kind, label_selector) == ("EndpointSlice", "kubernetes.io/service-name=chat")
        return [SLICE]

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        self.patches.append((kind, subresource, patch))
        return {}


class FakeScraper:
    def __init__(self, queue_depth: float, in_flight: float) -> None:
        self.pod = (queue_depth, in_flight)

    async def scrape(self, targets: Iterable[ScrapeTarget]) -> ScrapeResult:
        assert [t.url for t in targets] == ["http://10.0.0.1:8000/metrics"]
        return ScrapeResult(observe([self.pod]))

    async def close(self) -> None:
        pass


def _tick_setup(queue_depth: float) -> tuple[Autoscaler, FakeKube, list[tuple[str, str, str]]]:
    kube, events = FakeKube(), []
    scaler = Autoscaler(
        kube=lambda: kube,
        post_event=lambda obj, type_, reason, message: events.append((type_, reason, message)),
        metrics=AutoscalerMetrics(),
        scraper=FakeScraper(queue_depth, in_flight=4),  # type: ignore[arg-type]
        clock=lambda: 1_700_000_000.0,
    )
    return scaler, kube, events


SUBJECT = Subject(
    owner={"metadata": {"namespace": "team", "name": "chat"}, "status": {}},
    api_version="llmendpoints.dev/v1alpha1",
    kind="LLMEndpoint",
    policy=ScalingPolicy(minReplicas=1, maxReplicas=4),
    service="chat",
    deployment="chat",
    replicas=1,
    ready_replicas=1,
)


async def test_a_scale_change_patches_the_deployment_and_posts_its_event() -> None:
    scaler, kube, events = _tick_setup(queue_depth=20)

    decision = await scaler.tick(SUBJECT)

    assert decision is not None and decision.replicas == 2
    assert kube.patches[0] == ("Deployment", None, {"spec": {"replicas": 2}})
    assert events == [("Normal", "ScaleUp", decision.reason)]
    kind, subresource, patch = kube.patches[1]
    assert (kind, subresource) == ("LLMEndpoint", "status")
    assert patch["status"]["autoscaling"]["lastDecisions"][0]["to"] == 2


async def test_a_hold_writes_status_but_neither_replicas_nor_an_event() -> None:
    scaler, kube, events = _tick_setup(queue_depth=0)

    decision = await scaler.tick(SUBJECT)

    assert decision is not None and decision.replicas == 1
    assert [(kind, sub) for kind, sub, _ in kube.patches] == [("LLMEndpoint", "status")]
    assert events == []


class FakeOutside:
    def __init__(self, outside) -> None:
        self.outside = outside
        self.reads = 0

    async def read(self, endpoint: str):
        self.reads += 1
        return self.outside

    async def close(self) -> None:
        pass


async def test_a_batch_that_will_miss_its_window_is_said_once_in_an_event_a_metric_and_status():
    from llmendpoints_common.batch.signal import BatchSignal
    from llmendpoints_operator.autoscaling.decision import Outside

    now = 1_700_000_000.0
    late = BatchSignal("batch_late", remaining=100_000, deadline=now + 600, rate=1.0)
    scaler, kube, events = _tick_setup(queue_depth=0)
    scaler.set_outside(FakeOutside(Outside(batches=(late,))))

    decision = await scaler.tick(SUBJECT)
    await scaler.tick(SUBJECT)

    assert decision.batches_at_risk == ("batch_late",)
    warnings = [e for e in events if e[0] == "Warning"]
    assert len(warnings) == 1 and warnings[0][1] == "BatchAtRisk"
    assert "batch_late" in warnings[0][2] and "maxReplicas 4" in warnings[0][2]
    metric = scaler._metrics.registry.get_sample_value(
        "llmendpoints_autoscaler_batches_at_risk", {"endpoint": "team/chat"}
    )
    assert metric == 1
    status = next(p for kind, _, p in kube.patches if kind == "LLMEndpoint")
    signals = status["status"]["autoscaling"]["signals"]
    assert signals["batchesAtRisk"] == 1 and signals["batchRequests"] == 100_000


def _starting(min_replicas: int) -> Subject:
    """One replica asked for, none ready yet (the Deployment's readyReplicas is 0)."""
    from dataclasses import replace

    return replace(
        SUBJECT,
        policy=ScalingPolicy(minReplicas=min_replicas, maxReplicas=4, scaleToZeroAfterSeconds=0),
        ready_replicas=0,
    )


async def test_an_endpoint_with_no_ready_replica_is_not_scraped_and_at_min_1_not_ticked() -> None:
    from llmendpoints_operator.autoscaling.decision import Outside

    scaler, kube, _ = _tick_setup(queue_depth=0)
    outside = FakeOutside(Outside())
    scaler.set_outside(outside)
    assert await scaler.tick(_starting(min_replicas=1)) is None
    assert kube.patches == [] and outside.reads == 0


async def test_at_min_0_an_endpoint_with_no_ready_replica_goes_to_zero_when_nothing_waits():
    from llmendpoints_operator.autoscaling.decision import Outside

    scaler, kube, events = _tick_setup(queue_depth=0)
    scaler.set_outside(FakeOutside(Outside()))
    decision = await scaler.tick(_starting(min_replicas=0))  # nothing listed, nothing scraped
    assert decision is not None and decision.to_zero
    assert kube.patches[0][:2] == ("Deployment", None)
    assert kube.patches[0][2]["spec"] == {"replicas": 0}
    assert events == [("Normal", "ScaleToZero", decision.reason)]
    assert "no replica became ready" in decision.reason


async def test_at_min_0_a_replica_not_ready_yet_is_kept_while_its_work_waits():
    from llmendpoints_operator.autoscaling.decision import Outside

    scaler, kube, events = _tick_setup(queue_depth=0)
    scaler.set_outside(FakeOutside(Outside(jobs_queued=1)))
    decision = await scaler.tick(_starting(min_replicas=0))
    assert decision is not None and decision.replicas == 1 and events == []
    assert [kind for kind, _, _ in kube.patches] == ["LLMEndpoint"]  # status only
    assert "waiting for it: 1 queued job(s)" in decision.reason


def _groups(replicas: int, ready: int, min_replicas: int = 1) -> Subject:
    from dataclasses import replace

    return replace(
        SUBJECT,
        deployment="chat-group",
        workload=("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
        policy=ScalingPolicy(minReplicas=min_replicas, maxReplicas=3, scaleToZeroAfterSeconds=0),
        replicas=replicas,
        ready_replicas=ready,
    )


async def test_a_multi_node_endpoint_scales_its_leader_worker_set_in_whole_groups() -> None:
    """The Service lists one leader per group (SLICE's one pod): its queue is the group's."""
    scaler, kube, events = _tick_setup(queue_depth=20)
    decision = await scaler.tick(_groups(replicas=1, ready=1))
    assert decision is not None and decision.replicas == 2  # groups, at most maxReplicas 3
    assert kube.patches[0] == ("LeaderWorkerSet", None, {"spec": {"replicas": 2}})
    assert events == [("Normal", "ScaleUp", decision.reason)]


async def test_groups_scale_to_zero_and_back_from_the_work_that_waits() -> None:
    from llmendpoints_operator.autoscaling.decision import Outside

    scaler, kube, _ = _tick_setup(queue_depth=0)
    scaler.set_outside(FakeOutside(Outside()))
    decision = await scaler.tick(_groups(replicas=1, ready=0, min_replicas=0))
    assert decision is not None and decision.to_zero
    assert kube.patches[0][:2] == ("LeaderWorkerSet", None)
    assert kube.patches[0][2]["spec"] == {"replicas": 0}
    assert kube.patches[0][2]["metadata"]["annotations"]  # why it is at zero, on the workload

    scaler, kube, _ = _tick_setup(queue_depth=0)
    scaler.set_outside(FakeOutside(Outside(jobs_queued=3)))
    decision = await scaler.tick(_groups(replicas=0, ready=0, min_replicas=0))
    assert decision is not None and decision.from_zero and decision.replicas >= 1
    assert kube.patches[0][:2] == ("LeaderWorkerSet", None)
    assert kube.patches[0][2]["spec"] == {"replicas": decision.replicas}

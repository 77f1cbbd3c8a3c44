"""Cold start, engineered, end to end on the operator's side: the real operator against kmock's
Kubernetes API (and a real nats-server: scale to zero needs the queue).

- A ``minReplicas: 0`` endpoint gets its pre-pull DaemonSet (the runtime image, the pods'
  nodeSelector and tolerations, no GPU) and its download Job; both owned by it; neither for an
  endpoint that keeps a replica.
- The Downloaded condition follows the Job: attempts failing (the reason shown, retried), then
  done (bytes, seconds); a new model is a new Job, the old one deleted.
- status.coldStart.last is filled from a runtime pod's conditions, its Pulled Event and the
  runtime's start-up phases on its /metrics (a stand-in server on the pod's control port), and
  the operator's histograms count it.
- A multi-node endpoint (``nodes: 2``): the same pre-pull for leaders and workers, one download;
  a group's worker is not a start of its own, the leader's is the group's.

kmock has no controllers: the test plays the Job controller and the kubelet (pods, statuses,
Events), as the other integration tests play the Deployment controller.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from llmendpoints_operator.coldstart import manifests as cs
from ports import free_port

from .kube_emulator import CHILD_RESOURCES, LLMEP, Cluster, Operator, endpoint, until
from .nats_kit import nats_server

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]

NS = "cold"
JOBS, DAEMONSETS, PODS = (CHILD_RESOURCES[k] for k in ("Job", "DaemonSet", "Pod"))
EVENTS = "v1/events"
RUNTIME_IMAGE = "registry.example/runtime:9.9"

SPEC: dict[str, Any] = {
    "model": {"name": "org/model", "revision": "a" * 40},
    "resources": {
        "gpus": 1,
        "nodeSelector": {"pool": "l4"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm"}],
    },
    "cache": {"size": "50Gi"},
    "scaling": {"minReplicas": 0, "maxReplicas": 2},
}

PHASES = """\
llmendpoints_startup_phase_seconds{phase="startup"} 7.5
llmendpoints_startup_phase_seconds{phase="download"} 0.0
llmendpoints_startup_phase_seconds{phase="load"} 30.0
llmendpoints_startup_phase_seconds{phase="compile"} 9.0
llmendpoints_startup_phase_seconds{phase="warmup"} 0.5
llmendpoints_startup_phase_seconds{phase="ready"} 30.5
llmendpoints_startup_compile_source{source="cache"} 1
"""


@pytest.fixture(scope="module")
def nats_url() -> AsyncIterator[str]:
    with nats_server() as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def operator(cluster, nats_url, tmp_path_factory) -> AsyncIterator[Operator]:
    tmp = tmp_path_factory.mktemp("operator")
    op = Operator(
        cluster.write_kubeconfig(tmp / "kubeconfig"),
        tmp / "operator.log",
        env={
            "LLMEP_OPERATOR_JOBS_QUEUE_URL": nats_url,
            "LLMEP_OPERATOR_GATEWAY_URL": "http://gateway.llmendpoints.svc:8080",
            "LLMEP_OPERATOR_RUNTIME_IMAGE": RUNTIME_IMAGE,
        },
        metrics_port=free_port(),
    )
    await op.start()
    yield op
    await op.stop()


def _status(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get(LLMEP, NS, name) or {}).get("status") or {}


def _condition(cluster: Cluster, name: str, kind: str) -> dict[str, Any]:
    conditions = _status(cluster, name).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def _jobs(cluster: Cluster, name: str) -> set[str]:
    return {n for n in cluster.names(JOBS, NS) if n.startswith(f"{name}-download-")}


def _owned_by(obj: dict[str, Any], name: str) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    return any(
        r["kind"] == "LLMEndpoint" and r["name"] == name and r.get("controller") for r in refs
    )


def _download_pod(name: str, job: str, phase: str, report: dict, created: str) -> dict[str, Any]:
    terminated = {"exitCode": 0 if phase == "Succeeded" else 1, "message": json.dumps(report)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-{created[-3:-1]}",
            "namespace": NS,
            "creationTimestamp": created,
            "labels": {
                "app.kubernetes.io/managed-by": "llmendpoints-operator",
                "app.kubernetes.io/instance": name,
                "app.kubernetes.io/component": cs.COMPONENT_DOWNLOAD,
                "job-name": job,
            },
        },
        "spec": {"containers": [{"name": "download", "image": RUNTIME_IMAGE}]},
        "status": {
            "phase": phase,
            "containerStatuses": [{"name": "download", "state": {"terminated": terminated}}],
        },
    }


async def test_a_scale_to_zero_endpoint_gets_its_prepull_and_its_download(cluster, operator):
    name = "zero"
    await cluster.create(LLMEP, NS, endpoint(name, NS, SPEC))

    ds = await until(operator, lambda: cluster.get(DAEMONSETS, NS, f"{name}-prepull"), "prepull")
    pod = ds["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["image"] == RUNTIME_IMAGE
    assert pod["nodeSelector"] == {"pool": "l4"}
    assert {"key": "dedicated", "operator": "Equal", "value": "llm"} in pod["tolerations"]
    assert "nvidia.com/gpu" not in json.dumps([c["resources"] for c in pod["containers"]])
    assert "nvidia.com/gpu" not in json.dumps([c["resources"] for c in pod["initContainers"]])
    assert _owned_by(ds, name)  # garbage-collected with the endpoint

    jobs = await until(operator, lambda: _jobs(cluster, name), "the download Job")
    (job_name,) = jobs
    job = cluster.get(JOBS, NS, job_name)
    assert _owned_by(job, name)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == RUNTIME_IMAGE and container["args"][0] == "download"
    assert {"name": "MODEL_NAME", "value": "org/model"} in container["env"]
    await until(
        operator,
        lambda: _condition(cluster, name, "Downloaded").get("reason") in ("Pending", "Downloading"),
        "Downloaded=False while it runs",
    )

    # An attempt fails: the Job retries it (its back-off); the reason is shown meanwhile.
    error = "MODEL_NAME 'org/model': GatedRepoError: 401 Client Error"
    await cluster.create(
        PODS, NS, _download_pod(name, job_name, "Failed", {"error": error}, "2026-01-01T00:00:01Z")
    )
    await cluster.patch(JOBS, NS, job_name, {"status": {"failed": 1, "active": 1}})
    retrying = await until(
        operator,
        lambda: (c := _condition(cluster, name, "Downloaded")).get("reason") == "Retrying" and c,
        "Downloaded=False, Retrying",
    )
    assert retrying["status"] == "False" and "401 Client Error" in retrying["message"]

    # The next attempt succeeds: bytes and time in status.
    report = {"bytes": 3 * 1024**3, "fetchedBytes": 3 * 1024**3, "seconds": 42.0}
    await cluster.create(
        PODS, NS, _download_pod(name, job_name, "Succeeded", report, "2026-01-01T00:01:02Z")
    )
    complete = {"type": "Complete", "status": "True"}
    await cluster.patch(
        JOBS,
        NS,
        job_name,
        {"status": {"active": 0, "succeeded": 1, "conditions": [complete],
                    "completionTime": "2026-01-01T00:01:50Z"}},
    )  # fmt: skip
    done = await until(
        operator,
        lambda: _condition(cluster, name, "Downloaded").get("status") == "True",
        "Downloaded=True",
    )
    assert done
    download = _status(cluster, name)["download"]
    assert download["bytes"] == 3 * 1024**3 and download["seconds"] == 42.0
    assert download["job"] == job_name

    # A new revision: a new Job; the old one goes.
    new_revision = {"spec": {"model": {"name": "org/model", "revision": "b" * 40}}}
    await cluster.patch(LLMEP, NS, name, new_revision)
    newer = await until(
        operator,
        lambda: (jobs := _jobs(cluster, name)) and job_name not in jobs and jobs,
        "a Job for the new revision, the old one deleted",
    )
    assert len(newer) == 1

    # Keeping a replica: no pre-pull, no download ahead.
    await cluster.patch(LLMEP, NS, name, {"spec": {"scaling": {"minReplicas": 1}}})
    await until(
        operator,
        lambda: cluster.get(DAEMONSETS, NS, f"{name}-prepull") is None and not _jobs(cluster, name),
        "the pre-pull and the Job deleted",
    )
    await until(
        operator,
        lambda: not _condition(cluster, name, "Downloaded"),
        "no Downloaded condition any more",
    )


async def _phases_server(port: int) -> web.AppRunner:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=PHASES, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _at(now: datetime.datetime, seconds: float) -> str:
    return (now + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _runtime_pod(name: str, control_port: int) -> dict[str, Any]:
    """A pod that turned Ready just now, 90 s after it was created (the recorder takes only
    recent starts: an operator restart sees old pods again)."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-5d8c-x2x",
            "namespace": NS,
            "creationTimestamp": _at(now, -90),
            "labels": {
                "app.kubernetes.io/managed-by": "llmendpoints-operator",
                "app.kubernetes.io/instance": name,
                "app.kubernetes.io/component": "inference",
                "llmendpoints.dev/endpoint": name,
            },
        },
        "spec": {
            "nodeName": "gpu-7",
            "containers": [
                {
                    "name": "runtime",
                    "image": RUNTIME_IMAGE,
                    "ports": [
                        {"name": "http", "containerPort": 8000},
                        {"name": "control", "containerPort": control_port},
                    ],
                }
            ],
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": _at(now, -87)},
                {"type": "Ready", "status": "True", "lastTransitionTime": _at(now, 0)},
            ],
            "containerStatuses": [
                {"name": "runtime", "restartCount": 0,
                 "state": {"running": {"startedAt": _at(now, -45)}}}
            ],
        },
    }  # fmt: skip


async def _last_cold_start(cluster: Cluster, operator: Operator, name: str) -> dict[str, Any]:
    def last() -> dict[str, Any] | None:
        return (_status(cluster, name).get("coldStart") or {}).get("last")

    return await until(operator, last, "status.coldStart.last")


async def test_a_cold_start_is_recorded_phase_by_phase(cluster, operator):
    name = "timed"
    spec = {**SPEC, "cache": None}
    spec = {k: v for k, v in spec.items() if v is not None}
    await cluster.create(LLMEP, NS, endpoint(name, NS, spec))
    await until(operator, lambda: _status(cluster, name).get("phase"), "a first status")

    port = free_port()
    runner = await _phases_server(port)
    try:
        pod = _runtime_pod(name, port)
        pulled = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{pod['metadata']['name']}.pulled", "namespace": NS},
            "involvedObject": {
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "namespace": NS,
                "fieldPath": "spec.containers{runtime}",
            },
            "reason": "Pulled",
            "message": f'Successfully pulled image "{RUNTIME_IMAGE}" in 38.2s (38.2s including '
            "waiting). Image size: 9876543210 bytes.",
            "lastTimestamp": pod["metadata"]["creationTimestamp"],
            "type": "Normal",
        }
        await cluster.create(EVENTS, NS, pulled)
        await cluster.create(PODS, NS, pod)
        last = await _last_cold_start(cluster, operator, name)
    finally:
        await runner.cleanup()

    assert last["pod"] == pod["metadata"]["name"] and last["node"] == "gpu-7"
    assert last["seconds"] == 90.0 and last["fromZero"] is True
    assert last["image"] == "pulled" and last["compileCache"] == "cache"
    assert last["phases"] == {
        "scheduling": 3.0,
        "imagePull": 38.2,
        "containerStart": 3.8,
        "startup": 7.5,
        "download": 0.0,
        "load": 30.0,
        "compile": 9.0,
        "warmup": 0.5,
        "readiness": 7.0,  # 45 s running, 38 of them in the runtime's own phases
    }
    text = await operator.metrics()
    labels = f'endpoint="{NS}/{name}"'
    assert f'llmendpoints_operator_cold_start_seconds_count{{{labels},from_zero="true"}} 1.0' in (
        text
    )
    assert (
        f'llmendpoints_operator_cold_start_phase_seconds_sum{{{labels},phase="imagePull"}} 38.2'
        in (text)
    )
    # The reconcile leaves the recorder's block alone.
    await cluster.patch(LLMEP, NS, name, {"spec": {"scaling": {"maxReplicas": 3}}})
    await until(
        operator,
        lambda: _status(cluster, name).get("observedGeneration") == 2,
        "the update reconciled",
    )
    assert _status(cluster, name)["coldStart"]["last"] == last


async def test_a_multi_node_endpoint_prepulls_for_its_workers_and_records_its_leaders_start(
    cluster, operator
):
    """nodes: 2 -- one DaemonSet with the placement leaders and workers share (LeaderWorkerSet
    need not be installed for it), one download Job for the shared cache; a group's worker
    turning Ready is not a start of its own, nor another replica: the leader's start is the
    group's, from zero."""
    name = "wide"
    spec = {**SPEC, "resources": {**SPEC["resources"], "gpus": 8, "nodes": 2}}
    await cluster.create(LLMEP, NS, endpoint(name, NS, spec))
    ds = await until(operator, lambda: cluster.get(DAEMONSETS, NS, f"{name}-prepull"), "prepull")
    pod = ds["spec"]["template"]["spec"]
    assert (
        pod["nodeSelector"] == {"pool": "l4"} and pod["initContainers"][0]["image"] == RUNTIME_IMAGE
    )
    assert {"key": "dedicated", "operator": "Equal", "value": "llm"} in pod["tolerations"]
    await until(operator, lambda: _jobs(cluster, name), "the download Job")

    index = "leaderworkerset.sigs.k8s.io/worker-index"
    worker, leader = _runtime_pod(name, free_port()), _runtime_pod(name, free_port())
    worker["metadata"]["name"], leader["metadata"]["name"] = f"{name}-group-0-1", f"{name}-group-0"
    worker["metadata"]["labels"][index], leader["metadata"]["labels"][index] = "1", "0"
    await cluster.create(PODS, NS, worker)
    await cluster.create(PODS, NS, leader)
    last = await _last_cold_start(cluster, operator, name)
    assert last["pod"] == f"{name}-group-0" and last["fromZero"] is True

"""Cold start's pure parts (operator/llmendpoints_operator/coldstart/): the download Job and the
pre-pull DaemonSet (golden, and against Kubernetes' schemas), when an endpoint gets them, the
Downloaded condition from a Job's life, and status.coldStart.last from a pod's conditions,
Events and the runtime's phases.

Regenerate the golden file after an intended change with
`UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/operator/test_coldstart.py`.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import kubernetes_validate
import pytest
import yaml
from llmendpoints_operator import groups
from llmendpoints_operator.coldstart import manifests as cs
from llmendpoints_operator.coldstart import record
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import parse

GOLDEN = pathlib.Path(__file__).parent / "golden" / "coldstart-scale-to-zero.yaml"
SETTINGS = OperatorSettings(runtime_image="registry.example/runtime:1.2.3")
K8S_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]

SCALE_TO_ZERO: dict[str, Any] = {
    "model": {
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "revision": "0e9e39f249a16976918f6564b8830bc894c89659",
        "hfTokenSecretRef": {"name": "hf-token", "key": "token"},
    },
    "engine": {
        "imagePullSecrets": [{"name": "registry"}],
        "env": [{"name": "HF_ENDPOINT", "value": "https://hub.mirror.example"}],
    },
    "resources": {
        "gpus": 1,
        "requests": {"cpu": "4", "memory": "32Gi"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "topology.kubernetes.io/zone",
                                    "operator": "In",
                                    "values": ["a"],
                                }
                            ]
                        }
                    ]
                }
            },
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 1,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {
                                "matchLabels": {"llmendpoints.dev/endpoint": "llama"}
                            },
                        },
                    }
                ]
            },
        },
    },
    "cache": {"size": "100Gi"},
    "scaling": {"minReplicas": 0, "maxReplicas": 2},
}


def _endpoint(spec: dict[str, Any] = SCALE_TO_ZERO, name: str = "llama"):
    return parse(name, "team", spec, scale_to_zero=True)


def _with(**changes: Any) -> dict[str, Any]:
    spec = json.loads(json.dumps(SCALE_TO_ZERO))
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return spec


def _built(ep) -> list[dict[str, Any]]:
    return [
        obj
        for obj in (cs.build_prepull_daemonset(ep, SETTINGS), cs.build_download_job(ep, SETTINGS))
        if obj is not None
    ]


# --- the children ------------------------------------------------------------------------------


def test_golden() -> None:
    built = _built(_endpoint())
    text = yaml.safe_dump_all(built, sort_keys=False, width=100)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert list(yaml.safe_load_all(GOLDEN.read_text())) == built


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_children_pass_the_kubernetes_schemas(version: str) -> None:
    for obj in _built(_endpoint()):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_prepull_pods_run_the_runtime_image_where_the_replicas_may_run_without_a_gpu() -> None:
    ds = cs.build_prepull_daemonset(_endpoint(), SETTINGS)
    pod = ds["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["image"] == "registry.example/runtime:1.2.3"
    assert pod["initContainers"][0]["command"] == ["llmendpoints-runtime", "--version"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert pod["affinity"] == {
        "nodeAffinity": SCALE_TO_ZERO["resources"]["affinity"]["nodeAffinity"]
    }
    assert {"key": "dedicated", "operator": "Equal", "value": "llm"} in pod["tolerations"]
    # The replicas' GPU request gives them the GPU taint's toleration; these pods ask for it.
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    for container in [*pod["initContainers"], *pod["containers"]]:
        resources = json.dumps(container["resources"])
        assert "gpu" not in resources
        assert container["resources"]["requests"]["cpu"] in ("1m", "10m")
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    # Not a replica: outside the Deployment's, the Service's and the PDB's selector.
    assert "llmendpoints.dev/endpoint" not in ds["spec"]["template"]["metadata"]["labels"]


def test_the_prepull_and_download_pods_get_no_api_identity_and_run_locked_down() -> None:
    """They run the endpoint author's image, as the replicas do: no ServiceAccount token, the
    runtime's non-root security contexts (docs/security.md)."""
    for obj in _built(_endpoint()):
        pod = obj["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in [*pod.get("initContainers", ()), *pod["containers"]]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_the_download_job_fills_the_cache_the_replicas_mount() -> None:
    ep = _endpoint()
    job = cs.build_download_job(ep, SETTINGS)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["download", "--report", "/dev/termination-log"]
    env = {v["name"]: v.get("value", v.get("valueFrom")) for v in container["env"]}
    assert env["MODEL_NAME"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert env["MODEL_REVISION"] == SCALE_TO_ZERO["model"]["revision"]
    assert env["BASE_PATH"] == "/models"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env["HF_ENDPOINT"] == "https://hub.mirror.example"
    volume = job["spec"]["template"]["spec"]["volumes"][0]
    assert volume["persistentVolumeClaim"]["claimName"] == "llama-model-cache"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] == cs.DOWNLOAD_BACKOFF_LIMIT
    assert len(job["metadata"]["name"]) <= 63


def test_a_new_model_is_a_new_job_and_the_same_model_the_same_one() -> None:
    first = cs.download_job_name(_endpoint())
    assert cs.download_job_name(_endpoint()) == first
    other = _with(model__revision="1111111111111111111111111111111111111111")
    assert cs.download_job_name(_endpoint(other)) != first
    long_a, long_b = "a" * 45 + "xxxx", "a" * 45 + "yyyy"
    assert cs.download_job_name(_endpoint(name=long_a)) != cs.download_job_name(
        _endpoint(name=long_b)
    )


@pytest.mark.parametrize(
    ("change", "prepull", "download"),
    [
        ({}, True, True),
        ({"scaling__minReplicas": 1}, False, False),
        ({"cache": None}, True, False),  # no shared volume: nothing to fill
        ({"cache__accessModes": ["ReadOnlyMany"]}, True, False),  # the Job could not write
        ({"model__name": "/models/llama"}, True, False),  # a path: nothing to download
    ],
)
def test_who_gets_what(change: dict, prepull: bool, download: bool) -> None:
    ep = _endpoint(_with(**change))
    assert (cs.build_prepull_daemonset(ep, SETTINGS) is not None) is prepull
    assert (cs.build_download_job(ep, SETTINGS) is not None) is download


def test_the_operator_settings_turn_them_off() -> None:
    off = OperatorSettings(prepull_images=False, download_ahead=False)
    assert cs.build_prepull_daemonset(_endpoint(), off) is None
    assert cs.build_download_job(_endpoint(), off) is None


# --- the Downloaded condition ------------------------------------------------------------------


def _job(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "llama-download-x"}, "status": status}


def _attempt(phase: str, message: str | None, created: str, exit_code: int = 0) -> dict[str, Any]:
    terminated = {"exitCode": exit_code, "reason": "Error" if exit_code else "Completed"}
    if message is not None:
        terminated["message"] = message
    return {
        "metadata": {"name": f"p-{created}", "creationTimestamp": created},
        "status": {
            "phase": phase,
            "containerStatuses": [{"name": "download", "state": {"terminated": terminated}}],
        },
    }


def test_a_completed_download_shows_its_bytes_and_time() -> None:
    report = json.dumps({"bytes": 16 * 1024**3, "fetchedBytes": 16 * 1024**3, "seconds": 95.2})
    state = record.download_state(
        _job(succeeded=1, completionTime="2026-01-01T00:02:00Z"),
        [_attempt("Succeeded", report, "2026-01-01T00:00:00Z")],
        model="m",
    )
    assert (state.status, state.reason) == ("True", "Downloaded")
    assert state.block == {
        "job": "llama-download-x",
        "model": "m",
        "bytes": 16 * 1024**3,
        "fetchedBytes": 16 * 1024**3,
        "seconds": 95.2,
        "completedAt": "2026-01-01T00:02:00Z",
    }
    assert "16.00 GiB" in state.message and "95 s" in state.message


def test_failed_attempts_are_retried_and_the_last_reason_is_shown() -> None:
    pods = [
        _attempt("Failed", json.dumps({"error": "first"}), "2026-01-01T00:00:00Z", 1),
        _attempt(
            "Failed", json.dumps({"error": "MODEL_NAME 'x': 401 gated"}), "2026-01-01T00:01:00Z", 1
        ),
    ]
    retrying = record.download_state(_job(failed=2, active=1), pods, model="m")
    assert (retrying.status, retrying.reason) == ("False", "Retrying")
    assert "401 gated" in retrying.message and "retrying" in retrying.message
    assert retrying.block["lastError"] == "MODEL_NAME 'x': 401 gated"
    failed = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
    gave_up = record.download_state(_job(failed=9, conditions=[failed]), pods, model="m")
    assert (gave_up.status, gave_up.reason) == ("False", "DownloadFailed")
    assert "Delete Job llama-download-x" in gave_up.message


def test_a_crash_without_a_report_shows_the_logs_tail() -> None:
    pods = [
        _attempt("Failed", "Traceback...\nMemoryError: out of memory", "2026-01-01T00:00:00Z", 137)
    ]
    state = record.download_state(_job(failed=1), pods, model="m")
    assert state.block["lastError"] == "MemoryError: out of memory"


def test_pending_and_running() -> None:
    assert record.download_state(None, [], model="m").reason == "Pending"
    assert record.download_state(_job(active=1), [], model="m").reason == "Downloading"


def test_the_condition_keeps_its_transition_time_while_its_status_holds() -> None:
    state = record.download_state(_job(active=1), [], model="m")
    first = record.with_download({"conditions": []}, state, {}, "2026-01-01T00:00:00Z")
    condition = first["conditions"][-1]
    assert condition["type"] == "Downloaded" and condition["lastTransitionTime"].endswith("00:00Z")
    again = record.with_download({"conditions": []}, state, first, "2026-01-01T00:05:00Z")
    assert again["conditions"][-1]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert record.with_download({"conditions": []}, None, first, "x") == {"conditions": []}


# --- the cold start record ---------------------------------------------------------------------

METRICS = """\
# HELP llmendpoints_startup_phase_seconds ...
llmendpoints_startup_phase_seconds{phase="startup"} 8.5
llmendpoints_startup_phase_seconds{phase="download"} 0.01
llmendpoints_startup_phase_seconds{phase="load"} 41.2
llmendpoints_startup_phase_seconds{phase="compile"} 12.25
llmendpoints_startup_phase_seconds{phase="warmup"} 0.3
llmendpoints_startup_phase_seconds{phase="ready"} 41.5
llmendpoints_startup_compile_source{source="cache"} 1.0
"""


def _pod(**overrides: Any) -> dict[str, Any]:
    pod = {
        "metadata": {"name": "llama-7f9-x", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"nodeName": "gpu-1"},
        "status": {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "True",
                    "lastTransitionTime": "2026-01-01T00:00:02Z",
                },
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:01:40Z"},
            ],
            "containerStatuses": [
                {
                    "name": "runtime",
                    "restartCount": 0,
                    "state": {"running": {"startedAt": "2026-01-01T00:00:40Z"}},
                }
            ],
        },
    }
    pod.update(overrides)
    return pod


def _pulled(message: str) -> dict[str, Any]:
    return {
        "reason": "Pulled",
        "message": message,
        "involvedObject": {"name": "llama-7f9-x", "fieldPath": "spec.containers{runtime}"},
        "lastTimestamp": "2026-01-01T00:00:37Z",
    }


def test_a_cold_start_phase_by_phase() -> None:
    events = [_pulled('Successfully pulled image "r:1" in 34.5s (34.5s including waiting)')]
    startup = record.parse_runtime_startup(METRICS)
    last = record.cold_start(_pod(), events, startup, container="runtime", from_zero=True)
    assert last == {
        "pod": "llama-7f9-x",
        "node": "gpu-1",
        "createdAt": "2026-01-01T00:00:00Z",
        "readyAt": "2026-01-01T00:01:40Z",
        "seconds": 100.0,
        "fromZero": True,
        "image": "pulled",
        "compileCache": "cache",
        "phases": {
            "scheduling": 2.0,
            "imagePull": 34.5,
            "containerStart": 3.5,  # 38 s from scheduled to running, 34.5 of them pulling
            "startup": 8.5,
            "download": 0.0,
            "load": 41.2,
            "compile": 12.2,  # part of load
            "warmup": 0.3,
            "readiness": 10.0,  # 60 s running, 50 of them in the runtime's phases
        },
    }


def test_an_image_already_on_the_node_and_a_pod_without_phases() -> None:
    events = [_pulled('Container image "r:1" already present on machine')]
    last = record.cold_start(
        _pod(), events, record.RuntimeStartup(), container="runtime", from_zero=False
    )
    assert last["image"] == "present" and last["phases"]["imagePull"] == 0.0
    assert "load" not in last["phases"] and "readiness" not in last["phases"]
    not_ready = _pod(status={"conditions": []})
    assert (
        record.cold_start(
            not_ready, [], record.RuntimeStartup(), container="runtime", from_zero=False
        )
        is None
    )


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("34.5s", 34.5), ("1m2.5s", 62.5), ("1h0m3s", 3603.0), ("250ms", 0.25), ("x", None)],
)
def test_go_durations(text: str, seconds: float | None) -> None:
    assert record.go_duration(text) == seconds


# --- which pods the recorder records ------------------------------------------------------------


def _recorder(now: str):
    from llmendpoints_operator.coldstart.recorder import ColdStartMetrics, ColdStartRecorder
    from prometheus_client import CollectorRegistry

    def clock():
        return record.parse_time(now)

    return ColdStartRecorder(
        kube=None, fetch=None, metrics=ColdStartMetrics(CollectorRegistry()), clock=clock
    )


def _endpoint_with(last: dict[str, Any] | None) -> dict[str, Any]:
    return {"metadata": {"name": "llama"}, "status": {"coldStart": {"last": last}} if last else {}}


def test_a_pod_that_just_turned_ready_is_recorded_once() -> None:
    recorder = _recorder("2026-01-01T00:01:45Z")  # 15 s after the pod's Ready
    pod = _pod()
    assert recorder.wants(pod, _endpoint_with(None))
    recorder._remember("uid-1")
    pod["metadata"]["uid"] = "uid-1"
    assert not recorder.wants(pod, _endpoint_with(None))  # recorded by this process
    assert not recorder.wants(_pod(status={"conditions": []}), _endpoint_with(None))  # not Ready


def test_history_is_not_recorded_again_after_an_operator_restart() -> None:
    later = _recorder("2026-01-01T01:00:00Z")  # the pod has been Ready for an hour
    assert not later.wants(_pod(), _endpoint_with(None))
    recorder = _recorder("2026-01-01T00:01:45Z")
    newer = {"pod": "llama-other", "readyAt": "2026-01-01T00:01:42Z"}
    assert not recorder.wants(_pod(), _endpoint_with(newer))  # ready before the last record
    same = {"pod": "llama-7f9-x", "readyAt": "2026-01-01T00:01:40Z"}
    assert not recorder.wants(_pod(), _endpoint_with(same))  # that very record
    older = {"pod": "llama-old", "readyAt": "2026-01-01T00:00:10Z"}
    assert recorder.wants(_pod(), _endpoint_with(older))


def test_a_groups_worker_is_not_a_cold_start_of_its_own() -> None:
    """A multi-node group is one replica: its leader's Ready is the start (the leader is Ready
    once every worker has joined); a worker's Ready is neither recorded nor another replica."""
    recorder = _recorder("2026-01-01T00:01:45Z")
    index = "leaderworkerset.sigs.k8s.io/worker-index"
    worker = _pod(metadata={"name": "llama-group-0-1", "labels": {index: "1"}})
    leader = _pod(metadata={"name": "llama-group-0", "labels": {index: "0"}})
    assert not record.serves(worker)
    assert record.serves(leader) and record.serves(_pod())  # a Deployment's pod has no index
    assert not recorder.wants(worker, _endpoint_with(None))
    assert recorder.wants(leader, _endpoint_with(None))


def test_a_multinode_endpoint_prepulls_where_its_leaders_and_workers_may_run() -> None:
    """A group's workers run the same image on other nodes than its leader: the pre-pull covers
    every node either template may use, and one download fills the cache both mount."""
    ep = _endpoint(_with(resources__nodes=2, resources__gpus=8))
    lws = groups.build_leader_worker_set(ep, SETTINGS, replicas=None)
    prepull = cs.build_prepull_daemonset(ep, SETTINGS)["spec"]["template"]["spec"]
    job = cs.build_download_job(ep, SETTINGS)["spec"]["template"]["spec"]
    (claim,) = (v["persistentVolumeClaim"]["claimName"] for v in job["volumes"])
    for role in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
        assert prepull["nodeSelector"] == pod["nodeSelector"]
        assert prepull["affinity"] == {"nodeAffinity": pod["affinity"]["nodeAffinity"]}
        assert all(t in prepull["tolerations"] for t in pod["tolerations"])
        assert prepull["initContainers"][0]["image"] == pod["containers"][0]["image"]
        assert prepull["imagePullSecrets"] == pod["imagePullSecrets"]
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert claim in claims

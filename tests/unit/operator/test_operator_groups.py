"""Multi-node endpoints: the LeaderWorkerSet (pure builder, against LWS v0.9.0's real schema),
the children that select a group's leaders, the parallel sizes in the pod, the pods a status
names when a group is not ready.

The schema is vendored in schemas/ from kubernetes-sigs/lws (the file names its tag and commit);
the checks LWS's admission webhook adds to it are repeated in tests/lws_schema.py (the webhook is
Go code, not schema). The reconcile's side is in test_operator_reconcile.py; the real operator against the
emulated API server in tests/integration/test_multinode.py.
"""

from __future__ import annotations

from typing import Any

import lws_schema
import pytest
from llmendpoints_operator import groups, manifests
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import Endpoint, parse

SETTINGS = OperatorSettings(runtime_image="registry.example/runtime:1.2.3")
GROUP = {"model": {"name": "org/big"}, "resources": {"gpus": 8, "nodes": 2}}


def _endpoint(spec: dict[str, Any], name: str = "big") -> Endpoint:
    return parse(name, "team", spec)


def _lws(spec: dict[str, Any] | None = None, replicas: int | None = 1) -> dict[str, Any]:
    return groups.build_leader_worker_set(_endpoint(spec or GROUP), SETTINGS, replicas=replicas)


def _env(template: dict[str, Any]) -> dict[str, Any]:
    [container] = template["spec"]["containers"]
    return {v["name"]: v.get("value", v.get("valueFrom")) for v in container["env"]}


@pytest.mark.parametrize(
    "spec",
    [
        GROUP,
        {**GROUP, "rollout": {"strategy": "Recreate"}},
        {**GROUP, "rollout": {"maxSurge": 1, "maxUnavailable": 0}},
        {
            "model": {"name": "org/moe"},
            "engine": {"dataParallelSize": 16, "enableExpertParallel": True},
            "resources": {"gpus": 8, "nodes": 2},
            "cache": {"size": "2Ti"},
            "adapters": [{"name": "sql", "source": "org/sql-lora"}],
        },
        {"model": {"name": "org/demo"}, "resources": {"gpus": 0, "nodes": 2}},
    ],
    ids=["defaults", "recreate", "surge", "wide-ep", "cpu"],
)
def test_the_leader_worker_set_is_valid_against_lws_v0_9_0(spec: dict[str, Any]) -> None:
    for replicas in (0, 3, None):
        lws_schema.validate(_lws(spec, replicas))


def test_one_group_per_replica_of_nodes_pods_restarted_whole() -> None:
    lws = _lws(replicas=3)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    # Not the endpoint's name: LWS names its headless Service like itself, and the endpoint's
    # Service has that name.
    assert lws["metadata"]["name"] == "big-group" != manifests.service_name("big")
    assert lws["metadata"]["labels"][manifests.LABEL_ENDPOINT] == "big"
    spec = lws["spec"]
    assert spec["replicas"] == 3
    lwt = spec["leaderWorkerTemplate"]
    assert (lwt["size"], lwt["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    # Workers start with the leader (whose engine waits for them), over one headless Service.
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["networkConfig"] == {"subdomainPolicy": "Shared"}
    assert "replicas" not in _lws(replicas=None)["spec"]  # then the autoscaler's


def test_leader_and_workers_run_the_same_container_and_differ_in_ports_only() -> None:
    lwt = _lws()["spec"]["leaderWorkerTemplate"]
    leader, worker = lwt["leaderTemplate"], lwt["workerTemplate"]
    [lc], [wc] = leader["spec"]["containers"], worker["spec"]["containers"]
    assert {k: v for k, v in lc.items() if k != "ports"} == {
        k: v for k, v in wc.items() if k != "ports"
    }
    assert (lc["command"], lc["args"], lc["image"]) == (
        ["llmendpoints-runtime"],
        ["serve"],
        "registry.example/runtime:1.2.3",
    )
    assert [p["name"] for p in lc["ports"]] == ["http", "control", "multinode"]
    assert {p["name"]: p["containerPort"] for p in lc["ports"]}["multinode"] == 29500
    assert wc["ports"] == [{"name": "control", "containerPort": 8001, "protocol": "TCP"}]
    # Both are probed on the control port (a worker serves nothing else).
    assert lc["readinessProbe"]["httpGet"]["port"] == wc["readinessProbe"]["httpGet"]["port"]
    assert wc["livenessProbe"]["httpGet"] == {"path": "/health", "port": "control"}
    # Same volumes (the model cache, the admin key...), same GPUs per pod.
    assert leader["spec"]["volumes"] == worker["spec"]["volumes"]
    assert lc["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert leader["metadata"] == worker["metadata"]
    assert leader["metadata"]["labels"][manifests.LABEL_ENDPOINT] == "big"


def test_the_sizes_and_the_group_reach_the_pods_env() -> None:
    env = _env(_lws()["spec"]["leaderWorkerTemplate"]["workerTemplate"])
    # Defaults for 2 x 8 GPUs: tensor parallel inside a node, a pipeline stage per node.
    assert (env["TENSOR_PARALLEL_SIZE"], env["PIPELINE_PARALLEL_SIZE"]) == ("8", "2")
    assert (env["LLMEP_NODES"], env["LLMEP_MULTINODE_PORT"]) == ("2", "29500")
    assert "DATA_PARALLEL_SIZE" not in env and "ENABLE_EXPERT_PARALLEL" not in env
    # LeaderWorkerSet injects who is who; the operator never writes it.
    assert not [name for name in env if name.startswith("LWS_")]
    wide = _env(
        _lws({**GROUP, "engine": {"dataParallelSize": 16, "enableExpertParallel": True}})["spec"][
            "leaderWorkerTemplate"
        ]["leaderTemplate"]
    )
    assert (wide["DATA_PARALLEL_SIZE"], wide["ENABLE_EXPERT_PARALLEL"]) == ("16", "true")
    assert "TENSOR_PARALLEL_SIZE" not in wide and "PIPELINE_PARALLEL_SIZE" not in wide


def test_data_parallel_in_one_node_is_a_deployment_with_one_service() -> None:
    ep = _endpoint(
        {"model": {"name": "org/m"}, "resources": {"gpus": 8}, "engine": {"dataParallelSize": 4}}
    )
    workload = groups.build_workload(ep, SETTINGS, replicas=1)
    assert workload["kind"] == "Deployment"
    env = _env(workload["spec"]["template"])
    assert (env["DATA_PARALLEL_SIZE"], env["TENSOR_PARALLEL_SIZE"]) == ("4", "2")
    assert "LLMEP_NODES" not in env and "LLMEP_MULTINODE_PORT" not in env
    service = manifests.build_service(ep)
    assert service["spec"]["selector"] == manifests.selector_labels(ep.name)


def test_the_service_and_the_inference_pool_select_leaders_the_pdb_every_pod() -> None:
    ep = _endpoint(
        {**GROUP, "scaling": {"maxReplicas": 3}, "api": {"inferencePool": {"enabled": True}}}
    )
    leaders = {manifests.LABEL_ENDPOINT: "big", manifests.LWS_WORKER_INDEX_LABEL: "0"}
    assert manifests.build_service(ep)["spec"]["selector"] == leaders
    pool = manifests.build_inference_pool(ep, SETTINGS)
    assert pool is not None and pool["spec"]["selector"]["matchLabels"] == leaders
    # Evicting any pod of a group takes the group down: the budget counts every pod, so a drain
    # disrupts one group at a time; a group that cannot start never blocks a drain.
    pdb = manifests.build_pdb(ep)
    assert pdb is not None
    assert pdb["spec"]["selector"]["matchLabels"] == manifests.selector_labels("big")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert manifests.selector_string(manifests.serving_selector(ep)) == (
        "llmendpoints.dev/endpoint=big,leaderworkerset.sigs.k8s.io/worker-index=0"
    )


def test_switching_nodes_names_the_workload_to_write_and_the_one_to_delete() -> None:
    single, group = _endpoint({"model": {"name": "m"}}), _endpoint(GROUP)
    assert (groups.workload_ref(single).kind, groups.other_workload_ref(single).kind) == (
        "Deployment",
        "LeaderWorkerSet",
    )
    assert groups.workload_ref(group) == groups.other_workload_ref(single)
    assert groups.workload_ref(single) == groups.other_workload_ref(group)
    # The new workload starts with the old one's replica count, within the bounds.
    bounded = _endpoint({**GROUP, "scaling": {"minReplicas": 1, "maxReplicas": 3}})
    assert [manifests.first_replicas(bounded, n) for n in (None, 0, 2, 5)] == [1, 1, 2, 3]


def test_recreate_is_every_group_at_once() -> None:
    config = _lws({**GROUP, "rollout": {"strategy": "Recreate"}})["spec"]["rolloutStrategy"]
    assert config == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxUnavailable": "100%", "maxSurge": 0},
    }


# --- the pods a status names ------------------------------------------------------------------


def _pod(
    group: int, worker: int, *, ready: bool = False, node: str | None = "gpu-1", **status: Any
) -> dict[str, Any]:
    labels = {
        manifests.LABEL_ENDPOINT: "big",
        manifests.LWS_GROUP_INDEX_LABEL: str(group),
        manifests.LWS_WORKER_INDEX_LABEL: str(worker),
    }
    name = f"big-group-{group}" if worker == 0 else f"big-group-{group}-{worker}"
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    body: dict[str, Any] = {
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": "Running", "conditions": conditions, **status},
    }
    return body


def test_unready_pods_say_which_pod_on_which_node_and_why() -> None:
    crashed = {
        "containerStatuses": [
            {
                "ready": False,
                "restartCount": 2,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
            }
        ]
    }
    restarted = {
        "containerStatuses": [
            {
                "ready": False,
                "restartCount": 1,
                "state": {"running": {}},
                "lastState": {"terminated": {"reason": "Error", "exitCode": 1}},
            }
        ]
    }
    pending = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            }
        ],
    }
    pods = [
        _pod(0, 0, ready=True),
        _pod(0, 1, ready=True),
        _pod(1, 1, node="gpu-7", **crashed),
        _pod(1, 0, node="gpu-6", **restarted),
        _pod(2, 1, node=None, **pending),
        _pod(2, 0),
        {"metadata": {"name": "stray", "labels": {}}, "status": {}},  # not a group's pod
    ]
    unready = groups.unready_pods(pods)
    assert [(p.group, p.worker_index, p.pod, p.node, p.reason) for p in unready] == [
        (1, 0, "big-group-1", "gpu-6", "Error"),
        (1, 1, "big-group-1-1", "gpu-7", "CrashLoopBackOff"),
        (2, 0, "big-group-2", "gpu-1", "Starting"),
        (2, 1, "big-group-2-1", None, "Unschedulable"),
    ]
    assert unready[0].message == "exit code 1, restarted 1 time(s)"
    assert unready[1].as_status() == {
        "group": 1,
        "workerIndex": 1,
        "pod": "big-group-1-1",
        "node": "gpu-7",
        "reason": "CrashLoopBackOff",
        "message": "back-off 40s",
    }
    message = groups.failure_message(unready)
    assert message is not None
    assert "group 1: worker 1 (pod big-group-1-1 on node gpu-7) CrashLoopBackOff" in message
    assert "Insufficient nvidia.com/gpu" in message and "Starting" not in message
    # Pods only starting are not failures.
    assert groups.failure_message(groups.unready_pods([_pod(0, 0), _pod(0, 1)])) is None


def test_at_most_ten_unready_pods_are_reported() -> None:
    pods = [_pod(g, w) for g in range(8) for w in range(2)]
    assert len(groups.unready_pods(pods)) == groups.MAX_UNREADY_REPORTED


def test_placement_images_adapters_and_the_cache_reach_leader_and_workers_alike() -> None:
    spec = {
        "model": {"name": "org/big"},
        "engine": {"image": "registry.example/runtime:9", "imagePullSecrets": [{"name": "pull"}]},
        "resources": {
            "gpus": 8,
            "nodes": 2,
            "priorityClassName": "inference-critical",
            "nodeSelector": {"nvidia.com/gpu.product": "H100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        },
        "cache": {"existingClaim": "weights"},
        "adapters": [{"name": "sql", "source": "org/sql-lora"}],
    }
    lwt = _lws(spec)["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        pod = lwt[role]["spec"]
        assert pod["priorityClassName"] == "inference-critical"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
        assert pod["imagePullSecrets"] == [{"name": "pull"}]
        assert pod["containers"][0]["image"] == "registry.example/runtime:9"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model-cache"] == {
            "name": "model-cache",
            "persistentVolumeClaim": {"claimName": "weights"},
        }
        assert volumes["adapters"]["configMap"]["name"] == "big-adapters"
        assert pod["automountServiceAccountToken"] is False


def test_the_cluster_policy_and_managed_variables_hold_for_groups() -> None:
    from llmendpoints_operator.admission import admit
    from llmendpoints_operator.spec import InvalidSpecError

    strict = OperatorSettings(allowed_images="registry.example/*")
    spec = {**GROUP, "engine": {"image": "elsewhere/runtime:1"}}
    with pytest.raises(InvalidSpecError, match=r"spec\.engine\.image"):
        admit("big", "team", spec, strict)
    for name in ("LWS_WORKER_INDEX", "NODE_RANK", "DATA_PARALLEL_EXTERNAL_LB"):
        spec = {**GROUP, "engine": {"env": [{"name": name, "value": "1"}]}}
        with pytest.raises(InvalidSpecError, match=name):
            admit("big", "team", spec, OperatorSettings())
    with pytest.raises(InvalidSpecError, match=r"args\.pipeline-parallel-size"):
        parse("big", "team", {**GROUP, "engine": {"args": {"pipeline-parallel-size": 2}}})


def test_the_fit_check_sizes_the_groups_layout() -> None:
    from llmendpoints_operator.fit.inputs import parallelism
    from llmendpoints_operator.fit.weights import Parallelism

    assert parallelism(_endpoint(GROUP)) == Parallelism(tensor=8, pipeline=2, data=1, nodes=2)
    wide = {**GROUP, "engine": {"dataParallelSize": 16, "enableExpertParallel": True}}
    assert parallelism(_endpoint(wide)) == Parallelism(data=16, nodes=2, expert=True)

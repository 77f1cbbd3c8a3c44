"""A stand-in kubelet: the runtime container the operator's pure builders write, as the container
would see it (its environment, with ConfigMap and Secret volumes written under a folder).

One place that turns the operator's pod into a runtime's environment, shared by the contract
test (parsed with the runtime's ``load_config``) and the multi-node engine test (a real leader
and worker started with it), so what the operator writes and what the runtime reads cannot
drift apart in either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmendpoints_operator import groups, manifests
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import parse


@dataclass(frozen=True)
class Container:
    command: list[str]  # command + args, as the image would run them
    env: dict[str, str]
    ports: dict[str, int]  # container ports by name


def container(
    spec: Mapping[str, Any],
    root: Path,
    *,
    secrets: Mapping[tuple[str, str], str],
    pod_fields: Mapping[str, str],
    settings: OperatorSettings | None = None,
    role: str | None = None,
    every_volume: bool = False,
) -> Container:
    """The runtime container of endpoint ``demo`` in namespace ``team`` with this spec.

    ``role``: "leader" or "worker" of a multi-node endpoint's group (its LeaderWorkerSet's
    template); None: the Deployment's pod. ``secrets`` by (Secret, key) and ``pod_fields`` (the
    downward API's fieldPaths) are what the kubelet would fill in. ConfigMap and Secret volumes
    are written under ``root`` and paths into them moved there; ``every_volume`` also gives
    emptyDir and claim volumes a folder under root (a process that will really run)."""
    settings = settings or OperatorSettings()
    ep = parse("demo", "team", dict(spec))
    workload = groups.build_workload(ep, settings, replicas=1)
    if role is None:
        pod = workload["spec"]["template"]["spec"]
    else:
        pod = workload["spec"]["leaderWorkerTemplate"][f"{role}Template"]["spec"]
    [runtime] = [c for c in pod["containers"] if c["name"] == manifests.CONTAINER_NAME]
    configmaps = {
        obj["metadata"]["name"]: obj
        for obj in manifests.build_children(ep, settings)
        if obj["kind"] == "ConfigMap"
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    moved = {
        mount["mountPath"]: str(path)
        for mount in runtime["volumeMounts"]
        if (path := _materialise(volumes[mount["name"]], mount, root, configmaps, secrets, every_volume))
    }  # fmt: skip
    env = {var["name"]: _value(var, moved, secrets, pod_fields) for var in runtime["env"]}
    return Container(
        command=[*runtime.get("command", []), *runtime.get("args", [])],
        env=env,
        ports={p["name"]: p["containerPort"] for p in runtime.get("ports", [])},
    )


def _materialise(
    volume: Mapping[str, Any],
    mount: Mapping[str, Any],
    root: Path,
    configmaps: Mapping[str, Any],
    secrets: Mapping[tuple[str, str], str],
    every_volume: bool,
) -> Path | None:
    target = root / mount["mountPath"].lstrip("/")
    if "configMap" in volume:
        files = dict(configmaps[volume["configMap"]["name"]]["data"])
    elif "secret" in volume:
        secret = volume["secret"]["secretName"]
        files = {item["path"]: secrets[(secret, item["key"])] for item in volume["secret"]["items"]}
    elif every_volume:
        files = {}
    else:
        return None  # emptyDir / PVC: nothing to materialise
    target.mkdir(parents=True)
    for name, text in files.items():
        (target / name).write_text(text)
    return target


def _value(
    var: Mapping[str, Any],
    moved: Mapping[str, str],
    secrets: Mapping[tuple[str, str], str],
    pod_fields: Mapping[str, str],
) -> str:
    source = var.get("valueFrom")
    if source is not None:
        if "fieldRef" in source:  # the downward API, as the kubelet fills it in
            return pod_fields[source["fieldRef"]["fieldPath"]]
        ref = source["secretKeyRef"]
        return secrets[(ref["name"], ref["key"])]
    value = var["value"]
    for mount_path, real in moved.items():
        if value == mount_path or value.startswith(mount_path + "/"):
            return real + value[len(mount_path) :]
    return value

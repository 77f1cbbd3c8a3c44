"""Helpers for the chart and image tests: paths, rendering with the real helm, document walking."""

from __future__ import annotations

import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "llmendpoints"
HELM = ROOT / ".venv" / "bin" / "helm"

# Every optional feature switched on (monitoring, dashboard, extra settings), for "renders and
# validates with everything enabled".
ALL_FEATURES: dict[str, Any] = {
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "grafanaDashboard": {
        "enabled": True,
        "namespace": "monitoring",
        "annotations": {"grafana_folder": "LLM"},
    },
    "operator": {
        "verbose": True,
        "extraEnv": [{"name": "LLMEP_OPERATOR_FIELD_MANAGER", "value": "llmep"}],
    },
    "image": {"digest": "sha256:" + "a" * 64},
    "imagePullSecrets": [{"name": "regcred"}],
    "serviceAccount": {
        "annotations": {"iam.gke.io/gcp-service-account": "op@p.iam.gserviceaccount.com"}
    },
    "podAnnotations": {"example.com/team": "ml-platform"},
    "podLabels": {"example.com/cost-center": "42"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}
    ],
    "affinity": {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 1,
                    "preference": {
                        "matchExpressions": [
                            {"key": "node-role", "operator": "In", "values": ["system"]}
                        ]
                    },
                }
            ]
        }
    },
    "priorityClassName": "system-cluster-critical",
    "policy": {
        "allowedImages": ["registry.example.com/llm/*"],
        "allowedServiceTypes": ["ClusterIP"],
        "allowEnvValueFrom": False,
        "allowTrustRemoteCode": False,
        "allowedPriorityClasses": [],
        "allowedIngressAnnotations": ["nginx.ingress.kubernetes.io/proxy-*"],
        "allowedExistingClaims": ["models-*"],
    },
}

NAMESPACED = {"watchNamespaces": ["team-a", "team-b"]}


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def run_helm(
    helm: Path, *args: str, values: dict[str, Any] | None = None, tmp_path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [str(helm), *args]
    if values is not None:
        assert tmp_path is not None
        values_file = tmp_path / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(values_file)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def render(
    helm: Path, tmp_path: Path, values: dict[str, Any] | None = None, *extra: str
) -> list[dict[str, Any]]:
    """`helm template` the chart (CRDs included) and return its non-empty documents."""
    result = run_helm(
        helm,
        "template",
        "llmendpoints",
        str(CHART),
        "--namespace",
        "llm-system",
        "--include-crds",
        *extra,
        values=values or {},
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, pod spec) of every workload in the rendered documents."""
    for doc in docs:
        spec = doc.get("spec") or {}
        if doc["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}:
            yield doc["metadata"]["name"], spec["template"]["spec"]
        elif doc["kind"] == "CronJob":
            yield doc["metadata"]["name"], spec["jobTemplate"]["spec"]["template"]["spec"]
        elif doc["kind"] == "Pod":
            yield doc["metadata"]["name"], spec


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in matches]}"
    return matches[0]

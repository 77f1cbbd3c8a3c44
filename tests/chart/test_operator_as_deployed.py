"""The operator started exactly as the chart's Deployment starts it (its arguments and environment,
rendered by the real helm) against kmock's in-memory Kubernetes API: the liveness probe's endpoint
answers and the metrics port the ServiceMonitor scrapes serves Prometheus metrics."""

from __future__ import annotations

import asyncio
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from integration.kube_emulator import Cluster, wait_for
from ports import free_port

from .helm_kit import only, render

pytestmark = [pytest.mark.helm, pytest.mark.kube]


def _get(url: str) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


async def test_operator_answers_its_probes_as_the_chart_runs_it(helm: Path, tmp_path: Path) -> None:
    metrics_port, health_port = free_port(), free_port()
    docs = render(
        helm, tmp_path, {"operator": {"metricsPort": metrics_port, "healthPort": health_port}}
    )
    container = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[probe["port"]] == health_port

    async with Cluster() as cluster:
        env = {
            **os.environ,
            **{e["name"]: e["value"] for e in container["env"]},
            "KUBECONFIG": str(cluster.write_kubeconfig(tmp_path / "kubeconfig")),
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with (tmp_path / "operator.log").open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "llmendpoints_operator", "run", *container["args"],
                env=env, stdout=log, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            try:
                liveness = f"http://127.0.0.1:{health_port}{probe['path']}"
                status, _ = await wait_for(lambda: _get(liveness), timeout=90, what=liveness)
                assert status == 200
                status, body = _get(f"http://127.0.0.1:{metrics_port}/metrics") or (0, "")
                assert status == 200
                assert "# TYPE" in body
                assert process.returncode is None, "the operator exited"
            finally:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), timeout=20)
                except TimeoutError:
                    process.kill()
                    await process.wait()

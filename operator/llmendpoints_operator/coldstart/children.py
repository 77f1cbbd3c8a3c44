"""The reconcile's part for the cold-start children (manifests.py): the pre-pull DaemonSet
applied or deleted, the download Job of the current model created once, the Jobs of earlier
models deleted. Given the API client and what the jobs index holds of the endpoint's Jobs."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import kopf

from llmendpoints_operator import kube
from llmendpoints_operator.coldstart import manifests as cs
from llmendpoints_operator.coldstart import record
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import Endpoint


class _Api(Protocol):
    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool: ...


def job_names(jobs: Iterable[Mapping[str, Any]]) -> set[str]:
    return {j["metadata"]["name"] for j in jobs}


async def reconcile(
    ep: Endpoint,
    owner: Mapping[str, Any],
    client: _Api,
    settings: OperatorSettings,
    jobs: Iterable[Mapping[str, Any]],
    *,
    prune: bool,
    logger: logging.Logger,
) -> None:
    """``jobs``: the endpoint's download Jobs the operator knows of (its index)."""
    daemonset = cs.build_prepull_daemonset(ep, settings)
    if daemonset is not None:
        kopf.adopt(daemonset, owner=owner)
        await client.apply(daemonset)
    elif prune and await client.delete(
        "apps/v1", "DaemonSet", ep.namespace, cs.prepull_name(ep.name)
    ):
        logger.info("Deleted DaemonSet %s: no image pre-pull wanted", cs.prepull_name(ep.name))

    job = cs.build_download_job(ep, settings)
    existing = job_names(jobs)
    if job is not None and job["metadata"]["name"] not in existing:
        kopf.adopt(job, owner=owner)
        try:
            # Created once, never applied again: a Job's pod template is immutable, and a
            # finished Job is the record of the download. A new model is a new Job.
            await client.create(job)
            logger.info(
                "Created Job %s: downloading %s ahead", job["metadata"]["name"], ep.spec.model.name
            )
        except kube.Conflict:
            pass  # made by an earlier reconcile; the index has not seen it yet
    wanted = job["metadata"]["name"] if job is not None else None
    for name in sorted(existing - {wanted}):
        if await client.delete("batch/v1", "Job", ep.namespace, name):
            logger.info("Deleted Job %s: the endpoint no longer downloads that model", name)


def download_state(
    ep: Endpoint | None,
    settings: OperatorSettings,
    jobs: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
) -> record.DownloadState | None:
    """The Downloaded condition's state, or None when the endpoint downloads nothing ahead."""
    if ep is None or not cs.wants_download(ep, settings):
        return None
    name = cs.download_job_name(ep)
    job = next((j for j in jobs if j["metadata"]["name"] == name), None)
    mine = [p for p in pods if (p.get("metadata") or {}).get("labels", {}).get("job-name") == name]
    return record.download_state(job, mine, model=ep.spec.model.name)

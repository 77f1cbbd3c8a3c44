"""PURE: what the cluster and the runtime say about a cold start, turned into status.

- ``download_state``: the download Job and its pods -> the ``Downloaded`` condition and
  ``status.download`` (bytes, seconds, the Job; the last attempt's error while it retries).
- ``cold_start``: a runtime pod that became Ready, its Events and its start-up phases (the
  runtime's /metrics) -> ``status.coldStart.last``: where the time went, phase by phase, each
  phase starting where the previous one ended --

  ``scheduling``     pod created -> PodScheduled
  ``imagePull``      the kubelet's pull of the runtime image (its Pulled event; 0 when present)
  ``containerStart`` the rest until the container runs: volumes attached and mounted, sandbox
  ``startup``        the runtime's process start -> its engine's start (imports, configuration)
  ``download``       the weights fetched into the model cache (0 when there already)
  ``load``           the engine built: weights loaded, model compiled (``compile``: the part
                     vLLM reports as compiling; it is inside ``load``, not after it), KV cache
  ``warmup``         one request through the engine
  ``readiness``      the runtime ready -> the pod Ready (the readiness probe's period)

  ``seconds`` is created -> Ready. Kubernetes' timestamps have whole seconds, so the phases the
  pod's times bound are within a second or so.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmendpoints_operator import manifests as base
from llmendpoints_operator.coldstart.manifests import DOWNLOAD_BACKOFF_LIMIT

CONDITION = "Downloaded"
RUNTIME_PHASES = ("startup", "download", "load", "compile", "warmup")
PHASES = ("scheduling", "imagePull", "containerStart", *RUNTIME_PHASES, "readiness")


# --- time and durations -------------------------------------------------------------------------


def parse_time(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


_GO_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_GO_DURATION = re.compile(r"((?:\d+(?:\.\d+)?(?:h|ms|us|µs|ns|m|s))+)")
_GO_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|us|µs|ns|m|s)")


def go_duration(text: str) -> float | None:
    """Seconds of a Go duration such as ``1m2.345s`` (the kubelet's pull times), or None."""
    match = _GO_DURATION.fullmatch(text.strip())
    if not match:
        return None
    return sum(float(n) * _GO_UNITS[unit] for n, unit in _GO_PART.findall(text))


_PULLED = re.compile(r'Successfully pulled image "[^"]*" in (\S+)')


def image_pull(events: Iterable[Mapping[str, Any]], container: str) -> tuple[str, float] | None:
    """("pulled", seconds) or ("present", 0.0) from the kubelet's Pulled event of ``container``
    (the latest one), or None when there is none."""
    pulled = [
        e
        for e in events
        if e.get("reason") == "Pulled"
        and f"spec.containers{{{container}}}"
        in str((e.get("involvedObject") or {}).get("fieldPath"))
    ]
    if not pulled:
        return None
    latest = max(pulled, key=lambda e: str(_event_time(e) or ""))
    message = str(latest.get("message") or "")
    if "already present" in message:
        return "present", 0.0
    match = _PULLED.search(message)
    seconds = go_duration(match.group(1)) if match else None
    return ("pulled", seconds) if seconds is not None else None


def _event_time(event: Mapping[str, Any]) -> str | None:
    return event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")


# --- the runtime's start-up phases ------------------------------------------------------------

_PHASE_LINE = re.compile(
    r'^llmendpoints_startup_phase_seconds\{phase="(\w+)"\}\s+([0-9.eE+-]+)', re.MULTILINE
)
_SOURCE_LINE = re.compile(
    r'^llmendpoints_startup_compile_source\{source="(\w+)"\}\s+1(?:\.0)?\s*$', re.MULTILINE
)


@dataclass(frozen=True)
class RuntimeStartup:
    phases: dict[str, float] = field(default_factory=dict)  # RUNTIME_PHASES the pod reported
    compile_source: str | None = None


def parse_runtime_startup(metrics_text: str) -> RuntimeStartup:
    phases = {
        name: float(value)
        for name, value in _PHASE_LINE.findall(metrics_text)
        if name in RUNTIME_PHASES
    }
    source = _SOURCE_LINE.search(metrics_text)
    return RuntimeStartup(phases, source.group(1) if source else None)


# --- the pod --------------------------------------------------------------------------------


def condition_time(pod: Mapping[str, Any], kind: str) -> datetime.datetime | None:
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == kind and condition.get("status") == "True":
            return parse_time(condition.get("lastTransitionTime"))
    return None


def container_status(pod: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or ():
        if status.get("name") == name:
            return status
    return {}


def is_ready(pod: Mapping[str, Any]) -> bool:
    return condition_time(pod, "Ready") is not None


def serves(pod: Mapping[str, Any]) -> bool:
    """A replica's pod: a Deployment's, or a multi-node group's leader. A group's worker serves
    no request (its leader is Ready only once every worker has joined it), so its start is part
    of its group's, recorded with the leader's."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(base.LWS_WORKER_INDEX_LABEL, base.LEADER_INDEX) == base.LEADER_INDEX


def _seconds(later: datetime.datetime | None, earlier: datetime.datetime | None) -> float | None:
    if later is None or earlier is None:
        return None
    return max(0.0, (later - earlier).total_seconds())


def cold_start(
    pod: Mapping[str, Any],
    events: Iterable[Mapping[str, Any]],
    runtime: RuntimeStartup,
    *,
    container: str,
    from_zero: bool,
) -> dict[str, Any] | None:
    """``status.coldStart.last`` for a pod that is Ready (None if it is not)."""
    meta = pod.get("metadata") or {}
    created = parse_time(meta.get("creationTimestamp"))
    ready = condition_time(pod, "Ready")
    if created is None or ready is None:
        return None
    scheduled = condition_time(pod, "PodScheduled")
    state = container_status(pod, container)
    started = parse_time(((state.get("state") or {}).get("running") or {}).get("startedAt"))
    pull = image_pull(events, container)

    phases: dict[str, float | None] = {"scheduling": _seconds(scheduled, created)}
    after_scheduling = _seconds(started, scheduled)
    phases["imagePull"] = pull[1] if pull else None
    if after_scheduling is not None:
        phases["containerStart"] = max(0.0, after_scheduling - (pull[1] if pull else 0.0))
    for name in RUNTIME_PHASES:
        phases[name] = runtime.phases.get(name)
    in_runtime = sum(runtime.phases.get(p, 0.0) for p in RUNTIME_PHASES if p != "compile")
    running = _seconds(ready, started)
    if running is not None and runtime.phases:
        phases["readiness"] = max(0.0, running - in_runtime)

    record: dict[str, Any] = {
        "pod": meta.get("name"),
        "createdAt": meta.get("creationTimestamp"),
        "readyAt": ready.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seconds": round((ready - created).total_seconds(), 1),
        "fromZero": from_zero,
        "phases": {k: round(v, 1) for k, v in phases.items() if v is not None},
    }
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        record["node"] = node
    if pull:
        record["image"] = pull[0]
    if runtime.compile_source:
        record["compileCache"] = runtime.compile_source
    restarts = state.get("restartCount")
    if restarts:
        record["restarts"] = restarts
    return record


# --- the download Job -------------------------------------------------------------------------


@dataclass(frozen=True)
class DownloadState:
    """The Downloaded condition's status, reason and message, and ``status.download``."""

    status: str
    reason: str
    message: str
    block: dict[str, Any]


def _report(pod: Mapping[str, Any], container: str) -> tuple[dict[str, Any], str | None]:
    """A finished attempt's report (the termination message): (the JSON object, or {} when it
    is not JSON, and its text)."""
    terminated = (container_status(pod, container).get("state") or {}).get("terminated") or {}
    text = terminated.get("message")
    if not isinstance(text, str) or not text.strip():
        return {}, None
    try:
        report = json.loads(text)
    except ValueError:
        return {}, text.strip().splitlines()[-1][:500]
    return (report, None) if isinstance(report, dict) else ({}, text.strip()[:500])


def _finished(pods: Iterable[Mapping[str, Any]], phase: str) -> list[Mapping[str, Any]]:
    done = [p for p in pods if (p.get("status") or {}).get("phase") == phase]
    return sorted(done, key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp")))


def _last_error(pods: Iterable[Mapping[str, Any]], container: str) -> str | None:
    for pod in reversed(_finished(pods, "Failed")):
        report, text = _report(pod, container)
        error = report.get("error") or text
        if error:
            return str(error)
        terminated = (container_status(pod, container).get("state") or {}).get("terminated")
        if terminated:
            return f"exit code {terminated.get('exitCode')} ({terminated.get('reason')})"
    return None


def _job_condition(job: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in (job.get("status") or {}).get("conditions") or ():
        if condition.get("type") == kind and condition.get("status") == "True":
            return condition
    return None


def _gib(value: Any) -> str:
    return f"{float(value) / 1024**3:.2f} GiB" if isinstance(value, int | float) else "?"


def download_state(
    job: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    *,
    model: str,
    container: str = "download",
) -> DownloadState:
    pods = list(pods)
    if job is None:
        return DownloadState(
            "False", "Pending", f"the download Job for {model} is being created", {}
        )
    name = (job.get("metadata") or {}).get("name")
    block: dict[str, Any] = {"job": name, "model": model}
    failed = int((job.get("status") or {}).get("failed") or 0)
    if _job_condition(job, "Complete") or (job.get("status") or {}).get("succeeded"):
        succeeded = _finished(pods, "Succeeded")
        report = _report(succeeded[-1], container)[0] if succeeded else {}
        for key in ("bytes", "fetchedBytes", "seconds"):
            if isinstance(report.get(key), int | float):
                block[key] = report[key]
        completed = (job.get("status") or {}).get("completionTime")
        if completed:
            block["completedAt"] = completed
        seconds = block.get("seconds")
        took = f" in {seconds:.0f} s" if isinstance(seconds, int | float) else ""
        fetched = f" ({_gib(block['fetchedBytes'])} fetched)" if "fetchedBytes" in block else ""
        message = f"{model}: {_gib(block.get('bytes'))} in the model cache{took}{fetched}"
        return DownloadState("True", "Downloaded", message, block)
    error = _last_error(pods, container)
    if error:
        block["lastError"] = error
    block["failedAttempts"] = failed
    if _job_condition(job, "Failed"):
        message = (
            f"{model}: gave up after {failed} attempts; last: {error or 'no report'}. "
            f"Delete Job {name} to try again (or change spec.model)"
        )
        return DownloadState("False", "DownloadFailed", message, block)
    if failed:
        message = (
            f"{model}: attempt {failed} of {DOWNLOAD_BACKOFF_LIMIT + 1} failed "
            f"({error or 'no report'}); retrying with back-off"
        )
        return DownloadState("False", "Retrying", message, block)
    return DownloadState("False", "Downloading", f"downloading {model} (Job {name})", block)


def with_download(
    status: dict[str, Any],
    state: DownloadState | None,
    previous: Mapping[str, Any],
    now: str,
) -> dict[str, Any]:
    """``status`` (status.compute's) with the Downloaded condition and ``download`` block of
    ``state`` (None: the endpoint has no download: neither). A condition keeps its
    lastTransitionTime while its status does not change."""
    if state is None:
        return status
    before = next((c for c in previous.get("conditions") or () if c.get("type") == CONDITION), None)
    since = (
        before.get("lastTransitionTime")
        if before and before.get("status") == state.status
        else None
    )
    condition = {
        "type": CONDITION,
        "status": state.status,
        "reason": state.reason,
        "message": state.message,
        "lastTransitionTime": since or now,
    }
    generation = next(
        (
            c.get("observedGeneration")
            for c in status.get("conditions") or ()
            if "observedGeneration" in c
        ),
        None,
    )
    if generation is not None:
        condition["observedGeneration"] = generation
    out = dict(status)
    out["conditions"] = [*(status.get("conditions") or ()), condition]
    if state.block:
        out["download"] = state.block
    return out

"""An explicit KUBECONFIG checked before kopf starts (pure but for reading the files).

kopf logs in through its own activity, which retries a failing login forever: a KUBECONFIG that
names a missing file, is not YAML or names a context that does not exist would leave the operator
running and doing nothing. Here such a file stops it at once, saying what is wrong. Whether the
credentials are accepted is the API server's to say (kopf reports that itself).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


def kubeconfig_problem(value: str | None) -> str | None:
    """What makes KUBECONFIG unusable, or None (also when it is unset: in-cluster credentials)."""
    if not value:
        return None
    paths = [p for p in value.split(os.pathsep) if p]
    documents: list[Mapping[str, Any]] = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
        try:
            document = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            return f"{path}: not valid YAML ({exc.__class__.__name__})"
        if not isinstance(document, Mapping):
            return f"{path}: not a kubeconfig (a YAML mapping with clusters, users, contexts)"
        documents.append(document)
    return config_problem(documents, value)


def config_problem(documents: list[Mapping[str, Any]], where: str) -> str | None:
    """PURE: the merged kubeconfig's current context must name a cluster with a server.

    Merging follows kubectl: the first file that sets current-context wins, and so does the
    first definition of a named context or cluster."""
    current = next((d["current-context"] for d in documents if d.get("current-context")), None)
    if not current:
        return f"{where}: no current-context"
    context = _named(documents, "contexts", current)
    if context is None:
        return f"{where}: current-context {current!r} is not among its contexts"
    cluster_name = (context.get("context") or {}).get("cluster")
    cluster = _named(documents, "clusters", cluster_name) if cluster_name else None
    if cluster is None:
        return f"{where}: context {current!r} names no cluster that the file defines"
    if not (cluster.get("cluster") or {}).get("server"):
        return f"{where}: cluster {cluster_name!r} has no server"
    return None


def _named(documents: list[Mapping[str, Any]], section: str, name: str) -> Mapping[str, Any] | None:
    for document in documents:
        for entry in document.get(section) or []:
            if isinstance(entry, Mapping) and entry.get("name") == name:
                return entry
    return None

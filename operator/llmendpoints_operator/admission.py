"""Admission of an LLMEndpoint by the operator: what the spec says, checked against everything.

`admit` is `spec.parse` (the spec on its own) plus the rules that need more than the spec: the
variables the operator and runtime manage (managed_env), the vLLM flags and values the pinned vLLM
accepts (engine_flags) and the cluster administrator's policy (policy). Every caller that turns a stored LLMEndpoint into children goes through it, so a spec
the policy forbids never reaches the cluster, whichever path (create, update, resume, resync,
autoscaler) looks at it. PURE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmendpoints_operator import engine_flags, managed_env, policy
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import Endpoint, InvalidSpecError, parse


def admit(
    name: str, namespace: str, spec: Mapping[str, Any] | None, settings: OperatorSettings
) -> Endpoint:
    """The validated endpoint; InvalidSpecError naming every field the operator refuses."""
    ep = parse(name, namespace, spec, scale_to_zero=settings.scales_to_zero)
    managed = managed_env.check(ep)
    # A managed variable is reported once, as managed, not again as a flag.
    taken = {_setting(p.field) for p in managed}
    flags = [p for p in engine_flags.check(ep) if _setting(p.field) not in taken]
    problems = managed + flags + policy.check(ep, policy.ClusterPolicy.from_settings(settings))
    if problems:
        raise InvalidSpecError(problems)
    return ep


def _setting(field: str) -> str:
    """`spec.engine.env[2].value` -> `spec.engine.env[2]`: the setting a problem is about."""
    return field.removesuffix(".name").removesuffix(".value")

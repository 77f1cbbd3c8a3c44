"""Admission of an LLMEndpoint by the operator: what the spec says, checked against everything.

`admit` is `spec.parse` (the spec on its own) plus the rules that need more than the spec: the
variables the operator and runtime manage (managed_env), the vLLM flags and values the pinned vLLM
accepts (engine_flags) and the cluster administrator's policy (policy). Every caller that turns a stored LLMEndpoint into children goes through it, so a spec
the policy forbids never reaches the cluster, whichever path (create, update, resume, resync,
autoscaler) looks at it. PURE.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
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


class AdmissionMemo:
    """`admit` remembered per endpoint, for a caller that looks at every endpoint again and
    again: the autoscaler lists the endpoints it sizes whenever one of them is due, several
    times a second with many endpoints, and admitting 200 specs each time was most of the
    operator's CPU (bench/operator_scale.py). A spec equal to the one last admitted for that
    endpoint gets the same answer; the spec is copied, so a body changed in place is a new spec.
    The Endpoints handed out are shared: read them, never change them."""

    def __init__(self, settings: OperatorSettings) -> None:
        self._settings = settings
        self._last: dict[tuple[str, str], tuple[Any, Endpoint | list]] = {}

    def admit(self, name: str, namespace: str, spec: Mapping[str, Any] | None) -> Endpoint:
        key = (namespace, name)
        known = self._last.get(key)
        if known is not None and known[0] == spec:
            outcome = known[1]
        else:
            try:
                outcome = admit(name, namespace, spec, self._settings)
            except InvalidSpecError as exc:
                outcome = exc.problems
            self._last[key] = (copy.deepcopy(spec), outcome)
        if isinstance(outcome, list):
            raise InvalidSpecError(outcome)  # a fresh one: a raised exception keeps its frames
        return outcome

    def keep_only(self, keys: Iterable[tuple[str, str]]) -> None:
        """Forget the endpoints not among ``keys`` (namespace, name): they are gone."""
        keep = set(keys)
        for key in [k for k in self._last if k not in keep]:
            del self._last[key]

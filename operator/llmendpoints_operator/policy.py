"""The cluster administrator's policy over what an LLMEndpoint may ask for. PURE.

Whoever may create an LLMEndpoint makes the operator create pods with the operator's own rights:
any image, any Secret or ConfigMap of the namespace read into the environment, any claim mounted,
any priority class, any Ingress annotation (some ingress controllers run annotation snippets as
configuration). The cluster admin narrows that with LLMEP_OPERATOR_* settings (chart values
`policy:`); a spec outside them is refused with the field and the policy named.

The chart ships the same rules as a ValidatingAdmissionPolicy
(charts/llmendpoints/templates/validatingadmissionpolicy.yaml) so that `kubectl apply` itself says
no; tests/chart/test_admission_policy.py evaluates its CEL against the same cases as this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from llmendpoints_operator.config import OperatorSettings, split_list
from llmendpoints_operator.spec import Endpoint, EndpointSpec, Problem


def glob_regex(glob: str) -> str:
    """`*` matches any run of characters (`/` and `:` included), `?` one character; nothing else
    is special. The chart turns the same globs into the same regular expressions for CEL."""
    return "^" + re.escape(glob).replace(r"\*", ".*").replace(r"\?", ".") + "$"


def matches_any(value: str, globs: tuple[str, ...]) -> bool:
    return any(re.fullmatch(glob_regex(glob), value) for glob in globs)


@dataclass(frozen=True)
class ClusterPolicy:
    """What endpoints may ask for; None means no restriction."""

    runtime_image: str
    allowed_images: tuple[str, ...] | None = None
    allowed_service_types: tuple[str, ...] | None = None
    allow_env_value_from: bool = True
    allow_trust_remote_code: bool = True
    allowed_priority_classes: tuple[str, ...] | None = None
    allowed_ingress_annotations: tuple[str, ...] | None = None
    allowed_existing_claims: tuple[str, ...] | None = None

    @classmethod
    def from_settings(cls, settings: OperatorSettings) -> ClusterPolicy:
        return cls(
            runtime_image=settings.runtime_image,
            allowed_images=split_list(settings.allowed_images),
            allowed_service_types=split_list(settings.allowed_service_types),
            allow_env_value_from=settings.allow_env_value_from,
            allow_trust_remote_code=settings.allow_trust_remote_code,
            allowed_priority_classes=split_list(settings.allowed_priority_classes),
            allowed_ingress_annotations=split_list(settings.allowed_ingress_annotations),
            allowed_existing_claims=split_list(settings.allowed_existing_claims),
        )


def _policy(value: str, setting: str) -> str:
    """How a message names a policy: the chart value and the operator setting."""
    return f"the cluster policy policy.{value} (LLMEP_OPERATOR_{setting})"


def _allowed(globs: tuple[str, ...]) -> str:
    return ", ".join(globs) if globs else "nothing"


def _not_allowed(
    field: str, value: str, globs: tuple[str, ...] | None, value_name: str, setting: str
) -> list[Problem]:
    """A name the policy's globs must match (None: no restriction)."""
    if globs is None or matches_any(value, globs):
        return []
    return [
        Problem(
            field,
            f"{value!r} is not allowed by {_policy(value_name, setting)}: allowed are "
            f"{_allowed(globs)}",
        )
    ]


def _image(spec: EndpointSpec, policy: ClusterPolicy) -> list[Problem]:
    image = spec.engine.image
    if (
        image is None
        or policy.allowed_images is None
        or image == policy.runtime_image
        or matches_any(image, policy.allowed_images)
    ):
        return []
    return [
        Problem(
            "spec.engine.image",
            f"{image!r} is not allowed by {_policy('allowedImages', 'ALLOWED_IMAGES')}: "
            f"allowed are {_allowed(policy.allowed_images)} and the operator's runtime image "
            f"{policy.runtime_image}",
        )
    ]


def _service_type(spec: EndpointSpec, policy: ClusterPolicy) -> list[Problem]:
    service_type = spec.api.service.type
    if policy.allowed_service_types is None or service_type in policy.allowed_service_types:
        return []
    return [
        Problem(
            "spec.api.service.type",
            f"{service_type} is not allowed by "
            f"{_policy('allowedServiceTypes', 'ALLOWED_SERVICE_TYPES')}: allowed are "
            f"{_allowed(policy.allowed_service_types)}",
        )
    ]


def _env_value_from(spec: EndpointSpec, policy: ClusterPolicy) -> list[Problem]:
    if policy.allow_env_value_from:
        return []
    return [
        Problem(
            f"spec.engine.env[{index}].valueFrom.{kind}",
            f"{var.name} reads a {kind.removesuffix('KeyRef')} ({kind}), which "
            f"{_policy('allowEnvValueFrom', 'ALLOW_ENV_VALUE_FROM')} forbids; use the spec's own "
            "fields (model.hfTokenSecretRef, api.apiKeysSecretRef)",
        )
        for index, var in enumerate(spec.engine.env)
        for kind in ("secretKeyRef", "configMapKeyRef")
        if kind in (var.value_from or {})
    ]


def _trust_remote_code(spec: EndpointSpec, policy: ClusterPolicy) -> list[Problem]:
    if not spec.model.trust_remote_code or policy.allow_trust_remote_code:
        return []
    return [
        Problem(
            "spec.model.trustRemoteCode",
            "running a model repository's own code is forbidden by "
            f"{_policy('allowTrustRemoteCode', 'ALLOW_TRUST_REMOTE_CODE')}",
        )
    ]


def _priority_class(spec: EndpointSpec, policy: ClusterPolicy) -> list[Problem]:
    name = spec.resources.priority_class_name
    if name is None:
        return []
    return _not_allowed(
        "spec.resources.priorityClassName",
        name,
        policy.allowed_priority_classes,
        "allowedPriorityClasses",
        "ALLOWED_PRIORITY_CLASSES",
    )


def _ingress_annotations(spec: EndpointSpec, policy: ClusterPolicy) -> list[Problem]:
    globs = policy.allowed_ingress_annotations
    if globs is None:
        return []
    return [
        Problem(
            f"spec.api.ingress.annotations[{key}]",
            f"the annotation key is not allowed by "
            f"{_policy('allowedIngressAnnotations', 'ALLOWED_INGRESS_ANNOTATIONS')}: "
            f"allowed are {_allowed(globs)}",
        )
        for key in sorted(spec.api.ingress.annotations)
        if not matches_any(key, globs)
    ]


def _existing_claim(spec: EndpointSpec, policy: ClusterPolicy) -> list[Problem]:
    claim = spec.cache.existing_claim if spec.cache is not None else None
    if claim is None:
        return []
    return _not_allowed(
        "spec.cache.existingClaim",
        claim,
        policy.allowed_existing_claims,
        "allowedExistingClaims",
        "ALLOWED_EXISTING_CLAIMS",
    )


# One pure check per rule of the policy, in the order a spec's fields are read.
RULES: tuple[Callable[[EndpointSpec, ClusterPolicy], list[Problem]], ...] = (
    _image,
    _service_type,
    _env_value_from,
    _trust_remote_code,
    _priority_class,
    _ingress_annotations,
    _existing_claim,
)


def check(ep: Endpoint, policy: ClusterPolicy) -> list[Problem]:
    """Every field of the spec that the cluster policy does not allow."""
    return [problem for rule in RULES for problem in rule(ep.spec, policy)]

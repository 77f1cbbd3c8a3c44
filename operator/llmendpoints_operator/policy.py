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
from dataclasses import dataclass

from llmendpoints_operator.config import OperatorSettings, split_list
from llmendpoints_operator.spec import Endpoint, Problem


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


def check(ep: Endpoint, policy: ClusterPolicy) -> list[Problem]:
    """Every field of the spec that the cluster policy does not allow."""
    spec = ep.spec
    problems: list[Problem] = []

    image = spec.engine.image
    if (
        image is not None
        and policy.allowed_images is not None
        and image != policy.runtime_image
        and not matches_any(image, policy.allowed_images)
    ):
        problems.append(
            Problem(
                "spec.engine.image",
                f"{image!r} is not allowed by {_policy('allowedImages', 'ALLOWED_IMAGES')}: "
                f"allowed are {_allowed(policy.allowed_images)} and the operator's runtime image "
                f"{policy.runtime_image}",
            )
        )

    service_type = spec.api.service.type
    if (
        policy.allowed_service_types is not None
        and service_type not in policy.allowed_service_types
    ):
        problems.append(
            Problem(
                "spec.api.service.type",
                f"{service_type} is not allowed by "
                f"{_policy('allowedServiceTypes', 'ALLOWED_SERVICE_TYPES')}: allowed are "
                f"{_allowed(policy.allowed_service_types)}",
            )
        )

    if not policy.allow_env_value_from:
        for index, var in enumerate(spec.engine.env):
            source = var.value_from or {}
            for kind in ("secretKeyRef", "configMapKeyRef"):
                if kind in source:
                    problems.append(
                        Problem(
                            f"spec.engine.env[{index}].valueFrom.{kind}",
                            f"{var.name} reads a {kind.removesuffix('KeyRef')} "
                            f"({kind}), which "
                            f"{_policy('allowEnvValueFrom', 'ALLOW_ENV_VALUE_FROM')} forbids; "
                            "use the spec's own fields (model.hfTokenSecretRef, "
                            "api.apiKeysSecretRef)",
                        )
                    )

    if spec.model.trust_remote_code and not policy.allow_trust_remote_code:
        problems.append(
            Problem(
                "spec.model.trustRemoteCode",
                "running a model repository's own code is forbidden by "
                f"{_policy('allowTrustRemoteCode', 'ALLOW_TRUST_REMOTE_CODE')}",
            )
        )

    priority_class = spec.resources.priority_class_name
    if (
        priority_class is not None
        and policy.allowed_priority_classes is not None
        and not matches_any(priority_class, policy.allowed_priority_classes)
    ):
        problems.append(
            Problem(
                "spec.resources.priorityClassName",
                f"{priority_class!r} is not allowed by "
                f"{_policy('allowedPriorityClasses', 'ALLOWED_PRIORITY_CLASSES')}: allowed are "
                f"{_allowed(policy.allowed_priority_classes)}",
            )
        )

    if policy.allowed_ingress_annotations is not None:
        for key in sorted(spec.api.ingress.annotations):
            if not matches_any(key, policy.allowed_ingress_annotations):
                problems.append(
                    Problem(
                        f"spec.api.ingress.annotations[{key}]",
                        f"the annotation key is not allowed by "
                        f"{_policy('allowedIngressAnnotations', 'ALLOWED_INGRESS_ANNOTATIONS')}: "
                        f"allowed are {_allowed(policy.allowed_ingress_annotations)}",
                    )
                )

    claim = spec.cache.existing_claim if spec.cache is not None else None
    if (
        claim is not None
        and policy.allowed_existing_claims is not None
        and not matches_any(claim, policy.allowed_existing_claims)
    ):
        problems.append(
            Problem(
                "spec.cache.existingClaim",
                f"{claim!r} is not allowed by "
                f"{_policy('allowedExistingClaims', 'ALLOWED_EXISTING_CLAIMS')}: allowed are "
                f"{_allowed(policy.allowed_existing_claims)}",
            )
        )
    return problems

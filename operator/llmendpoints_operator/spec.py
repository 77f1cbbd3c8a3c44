"""A typed view of the LLMEndpoint spec: defaults and validation errors a user can act on.

The CRD (crds/llmendpoints.dev_llmendpoints.yaml) checks what the API server can check before
admission; this module checks everything again (the operator must not trust that the CRD in the
cluster is the current one) plus what a schema cannot express: cross-field rules, quantities,
engine arguments that would shadow the fields the operator manages. Every problem names the field
as a user writes it (``spec.scaling.maxReplicas``), never a Python attribute.

Defaults here and in the CRD must agree; tests/unit/operator/test_crd.py enforces it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from llmendpoints_operator.autoscaling.policy import (
    ScalingPolicy,
    ScalingTuning,
    check_min_replicas,
)
from llmendpoints_operator.parallelism import Parallelism, ParallelismError, derive

# Validation context key: the operator has a request-holding gateway (minReplicas 0 allowed).
SCALE_TO_ZERO = "scale_to_zero"

# --- reusable field types -------------------------------------------------------------------

# Kubernetes resource quantity ("8Gi", "500m", "1.5", "2e3"), the grammar of k8s.io/apimachinery.
_QUANTITY = re.compile(
    r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
)
# DNS-1123 subdomain (names of Secrets, ConfigMaps, PVCs, storage and priority classes).
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Keys of Secrets and ConfigMaps.
_DATA_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# Endpoint names become Service names (DNS-1035 labels) and prefixes of their children's names.
_ENDPOINT_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_ENDPOINT_NAME_LENGTH = 49  # 63 (label/Service name limit) - len("-chat-template")
# A multi-node endpoint's LeaderWorkerSet <name>-group makes StatefulSets <name>-group-<group>,
# whose pods carry the label controller-revision-hash=<statefulset>-<10 characters>, at most 63
# characters: 63 - 10 - 1 - 3 (up to 999 groups) - 1 - len("-group").
MAX_MULTINODE_NAME_LENGTH = 42
# An environment variable name as Kubernetes accepts it.
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# An engine flag as written on vLLM's command line without the dashes: max-num-seqs / max_num_seqs.
_FLAG = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")


def _quantity(value: Any) -> str:
    # Integers are valid quantities (the CRD declares these fields int-or-string).
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("must be a Kubernetes quantity such as 8Gi, 500m or 2")
    text = str(value)
    if not _QUANTITY.match(text):
        raise ValueError(f"{text!r} is not a Kubernetes quantity (examples: 8Gi, 500m, 2)")
    return text


def _dns_subdomain(value: str) -> str:
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise ValueError(f"{value!r} is not a valid Kubernetes object name (lowercase DNS name)")
    return value


def _data_key(value: str) -> str:
    if not _DATA_KEY.match(value):
        raise ValueError(f"{value!r} is not a valid Secret key (letters, digits, '-', '_', '.')")
    return value


Quantity = Annotated[str, BeforeValidator(_quantity)]
ObjectName = Annotated[str, AfterValidator(_dns_subdomain)]
DataKey = Annotated[str, AfterValidator(_data_key)]


def _int_or_percent(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and re.fullmatch(r"[0-9]+%", value):
        return value
    raise ValueError(f"{value!r} is not a non-negative integer or a percentage such as 25%")


IntOrPercent = Annotated[int | str, BeforeValidator(_int_or_percent)]


class _Model(BaseModel):
    # camelCase in YAML, snake_case in Python; unknown fields are errors (the API server prunes
    # them silently, so a typo only reaches us when the CRD in the cluster is outdated).
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


# --- the spec ---------------------------------------------------------------------------------


class SecretKeyRef(_Model):
    """One key of a Secret in the endpoint's namespace."""

    name: ObjectName
    key: DataKey


class LocalObjectRef(_Model):
    name: ObjectName


class Tokenizer(_Model):
    name: str = Field(min_length=1)
    revision: str | None = Field(None, min_length=1)


class ModelSpec(_Model):
    name: str = Field(min_length=1)
    revision: str | None = Field(None, min_length=1)
    served_model_name: str | None = Field(None, min_length=1)
    tokenizer: Tokenizer | None = None
    chat_template: str | None = Field(None, min_length=1)
    hf_token_secret_ref: SecretKeyRef | None = None
    trust_remote_code: bool = False
    # The weights live inside engine.image (see Dockerfile.runtime): no cache, no download.
    baked_into_image: bool = False


class EnvVar(_Model):
    name: str
    value: str | None = None
    value_from: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> EnvVar:
        if not _ENV_NAME.match(self.name):
            raise ValueError(f"{self.name!r} is not a valid environment variable name")
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"{self.name}: set either value or valueFrom, not both")
        return self


ArgValue = str | int | float | bool

# Environment variables the operator writes itself; engine.env and engine.args must not shadow
# them (the field to use instead is named in the error).
MANAGED_VARIABLES: dict[str, str] = {
    "MODEL_NAME": "spec.model.name",
    "MODEL_REVISION": "spec.model.revision",
    "TOKENIZER_NAME": "spec.model.tokenizer.name",
    "TOKENIZER_REVISION": "spec.model.tokenizer.revision",
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "spec.model.servedModelName",
    "SERVED_MODEL_NAME": "spec.model.servedModelName",
    "CUSTOM_CHAT_TEMPLATE": "spec.model.chatTemplate",
    "CHAT_TEMPLATE": "spec.model.chatTemplate",
    "HF_TOKEN": "spec.model.hfTokenSecretRef",
    "TRUST_REMOTE_CODE": "spec.model.trustRemoteCode",
    "DTYPE": "spec.engine.dtype",
    "MAX_MODEL_LEN": "spec.engine.maxModelLen",
    "TENSOR_PARALLEL_SIZE": "spec.engine.tensorParallelSize",
    "PIPELINE_PARALLEL_SIZE": "spec.engine.pipelineParallelSize",
    "DATA_PARALLEL_SIZE": "spec.engine.dataParallelSize",
    "ENABLE_EXPERT_PARALLEL": "spec.engine.enableExpertParallel",
    "LLMEP_NODES": "spec.resources.nodes",
    "LLMEP_MULTINODE_PORT": "(fixed by the operator: 29500)",
    "GPU_MEMORY_UTILIZATION": "spec.engine.gpuMemoryUtilization",
    "QUANTIZATION": "spec.engine.quantization",
    "ENABLE_PREFIX_CACHING": "spec.engine.enablePrefixCaching",
    "DRAIN_TIMEOUT_SECONDS": "spec.engine.drainTimeoutSeconds",
    "BASE_PATH": "spec.cache",
    "HF_HOME": "spec.cache",
    "API_KEYS_FILE": "spec.api.apiKeysSecretRef",
    "API_KEYS": "spec.api.apiKeysSecretRef",
    "API_KEY": "spec.api.apiKeysSecretRef",
    "MAX_CONCURRENCY": "spec.api.maxConcurrency",
    "MAX_QUEUE_LENGTH": "spec.api.maxQueueLength",
    "DEFAULT_MAX_TOKENS": "spec.api.defaultMaxTokens",
    "DEFAULT_BATCH_SIZE": "spec.api.streaming.batchSize",
    "DEFAULT_MIN_BATCH_SIZE": "spec.api.streaming.minBatchSize",
    "DEFAULT_BATCH_SIZE_GROWTH_FACTOR": "spec.api.streaming.batchSizeGrowthFactor",
    "LLMEP_ADAPTERS_FILE": "spec.adapters",
    "HOST": "(fixed by the operator: 0.0.0.0)",
    "PORT": "(fixed by the operator: 8000)",
}


def flag_env_name(flag: str) -> str:
    """`max-num-seqs` -> `MAX_NUM_SEQS`: the runtime's name for a vLLM flag."""
    return flag.replace("-", "_").upper()


class EngineSpec(_Model):
    image: str | None = Field(None, min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: tuple[LocalObjectRef, ...] = ()
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | None = None
    max_model_len: int | None = Field(None, ge=1)
    tensor_parallel_size: int | None = Field(None, ge=1)
    pipeline_parallel_size: int | None = Field(None, ge=1)
    data_parallel_size: int | None = Field(None, ge=1)
    enable_expert_parallel: bool = False
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    quantization: str | None = Field(None, min_length=1)
    enable_prefix_caching: bool | None = None
    args: dict[str, ArgValue] = Field(default_factory=dict)
    env: tuple[EnvVar, ...] = ()
    startup_timeout_seconds: int = Field(3600, ge=60)
    drain_timeout_seconds: int = Field(30, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _check_args(cls, data: Any) -> Any:
        # Checked before field validation so that a bad value is reported with its flag name
        # (a union's per-member errors would read "Input should be a valid string, ... integer").
        args = data.get("args") if isinstance(data, Mapping) else None
        if isinstance(args, Mapping):
            for flag, value in args.items():
                if not isinstance(flag, str) or not _FLAG.match(flag):
                    raise ValueError(
                        f"args: {flag!r} is not a vLLM flag name; write it as on the command "
                        f"line without the dashes, e.g. max-num-seqs"
                    )
                if value is None or not isinstance(value, str | int | float | bool):
                    raise ValueError(
                        f"args.{flag}: must be a string, number or boolean, got {type(value).__name__}"
                    )
                owner = MANAGED_VARIABLES.get(flag_env_name(flag))
                if owner is not None:
                    raise ValueError(f"args.{flag}: set {owner} instead")
        return data

    @model_validator(mode="after")
    def _check_env(self) -> EngineSpec:
        seen: set[str] = set()
        for var in self.env:
            owner = MANAGED_VARIABLES.get(var.name)
            if owner is not None:
                raise ValueError(f"env: {var.name} is set by the operator; use {owner} instead")
            if var.name in seen:
                raise ValueError(f"env: {var.name} is listed twice")
            seen.add(var.name)
            if var.name in {flag_env_name(flag) for flag in self.args}:
                raise ValueError(f"env: {var.name} is also set through args")
        return self


class ComputeQuantities(_Model):
    cpu: Quantity | None = None
    memory: Quantity | None = None


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class ResourcesSpec(_Model):
    gpus: int = Field(1, ge=0)
    # Pods per replica: more than one makes each replica a LeaderWorkerSet group.
    nodes: int = Field(1, ge=1)
    gpu_resource_name: str | None = Field(None, min_length=1)
    # One GPU's memory, for the fit check where the nodes' labels do not say it.
    gpu_memory: Quantity | None = None
    requests: ComputeQuantities | None = None
    limits: ComputeQuantities | None = None
    shm_size: Quantity | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    affinity: dict[str, Any] | None = None
    priority_class_name: ObjectName | None = None


AccessMode = Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]


class CacheSpec(_Model):
    size: Quantity | None = None
    storage_class_name: str | None = None
    access_modes: tuple[AccessMode, ...] = Field(("ReadWriteMany",), min_length=1)
    existing_claim: ObjectName | None = None

    @model_validator(mode="after")
    def _one_source(self) -> CacheSpec:
        if (self.size is None) == (self.existing_claim is None):
            raise ValueError(
                "set either size (the operator creates the volume) or existingClaim (a "
                "PersistentVolumeClaim you created), not both and not neither"
            )
        return self


class ScalingSpec(ScalingTuning):
    """Replica bounds, and the autoscaler's tuning (inherited; see docs/autoscaling.md).
    `replicas` is the scale subresource's target (manual scaling: the autoscaler stands down)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    replicas: int | None = Field(None, ge=0)

    @field_validator("min_replicas")
    @classmethod
    def _scale_to_zero_needs_the_gateway(cls, value: int, info: ValidationInfo) -> int:
        return check_min_replicas(
            value, scale_to_zero=bool((info.context or {}).get(SCALE_TO_ZERO))
        )

    @property
    def autoscaled(self) -> bool:
        """Whether the autoscaler decides the size: bounds that leave a choice, and no pin."""
        return self.replicas is None and self.min_replicas < self.upper

    def policy(self) -> ScalingPolicy:
        """What the autoscaler's decision takes."""
        return ScalingPolicy(
            min_replicas=self.min_replicas, max_replicas=self.upper, **self.tuning()
        )

    @property
    def upper(self) -> int:
        """maxReplicas, or minReplicas when it is unset (a fixed-size endpoint)."""
        return self.max_replicas if self.max_replicas is not None else max(self.min_replicas, 1)

    @model_validator(mode="after")
    def _bounds(self) -> ScalingSpec:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas: must not exceed maxReplicas ({self.min_replicas} > {self.max_replicas})"
            )
        if self.replicas is not None and not self.min_replicas <= self.replicas <= self.upper:
            raise ValueError(
                f"replicas: {self.replicas} is outside minReplicas..maxReplicas "
                f"({self.min_replicas}..{self.upper})"
            )
        return self


class RolloutSpec(_Model):
    strategy: Literal["RollingUpdate", "Recreate"] = "RollingUpdate"
    max_surge: IntOrPercent = 0
    max_unavailable: IntOrPercent = 1

    @model_validator(mode="after")
    def _progress_possible(self) -> RolloutSpec:
        if (
            self.strategy == "RollingUpdate"
            and self.max_surge in (0, "0%")
            and (self.max_unavailable in (0, "0%"))
        ):
            raise ValueError(
                "maxUnavailable: cannot be 0 while maxSurge is 0 (the rollout could not start)"
            )
        return self


class StreamingSpec(_Model):
    batch_size: int | None = Field(None, ge=1)
    min_batch_size: int | None = Field(None, ge=1)
    batch_size_growth_factor: float | None = Field(None, ge=1)


class ServiceSpec(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(80, ge=1, le=65535)
    annotations: dict[str, str] = Field(default_factory=dict)


class IngressTLS(_Model):
    secret_name: ObjectName


class IngressSpec(_Model):
    enabled: bool = False
    host: str | None = Field(None, min_length=1)
    class_name: str | None = Field(None, min_length=1)
    path: str = Field("/", pattern=r"^/")
    tls: IngressTLS | None = None
    annotations: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _tls_needs_host(self) -> IngressSpec:
        if self.tls is not None and self.host is None:
            raise ValueError("tls: needs a host (the certificate is issued for it)")
        return self


class PickerPort(_Model):
    number: int = Field(ge=1, le=65535)


class EndpointPickerRef(_Model):
    """The endpoint picker an InferencePool's gateway asks (InferencePool v1's endpointPickerRef,
    field for field, so a reference copied from the Gateway API Inference Extension's docs works)."""

    name: str = Field(min_length=1, max_length=253)
    group: str = Field(
        "",
        max_length=253,
        pattern=r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    )
    kind: str = Field(
        "Service", min_length=1, max_length=63, pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
    )
    port: PickerPort | None = None
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"

    @model_validator(mode="after")
    def _service_needs_port(self) -> EndpointPickerRef:
        if self.kind == "Service" and self.port is None:
            raise ValueError("port: is required when kind is Service (the picker Service's port)")
        return self


class InferencePoolSpec(_Model):
    """An InferencePool (inference.networking.k8s.io/v1) selecting the endpoint's pods, for
    Gateway API gateways with an endpoint picker (docs/gateway-api.md)."""

    # None: the operator's default (LLMEP_OPERATOR_INFERENCE_POOL_DEFAULT).
    enabled: bool | None = None
    endpoint_picker_ref: EndpointPickerRef | None = None


class ApiSpec(_Model):
    api_keys_secret_ref: SecretKeyRef | None = None
    allow_unauthenticated: bool = False
    max_concurrency: int | None = Field(None, ge=1)
    max_queue_length: int | None = Field(None, ge=0)
    default_max_tokens: int | None = Field(None, ge=1)
    streaming: StreamingSpec | None = None
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    ingress: IngressSpec = Field(default_factory=IngressSpec)
    inference_pool: InferencePoolSpec = Field(default_factory=InferencePoolSpec)

    def published_outside_cluster(self) -> list[str]:
        """How clients outside the cluster reach the endpoint (empty: only from inside it)."""
        ways = []
        if self.service.type != "ClusterIP":
            ways.append(f"service.type {self.service.type}")
        if self.ingress.enabled:
            ways.append("an Ingress")
        return ways

    @model_validator(mode="after")
    def _no_accidental_exposure(self) -> ApiSpec:
        # Publishing a GPU endpoint to the world without keys is refused unless asked for in so
        # many words; the CRD holds the same rule in CEL (docs/security.md).
        ways = self.published_outside_cluster()
        if ways and self.api_keys_secret_ref is None and not self.allow_unauthenticated:
            raise ValueError(
                f"apiKeysSecretRef: is required when the endpoint is published outside the "
                f"cluster ({' and '.join(ways)}); set it to a Secret of API keys, or set "
                f"spec.api.allowUnauthenticated: true to publish it without keys"
            )
        return self


# A LoRA adapter's name is a `model` value clients send and a Prometheus label: a DNS label.
_ADAPTER_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# vLLM 0.32's accepted --max-lora-rank values.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterSpec(_Model):
    """One LoRA adapter served next to the base model."""

    name: str = Field(min_length=1, max_length=63)
    source: str = Field(min_length=1)
    revision: str | None = Field(None, min_length=1)
    rank: int | None = Field(None, ge=1, le=512)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not _ADAPTER_NAME.match(value):
            raise ValueError(
                f"{value!r} must be a lowercase DNS label (letters, digits and '-'; clients send "
                "it as model)"
            )
        return value


class EndpointSpec(_Model):
    """`.spec` of an LLMEndpoint."""

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    cache: CacheSpec | None = None
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    api: ApiSpec = Field(default_factory=ApiSpec)
    adapters: tuple[AdapterSpec, ...] = Field((), max_length=100)
    # Read by the gateway (llmendpoints_gateway.routing.Strategy), not by the operator.
    routing: Literal["prefix-aware", "least-loaded", "round-robin"] = "prefix-aware"

    @model_validator(mode="after")
    def _adapter_names_unique(self) -> EndpointSpec:
        seen: set[str] = set()
        for index, adapter in enumerate(self.adapters):
            if adapter.name in seen:
                raise ValueError(f"adapters[{index}].name: {adapter.name!r} is declared twice")
            seen.add(adapter.name)
        return self

    @property
    def parallelism(self) -> Parallelism:
        """The replica's parallel sizes, derived (parallelism.py); valid once parsed."""
        engine, resources = self.engine, self.resources
        return derive(
            gpus=resources.gpus,
            nodes=resources.nodes,
            tensor=engine.tensor_parallel_size,
            pipeline=engine.pipeline_parallel_size,
            data=engine.data_parallel_size,
            expert=engine.enable_expert_parallel,
        )

    @model_validator(mode="after")
    def _parallelism_fits(self) -> EndpointSpec:
        try:
            _ = self.parallelism
        except ParallelismError as exc:
            raise ValueError(f"engine.{exc.field}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _groups_share_the_cache(self) -> EndpointSpec:
        # A group's pods run on different nodes and all read the weights from the cache.
        modes = set(self.cache.access_modes) if self.cache and self.cache.size else set()
        if self.resources.nodes > 1 and modes and not modes & {"ReadWriteMany", "ReadOnlyMany"}:
            raise ValueError(
                f"cache.accessModes: {sorted(modes)} attaches the volume to one node, but the "
                f"{self.resources.nodes} pods of a group (resources.nodes) run on different nodes "
                "and all mount it: use ReadWriteMany"
            )
        return self

    @model_validator(mode="after")
    def _baked_image_is_complete(self) -> EndpointSpec:
        if self.model.baked_into_image:
            if self.engine.image is None:
                raise ValueError(
                    "model.bakedIntoImage: set engine.image to the image the weights were baked into"
                )
            if self.cache is not None:
                raise ValueError(
                    "model.bakedIntoImage: remove cache (the weights are in the image; a cache "
                    "volume would hide them)"
                )
        return self


# --- parsing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: the field as the user writes it, and what is wrong."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidSpecError(ValueError):
    """The spec cannot be reconciled; `problems` name every offending field."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(problem) for problem in problems))


@dataclass(frozen=True)
class Endpoint:
    """A validated LLMEndpoint: identity plus its spec with defaults applied."""

    name: str
    namespace: str
    spec: EndpointSpec

    @property
    def served_model_name(self) -> str:
        return self.spec.model.served_model_name or self.name

    def check_adapters(self) -> list[Problem]:
        """What the spec alone cannot see: an adapter named like the base model."""
        return [
            Problem(f"spec.adapters[{i}].name", f"{a.name!r} is the base model's served name")
            for i, a in enumerate(self.spec.adapters)
            if a.name == self.served_model_name
        ]

    def check_name(self) -> list[Problem]:
        """A multi-node endpoint's name prefixes its groups' pods and StatefulSets: shorter."""
        if self.spec.resources.nodes == 1 or len(self.name) <= MAX_MULTINODE_NAME_LENGTH:
            return []
        return [
            Problem(
                "metadata.name",
                f"{self.name!r} is {len(self.name)} characters; a multi-node endpoint "
                f"(spec.resources.nodes > 1) may have at most {MAX_MULTINODE_NAME_LENGTH}: it "
                "prefixes the names of its LeaderWorkerSet's StatefulSets and pods",
            )
        ]


_MESSAGES = {
    "missing": "is required",
    "extra_forbidden": "is not a field of LLMEndpoint (check the spelling)",
}


def _field_path(loc: tuple[int | str, ...], prefix: str) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith(("function-", "literal[", "union[")) or part in {"str", "int"}:
            continue  # pydantic's names for validators and union members, not user fields
        else:
            path += f".{part}"
    return path


def _problem(error: Mapping[str, Any], prefix: str) -> Problem:
    field = _field_path(tuple(error["loc"]), prefix)
    message = _MESSAGES.get(error["type"]) or str(error["msg"]).removeprefix("Value error, ")
    # Model-level validators report "spec.engine: args.x: ..." - fold the inner path in.
    if ": " in message and error["type"] == "value_error":
        inner, rest = message.split(": ", 1)
        if re.fullmatch(r"[A-Za-z0-9_.\[\]-]+", inner):
            field, message = f"{field}.{inner}", rest
    elif "input" in error and error["type"] not in ("missing", "extra_forbidden", "value_error"):
        value = error["input"]
        if isinstance(value, str | int | float | bool) and len(repr(value)) <= 60:
            message = f"{message} (got {value!r})"
    return Problem(field, message)


def parse(
    name: str, namespace: str, spec: Mapping[str, Any] | None, *, scale_to_zero: bool = False
) -> Endpoint:
    """Validate an LLMEndpoint's metadata.name and spec; raise InvalidSpecError naming every field.
    `scale_to_zero`: the operator has a request-holding gateway (LLMEP_OPERATOR_GATEWAY_URL), so
    spec.scaling.minReplicas 0 is allowed."""
    problems: list[Problem] = []
    if not _ENDPOINT_NAME.match(name) or len(name) > MAX_ENDPOINT_NAME_LENGTH:
        problems.append(
            Problem(
                "metadata.name",
                f"{name!r} must be a lowercase DNS label of at most {MAX_ENDPOINT_NAME_LENGTH} "
                "characters starting with a letter (it names the endpoint's Service)",
            )
        )
    parsed: EndpointSpec | None = None
    try:
        parsed = EndpointSpec.model_validate(
            dict(spec or {}), context={SCALE_TO_ZERO: scale_to_zero}
        )
    except ValidationError as exc:
        problems.extend(_problem(error, "spec") for error in exc.errors())
    if problems or parsed is None:
        raise InvalidSpecError(problems)
    endpoint = Endpoint(name=name, namespace=namespace, spec=parsed)
    if problems := endpoint.check_adapters() + endpoint.check_name():
        raise InvalidSpecError(problems)
    return endpoint

"""`spec.scaling` of an LLMEndpoint: the knobs of the autoscaler, with their defaults.

Pure data. The field names are the CRD's (camelCase aliases); Python code uses the snake_case
attributes. Every bound is checked here so that a bad value is refused with a message naming the
field, before the autoscaler ever runs.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SCALE_TO_ZERO_REFUSED = (
    "spec.scaling.minReplicas: 0 is not supported yet: scale-to-zero needs the request-holding "
    "gateway (a later release), otherwise requests sent while no replica runs would fail; "
    "use minReplicas >= 1"
)


class ScalingPolicy(BaseModel):
    """How one endpoint scales. Defaults are the documented ones (docs/autoscaling.md)."""

    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="forbid")

    min_replicas: int = Field(1, alias="minReplicas")
    max_replicas: int = Field(1, alias="maxReplicas")
    # Queued (admitted, not yet running) requests one replica should carry.
    target_queue_depth: float = Field(2.0, alias="targetQueueDepth", gt=0)
    # Optional second signal: running requests one replica should carry.
    target_in_flight: float | None = Field(None, alias="targetInFlight", gt=0)
    interval_seconds: float = Field(5.0, alias="intervalSeconds", ge=1, le=3600)
    scale_up_stabilization_seconds: float = Field(
        0.0, alias="scaleUpStabilizationSeconds", ge=0, le=3600
    )
    scale_down_stabilization_seconds: float = Field(
        300.0, alias="scaleDownStabilizationSeconds", ge=0, le=3600
    )
    # The long window: the load it averages drives every decision outside a burst.
    stable_window_seconds: float = Field(60.0, alias="stableWindowSeconds", ge=1, le=3600)
    # The short window: when its average demand reaches panicThreshold x the ready capacity,
    # the endpoint scales on it at once and does not scale down until the burst has been over
    # for a whole stable window.
    panic_window_seconds: float = Field(10.0, alias="panicWindowSeconds", ge=1, le=3600)
    panic_threshold: float = Field(2.0, alias="panicThreshold", gt=1, le=100)
    # Growth per decision: at most x maxScaleUpRate, at least +1.
    max_scale_up_rate: float = Field(2.0, alias="maxScaleUpRate", gt=1, le=1000)
    # Dead band around the current size: no change for a demand within +-tolerance of it.
    tolerance: float = Field(0.1, alias="tolerance", ge=0, lt=1)

    @field_validator("min_replicas")
    @classmethod
    def _no_scale_to_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError(SCALE_TO_ZERO_REFUSED)
        if value < 0:
            raise ValueError("spec.scaling.minReplicas must be >= 1")
        return value

    @model_validator(mode="after")
    def _check_bounds(self) -> ScalingPolicy:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"spec.scaling.maxReplicas ({self.max_replicas}) must be >= "
                f"minReplicas ({self.min_replicas})"
            )
        if self.panic_window_seconds > self.stable_window_seconds:
            raise ValueError(
                f"spec.scaling.panicWindowSeconds ({self.panic_window_seconds:g}) must not exceed "
                f"stableWindowSeconds ({self.stable_window_seconds:g})"
            )
        return self

    @property
    def signal_targets(self) -> dict[str, float]:
        """The signals this endpoint scales on, by name, with their per-replica target."""
        targets = {"queueDepth": self.target_queue_depth}
        if self.target_in_flight is not None:
            targets["inFlight"] = self.target_in_flight
        return targets

"""`spec.scaling` of an LLMEndpoint as the autoscaler sees it: the knobs and their defaults.

Pure data. Field names in YAML are camelCase (`targetQueueDepth`), snake_case in Python. Every
bound is checked here, so a bad value is refused with a message naming the field before the
autoscaler ever runs. Messages of cross-field rules start with the field they are about
("panicWindowSeconds: ..."), the convention spec.py folds into "spec.scaling.panicWindowSeconds".

`ScalingTuning` holds the decision's knobs; spec.py's ScalingSpec extends it with the replica
bounds as users write them, and `ScalingPolicy` is what `decide()` takes: tuning + concrete bounds.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

SCALE_TO_ZERO_REFUSED = (
    "0 needs the request-holding gateway and the shared queue: this operator lacks "
    "LLMEP_OPERATOR_GATEWAY_URL or LLMEP_OPERATOR_JOBS_QUEUE_URL (the chart sets both when it "
    "installs the gateway and the queue); without them requests sent while no replica runs "
    "would fail and nothing would bring the first replica back; use 1 or more, or install both"
)


# Samples one stable window holds at most (they are kept in status.autoscaling.state).
MAX_SAMPLES = 120


def check_min_replicas(value: int, scale_to_zero: bool) -> int:
    """`scale_to_zero`: the operator knows a gateway that holds requests while none runs."""
    if value == 0 and not scale_to_zero:
        raise ValueError(SCALE_TO_ZERO_REFUSED)
    if value < 0:
        raise ValueError("must be 0 or more" if scale_to_zero else "must be 1 or more")
    return value


class ScalingTuning(BaseModel):
    """How the autoscaler decides. Defaults are the documented ones (docs/autoscaling.md)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    # Queued (admitted, not yet running) requests one replica should carry.
    target_queue_depth: float = Field(2.0, gt=0)
    # Optional second signal: running requests one replica should carry.
    target_in_flight: float | None = Field(None, gt=0)
    interval_seconds: float = Field(5.0, ge=1, le=3600)
    scale_up_stabilization_seconds: float = Field(0.0, ge=0, le=3600)
    scale_down_stabilization_seconds: float = Field(300.0, ge=0, le=3600)
    # The long window: the load it averages drives every decision outside a burst.
    stable_window_seconds: float = Field(60.0, ge=1, le=3600)
    # The short window: a signal per ready replica at panicThreshold x its target over it is a
    # burst, scaled for at once; no scale-down until a whole stable window without burst.
    panic_window_seconds: float = Field(10.0, ge=1, le=3600)
    panic_threshold: float = Field(2.0, gt=1, le=100)
    # Growth per decision: at most x maxScaleUpRate, at least +1.
    max_scale_up_rate: float = Field(2.0, gt=1, le=1000)
    # Dead band: no scale-up within +tolerance of the current size; scale-downs keep that headroom.
    tolerance: float = Field(0.1, ge=0, lt=1)
    # minReplicas 0: how long nothing may be in flight, held, queued or running before the last
    # replica goes (a cold start reloads the model: minutes, not seconds, is the usual choice).
    scale_to_zero_after_seconds: float = Field(300.0, ge=0, le=86400)

    @model_validator(mode="after")
    def _windows_nest(self) -> ScalingTuning:
        if self.panic_window_seconds > self.stable_window_seconds:
            raise ValueError(
                f"panicWindowSeconds: must not exceed stableWindowSeconds "
                f"({self.panic_window_seconds:g} > {self.stable_window_seconds:g})"
            )
        if self.stable_window_seconds > MAX_SAMPLES * self.interval_seconds:
            raise ValueError(
                f"stableWindowSeconds: must not exceed {MAX_SAMPLES} x intervalSeconds "
                f"({self.stable_window_seconds:g} > {MAX_SAMPLES} x {self.interval_seconds:g}): "
                "the window's samples are kept in status"
            )
        return self

    def tuning(self) -> dict[str, float | None]:
        """The tuning fields by Python name (to build a ScalingPolicy from a subclass)."""
        return {name: getattr(self, name) for name in ScalingTuning.model_fields}

    @property
    def signal_targets(self) -> dict[str, float]:
        """The signals this endpoint scales on, by name, with their per-replica target."""
        targets = {"queueDepth": self.target_queue_depth}
        if self.target_in_flight is not None:
            targets["inFlight"] = self.target_in_flight
        return targets


class ScalingPolicy(ScalingTuning):
    """What `decide()` takes: the tuning plus concrete replica bounds."""

    # 0 is the caller's to allow (spec.py refuses it without a gateway).
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> ScalingPolicy:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"maxReplicas: must be at least minReplicas "
                f"({self.max_replicas} < {self.min_replicas})"
            )
        return self

"""A batch's scaling signal: what the autoscaler needs to size an endpoint for a batch's window
rather than for its backlog (pure; the wire format of ``batch.<ns>.<name>.<batch id>`` in
``LLMEP_SIGNALS``, refreshed by the batch's driver, gone when it ends or its driver stops).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from llmendpoints_common.batch.record import BatchRecord


@dataclass(frozen=True)
class BatchSignal:
    batch: str
    remaining: int  # requests without an answer yet (queued in the batch, in the lane, running)
    deadline: float  # the window's end (epoch seconds)
    rate: float | None = None  # requests answered per second lately (None: not known yet)
    on_schedule: bool | None = None  # the driver's forecast (None: not known yet)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> BatchSignal | None:
        """None for anything malformed (a hand edit, another version): scaling goes on."""
        try:
            value = json.loads(data)
            return cls(
                batch=str(value["batch"]),
                remaining=max(0, int(value["remaining"])),
                deadline=float(value["deadline"]),
                rate=None if value.get("rate") is None else max(0.0, float(value["rate"])),
                on_schedule=value.get("on_schedule")
                if isinstance(value.get("on_schedule"), bool)
                else None,
            )
        except (ValueError, TypeError, KeyError):
            return None

    @classmethod
    def of(cls, record: BatchRecord) -> BatchSignal:
        estimate = record.estimate
        return cls(
            batch=record.id,
            remaining=record.remaining,
            deadline=record.expires_at,
            rate=estimate.rate if estimate is not None else None,
            on_schedule=estimate.on_schedule if estimate is not None else None,
        )

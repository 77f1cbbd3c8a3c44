"""Will a batch finish inside its window, at the rate it goes? (pure)

The driver samples how many of a batch's requests have finished; the rate over the last
``RATE_WINDOW_SECONDS`` gives when the rest would be done. A batch that would end after its
window is not on schedule -- shown in the batch (``metadata.llmep_on_schedule``, RunPod's
``onSchedule``) and in the scaling signal the operator reads, before the window ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmendpoints_common.batch.record import Estimate

RATE_WINDOW_SECONDS = 120.0
# A rate needs this much history before it says anything.
MIN_SPAN_SECONDS = 5.0


def trim(samples: Sequence[tuple[float, int]], now: float) -> list[tuple[float, int]]:
    """The samples (time, finished) worth keeping: the rate window, and one before it."""
    kept = [s for s in samples if s[0] >= now - RATE_WINDOW_SECONDS]
    older = [s for s in samples if s[0] < now - RATE_WINDOW_SECONDS]
    return ([older[-1]] if older else []) + kept


def rate(samples: Sequence[tuple[float, int]]) -> float | None:
    """Requests finished per second between the first and the last sample (None: too short a
    span to say)."""
    if len(samples) < 2:
        return None
    (t0, n0), (t1, n1) = samples[0], samples[-1]
    if t1 - t0 < MIN_SPAN_SECONDS:
        return None
    return max(0.0, (n1 - n0) / (t1 - t0))


def estimate(
    samples: Sequence[tuple[float, int]], *, remaining: int, deadline: float, now: float
) -> Estimate:
    """When the ``remaining`` requests would be done at the recent rate, and whether that is
    before ``deadline``. A batch with nothing done for a whole span is not on schedule once
    its window is half gone (it may be waiting for a replica to start)."""
    if remaining <= 0:
        return Estimate(rate=rate(samples), finish_at=now, on_schedule=True)
    current = rate(samples)
    if current is None:
        return Estimate()
    if current == 0:
        started = samples[0][0] if samples else now
        half_gone = now >= started + (deadline - started) / 2
        return Estimate(rate=0.0, finish_at=None, on_schedule=False if half_gone else None)
    finish = now + remaining / current
    return Estimate(rate=round(current, 4), finish_at=finish, on_schedule=finish <= deadline)

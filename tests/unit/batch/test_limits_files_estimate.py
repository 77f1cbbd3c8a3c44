"""Windows, file fields, the schedule estimate, the scaling signal, the batch share."""

from __future__ import annotations

import pytest
from llmendpoints_common.batch import estimate as est
from llmendpoints_common.batch.files import (
    FileRecord,
    check_filename,
    check_purpose,
    expires_after,
)
from llmendpoints_common.batch.limits import BatchEnv, BatchLimits
from llmendpoints_common.batch.signal import BatchSignal
from llmendpoints_common.errors import BadRequestError

LIMITS = BatchLimits()


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86_400), ("1h", 3600), ("2d", 172_800)])
def test_windows_are_durations_within_the_servers_range(window, seconds):
    assert LIMITS.window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["24", "h", "0h", "1.5h", "24 h", 24, None, "30m", "8d"])
def test_other_windows_are_a_400_naming_completion_window(window):
    with pytest.raises(BadRequestError) as caught:
        LIMITS.window_seconds(window)
    assert caught.value.param == "completion_window"


def test_settings_become_limits():
    env = BatchEnv.model_validate(
        {"LLMEP_BATCH_MAX_REQUESTS": "10", "LLMEP_BATCH_MIN_WINDOW_SECONDS": "1"}
    )
    limits = env.batch_limits()
    assert (limits.max_requests, limits.window_seconds("5s")) == (10, 5)


def test_upload_fields():
    assert check_purpose("batch") == "batch"
    for bad in (None, "fine-tune", "assistants"):
        with pytest.raises(BadRequestError) as caught:
            check_purpose(bad)
        assert caught.value.param == "purpose"
    assert check_filename("C:\\data\\in.jsonl") == "in.jsonl"
    assert check_filename("../../etc/passwd") == "passwd"
    for bad in (None, "", "a/", "x" * 300, "bad\x00name"):
        with pytest.raises(BadRequestError):
            check_filename(bad)
    assert expires_after(None, None, LIMITS) == 30 * 86_400
    assert expires_after("created_at", "7200", LIMITS) == 7200
    for anchor, seconds in (("created_at", "60"), ("created_at", "9999999"), ("now", "7200"), ("created_at", "x")):  # fmt: skip
        with pytest.raises(BadRequestError):
            expires_after(anchor, seconds, LIMITS)


def test_a_file_record_is_openais_file_object():
    record = FileRecord(id="file-x", owner="a", filename="in.jsonl", purpose="batch", bytes=10,
                        created_at=1.5, expires_at=100.9)  # fmt: skip
    assert record.to_openai() == {
        "id": "file-x", "object": "file", "bytes": 10, "created_at": 1, "expires_at": 100,
        "filename": "in.jsonl", "purpose": "batch", "status": "processed", "status_details": None,
    }  # fmt: skip


def test_the_estimate_needs_history_then_forecasts_against_the_deadline():
    assert est.estimate([], remaining=10, deadline=100, now=0).on_schedule is None
    short = [(0.0, 0), (1.0, 5)]
    assert est.rate(short) is None  # less than MIN_SPAN_SECONDS of history
    samples = [(0.0, 0), (10.0, 20)]  # 2 per second
    on_time = est.estimate(samples, remaining=40, deadline=100, now=10)
    assert (on_time.rate, on_time.finish_at, on_time.on_schedule) == (2.0, 30.0, True)
    late = est.estimate(samples, remaining=400, deadline=100, now=10)
    assert late.finish_at == 210 and late.on_schedule is False
    assert est.estimate(samples, remaining=0, deadline=100, now=10).on_schedule is True


def test_a_batch_with_no_progress_is_late_once_half_its_window_is_gone():
    stalled = [(0.0, 0), (10.0, 0)]
    assert est.estimate(stalled, remaining=5, deadline=100, now=10).on_schedule is None
    stalled = [(0.0, 0), (60.0, 0)]
    assert est.estimate(stalled, remaining=5, deadline=100, now=60).on_schedule is False


def test_trim_keeps_the_window_and_one_sample_before_it():
    samples = [(float(t), t) for t in range(0, 300, 10)]
    kept = est.trim(samples, 300)
    assert kept[0] == (170.0, 170) and kept[-1] == (290.0, 290)


def test_the_batch_signal_round_trips_and_survives_garbage():
    signal = BatchSignal("batch_x", remaining=5, deadline=100.0, rate=0.5, on_schedule=True)
    assert BatchSignal.decode(signal.encode()) == signal
    for junk in (b"", b"{", b'{"batch": "b"}', b'{"batch": "b", "remaining": "x", "deadline": 1}'):
        assert BatchSignal.decode(junk) is None
    negative = BatchSignal.decode(b'{"batch": "b", "remaining": -3, "deadline": 1, "rate": -1}')
    assert (negative.remaining, negative.rate) == (0, 0.0)

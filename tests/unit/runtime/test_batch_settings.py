"""Batches in the runtime's configuration: vLLM's priority scheduling when batches are on, the
batch share of a pod's capacity, where a pod without the queue keeps its batch files."""

from __future__ import annotations

import pytest
from llmendpoints_runtime.config import ConfigError, batch_dir, load_config, load_settings
from llmendpoints_runtime.jobs.queue_worker import BatchShare

BASE = {"MODEL_NAME": "org/model"}


def test_batches_on_means_vllm_schedules_by_priority():
    assert load_config(BASE).engine_args.scheduling_policy == "priority"
    assert load_config({**BASE, "SCHEDULING_POLICY": "priority"}).engine_args.scheduling_policy == "priority"  # fmt: skip


def test_batches_off_leave_vllms_default_and_any_policy():
    off = {**BASE, "LLMEP_BATCH_ENABLED": "false"}
    assert load_config(off).engine_args.scheduling_policy == "fcfs"
    assert load_config({**off, "SCHEDULING_POLICY": "fcfs"}).engine_args.scheduling_policy == "fcfs"


def test_fcfs_with_batches_on_is_refused_naming_both_variables():
    with pytest.raises(ConfigError) as caught:
        load_config({**BASE, "SCHEDULING_POLICY": "fcfs"})
    assert caught.value.variable == "SCHEDULING_POLICY"
    assert "LLMEP_BATCH_ENABLED" in str(caught.value)


@pytest.mark.parametrize(
    ("capacity", "busy", "waiting", "slots"),
    [
        (8, 0, 0, 6),  # 0.75 of the capacity at most
        (8, 3, 0, 5),  # interactive work takes its room first
        (8, 7, 0, 1),
        (8, 9, 0, 0),  # never negative
        (8, 0, 2, 0),  # the engine cannot schedule what it has: nothing more
        (1, 0, 0, 1),  # at least one on a pod of one
        (300, 0, 0, 225),
    ],
)
def test_the_batch_share_of_a_pod(capacity, busy, waiting, slots):
    assert BatchShare(max_share=0.75).slots(capacity, busy, waiting) == slots


def test_the_batch_folder_is_under_the_model_cache_unless_set():
    assert batch_dir(load_settings({"BASE_PATH": "/models"}), {}) == "/models/llmendpoints-batches"
    assert batch_dir(load_settings({}), {"HF_HOME": "/hf"}) == "/hf/llmendpoints-batches"
    assert batch_dir(load_settings({}), {"HOME": "/home/u"}) == (
        "/home/u/.cache/huggingface/llmendpoints-batches"
    )
    assert batch_dir(load_settings({"LLMEP_BATCH_DIR": "/data/b"}), {}) == "/data/b"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("LLMEP_BATCH_MAX_SHARE", "0"),
        ("LLMEP_BATCH_MAX_SHARE", "1.5"),
        ("LLMEP_BATCH_PRIORITY", "0"),
    ],
)
def test_batch_settings_are_checked(variable, value):
    with pytest.raises(ConfigError) as caught:
        load_settings({variable: value})
    assert caught.value.variable == variable

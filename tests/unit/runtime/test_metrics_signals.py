"""The runtime's two autoscaling gauges count every request once (docs/contracts.md, "Runtime -> operator")."""

from __future__ import annotations

from llmendpoints_runtime.metrics import RuntimeMetrics
from prometheus_client.exposition import generate_latest


def gauges(metrics: RuntimeMetrics) -> tuple[float, float]:
    values = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(("llmendpoints_queue_depth ", "llmendpoints_requests_in_flight ")):
            name, value = line.split()
            values[name] = float(value)
    return values["llmendpoints_queue_depth"], values["llmendpoints_requests_in_flight"]


def wired(admission_waiting: int, handed: int, engine_waiting: int, jobs=(0, 0)) -> RuntimeMetrics:
    metrics = RuntimeMetrics()
    metrics.add_queue_source(lambda: admission_waiting)
    metrics.set_engine_waiting_source(lambda: engine_waiting)
    metrics.add_in_flight_source(lambda: handed)
    metrics.add_queue_source(lambda: jobs[0])  # queued jobs
    metrics.add_in_flight_source(lambda: jobs[1])  # running jobs (engine requests)
    return metrics


def test_engine_waiting_requests_are_queue_not_in_flight():
    # MAX_NUM_SEQS=2, 24 requests all handed to vLLM (admission limit above 24): 2 run, 22 wait.
    assert gauges(wired(admission_waiting=0, handed=24, engine_waiting=22)) == (22, 2)
    # Admission limit 8: 16 wait for a slot, 6 of the 8 handed wait in vLLM's scheduler.
    assert gauges(wired(admission_waiting=16, handed=8, engine_waiting=6)) == (22, 2)


def test_the_sum_is_the_outstanding_work_jobs_included():
    queue, in_flight = gauges(wired(3, 10, 4, jobs=(5, 2)))
    # Outstanding: 3 + 10 requests, 5 queued + 2 running jobs; vLLM holds 4 of the 12 handed.
    assert (queue, in_flight) == (3 + 5 + 4, 10 + 2 - 4)
    assert queue + in_flight == 3 + 10 + 5 + 2


def test_the_engine_count_is_clamped_to_what_was_handed_over():
    # Read one after the other, vLLM may still count a request its slot already released.
    assert gauges(wired(0, 2, 5)) == (2, 0)
    assert gauges(wired(0, 0, 0)) == (0, 0)

"""/metrics of a pod of several API processes: every request counted once.

The processes run prometheus_client in multiprocess mode (the supervisor sets
PROMETHEUS_MULTIPROC_DIR before it starts them, as ``vllm serve --api-server-count`` does):
each writes its series -- ours and vLLM's -- to files in that directory, and a render reads
them all (``MultiProcessCollector``): counters and histograms add up, gauges combine as each
says (vLLM's engine gauges: the most recent value per engine; ours: metrics.py). The two
signals the autoscaler reads are the pod's, from the board: queue depth = every process's
waiting work + what the engines' schedulers hold waiting (vLLM's own gauge, every engine);
in flight = every process's handed work less that (metrics.split_signals).

The same text from any process and from the supervisor's control port.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmendpoints_common import signals
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from llmendpoints_runtime.health import Probe
from llmendpoints_runtime.metrics import IN_FLIGHT_HELP, QUEUE_DEPTH_HELP, split_signals
from llmendpoints_runtime.pod.board import PodBoard

ENGINE_WAITING = "vllm:num_requests_waiting"


class _Collected:
    """A registry's worth of metrics, collected once."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def engine_waiting(metrics: Iterable[Metric]) -> int:
    """Requests the engines' schedulers hold waiting, summed over engines (pure)."""
    total = 0.0
    for metric in metrics:
        if metric.name == ENGINE_WAITING:
            total += sum(s.value for s in metric.samples if s.name == ENGINE_WAITING)
    return int(total)


def signal_families(board: PodBoard, waiting_in_engines: int) -> list[Metric]:
    queue, in_flight = split_signals(
        int(board.total("queue")), int(board.total("handed")), waiting_in_engines
    )
    depth = GaugeMetricFamily(signals.QUEUE_DEPTH, QUEUE_DEPTH_HELP, value=queue)
    running = GaugeMetricFamily(signals.IN_FLIGHT, IN_FLIGHT_HELP, value=in_flight)
    return [depth, running]


def render(board: PodBoard) -> bytes:
    """The pod's /metrics text."""
    files = CollectorRegistry()
    multiprocess.MultiProcessCollector(files)
    collected = list(files.collect())
    everything = CollectorRegistry(auto_describe=False)
    everything.register(_Collected(signal_families(board, engine_waiting(collected)) + collected))
    return generate_latest(everything)


class PodView:
    """The pod's answers (probes and /metrics), the same from every API process and from the
    supervisor's control port."""

    def __init__(self, board: PodBoard) -> None:
        self.board = board

    def liveness(self) -> Probe:
        return self.board.liveness()

    def readiness(self, strict: bool) -> Probe:
        return self.board.readiness(strict)

    def metrics(self) -> bytes:
        return render(self.board)

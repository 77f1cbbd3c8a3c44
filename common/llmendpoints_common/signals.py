"""Names of the Prometheus series the autoscaler reads from every runtime pod's /metrics.

The contract between the runtime (which exports them, llmendpoints_runtime/metrics.py) and the
operator's autoscaler (which scrapes them, llmendpoints_operator/autoscaling/scrape.py); checked
end to end by tests/contract/test_metrics_contract.py. Keep the names and meaning stable: a
rolling upgrade runs old pods under a new operator.

- QUEUE_DEPTH: requests and jobs admitted but not running yet (a gauge);
- IN_FLIGHT: requests the engine is running now (a gauge). Their sum is the pod's outstanding
  work; neither counts what the other does.
"""

from __future__ import annotations

QUEUE_DEPTH = "llmendpoints_queue_depth"
IN_FLIGHT = "llmendpoints_requests_in_flight"

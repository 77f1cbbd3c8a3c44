"""Cold start, engineered (docs/operator.md, "Cold start"): for endpoints that scale to zero,
the weights downloaded and the runtime image pulled before a replica needs them
(``manifests``: the download Job and the pre-pull DaemonSet, pure), and each replica's start
recorded phase by phase (``record``: pure; ``recorder``: reads the pod's events and /metrics,
writes ``status.coldStart``)."""

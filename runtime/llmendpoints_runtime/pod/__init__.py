"""A pod of several API processes on one engine (API_SERVER_COUNT > 1).

vLLM's multi-API-server mode, with the runtime's whole edge in every process: ``supervisor``
launches the engine and the API processes (as ``vllm serve --api-server-count`` does, with
the runtime's own process as each API server's body) and answers the control port once for the
pod; ``board`` is what they share; ``admission`` holds MAX_CONCURRENCY and MAX_QUEUE_LENGTH
for the pod; ``jobs`` finds a job from any process; ``metrics`` renders the pod's /metrics;
``api_process`` is one API process. docs/api-servers.md tells the whole story.
"""

"""Code the runtime and the gateway share: the error vocabulary, the job wire models, the queue
client. It imports neither of them, nor vLLM, nor any web framework (import-linter checks)."""

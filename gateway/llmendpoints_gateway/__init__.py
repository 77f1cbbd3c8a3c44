"""The gateway: one front door for every endpoint -- routing by model, holding while an endpoint
has no ready replica, keys and quotas, the job API on the shared queue. No vLLM import."""

__version__ = "0.1.0"

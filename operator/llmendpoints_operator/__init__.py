"""The LLMEndpoint operator: reconciles LLMEndpoint resources into serving workloads."""

__version__ = "0.1.0"

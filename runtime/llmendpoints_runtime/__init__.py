"""The LLM Endpoints runtime: vLLM's OpenAI server plus the RunPod job API and SageMaker contract."""

__version__ = "0.1.0"

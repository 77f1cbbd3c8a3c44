"""Our vLLM general plugin: vLLM calls ``register`` in every process it starts (the API server,
the engine core, each worker), before a model is built. Registered in pyproject.toml under the
entry-point group ``vllm.general_plugins`` as ``llmendpoints``; ``VLLM_PLUGINS`` (vLLM's own
setting) can leave it out.

It does two things. It watches the log records in which vLLM reports its compile time and
whether the compiled model came from the compile cache (startup_report.py). And it lets vLLM
0.32 load the compiled model it saved on platforms that compile
with a plain torch backend (the CPU build: ``CompilationMode.DYNAMO_TRACE_ONCE`` with
``backend="inductor"``). vLLM's ``_try_load_aot_compiled_fn`` calls
``compiled_fn.finalize_loading(vllm_config)`` on every loaded artifact; only vLLM's own
``VllmSerializableFunction`` (``CompilationMode.VLLM_COMPILE``, the GPU path) has that method.
Torch wraps an Inductor-compiled graph in ``BundledAOTAutogradSerializableCallable``, which
forwards unknown attributes to the compiled function, so the call fails with "'function' object
has no attribute 'finalize_loading'" and vLLM compiles the model again on every start. That
callable is complete once deserialised -- there is nothing to finalise -- so the method added
here does nothing. Reported upstream with a reproduction (bench/RESULTS.md, "Cold start");
when vLLM guards the call itself, the class keeps working and this plugin changes nothing.
"""

from __future__ import annotations

from llmendpoints_runtime import startup_report


def register() -> None:
    startup_report.observe_vllm_logs()
    make_bundled_artifacts_loadable()


def make_bundled_artifacts_loadable() -> bool:
    """Give torch's bundled Inductor callable the no-op ``finalize_loading`` vLLM calls on
    load; True when it was added (False: torch has no such class, or it has the method)."""
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:  # a torch without AOT compile: vLLM does not save artifacts either
        return False
    if "finalize_loading" in vars(BundledAOTAutogradSerializableCallable):
        return False

    def finalize_loading(self, vllm_config) -> None:
        """Nothing to finalise: deserialising the bundle loaded the compiled graph whole."""

    BundledAOTAutogradSerializableCallable.finalize_loading = finalize_loading
    return True

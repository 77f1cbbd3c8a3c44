"""Will the model fit the GPUs the endpoint asks for? Answered before any pod is asked for.

vLLM finds out at start-up, minutes after `kubectl apply`, with the GPUs already held: the weights
do not fit, or they fit but the KV cache cannot hold one sequence of max_model_len. Everything it
computes then can be computed before, from what the operator can read without downloading weights:
the model's config.json and its safetensors headers (names, dtypes, shapes: the weights' exact
bytes), the GPU's memory (GPU feature discovery's node labels, or spec.resources.gpuMemory) and the
spec. docs/operator.md, "Will it fit?", says how and where the estimate ends.

PURE modules, each a part of vLLM 0.32's own arithmetic:

- `safetensors`   header bytes -> tensors (name, dtype, shape, bytes);
- `architecture`  config.json -> the shapes vLLM builds (layers, KV heads, head size, sliding
                  windows, MLA), or UnknownModel with the reason;
- `weights`       tensors -> the bytes each GPU holds after tensor and pipeline sharding;
- `kvcache`       KV cache specs, blocks and tokens as vllm/v1/core/kv_cache_utils.py counts them;
- `overhead`      what vLLM's memory profiling reserves beside weights and KV cache (activation
                  peak, CUDA graphs, non-torch memory);
- `nodes`         the GPU nodes a pod may be scheduled on, and their GPU memory;
- `inputs`        an admitted endpoint -> the check's inputs (the one place reading the spec);
- `verdict`       all of it -> ModelFits True / False (with what to change) / Unknown (with why).

`checker` (I/O: the hub client, the API's nodes and Secrets, caches, time bounds) puts them to
work for the reconcile and the `llmendpoints-operator fit` CLI.
"""

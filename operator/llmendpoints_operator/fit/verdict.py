"""Does the model fit? True with the numbers; False with what it needs and what to change;
Unknown with why. PURE.

The reserve beside weights and KV cache is an estimate (overhead.py), so a model is refused only
when it would not fit with half of it, and called a fit only when it fits with all of it; in
between the answer is Unknown (Borderline) and the rollout goes on. Every suggestion is a
configuration `sizing.size` has checked: a shorter maxModelLen, an FP8 KV cache, a higher
gpuMemoryUtilization, more GPUs with tensor parallelism (a count that divides the attention heads
and one node has), or a quantized checkpoint when no such count holds the weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from llmendpoints_operator.fit.architecture import ModelShape, UnknownModel, read_config
from llmendpoints_operator.fit.inputs import FitInputs
from llmendpoints_operator.fit.sizing import GpuMemory, ModelFacts, Sizing, size

GiB = 1 << 30
TP_CANDIDATES = (2, 4, 8, 16, 32)
DEFAULT_GPUS_PER_NODE = 8
OPTIMISTIC = 0.5  # the share of the estimated reserve a refusal must survive
HIGHEST_UTILIZATION = 0.95


@dataclass(frozen=True)
class Fit:
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    numbers: Mapping[str, Any] | None = None  # status.fit

    @property
    def refuses(self) -> bool:
        return self.status == "False"


def unknown(reason: str, message: str) -> Fit:
    return Fit("Unknown", reason, message)


def _gib(value: int) -> str:
    if abs(value) < GiB:
        return f"{value / (1 << 20):.1f} MiB"
    return f"{value / GiB:.1f} GiB"


def _numbers(s: Sizing, gpu: GpuMemory, inputs: FitInputs, facts: ModelFacts) -> dict[str, Any]:
    numbers: dict[str, Any] = {
        "weightsBytes": s.weights_total,
        "weightsBytesPerGpu": s.weights_per_gpu,
        "kvCacheBytesPerToken": s.kv_per_token,
        "kvCacheDtype": s.kv_dtype,
        "gpuMemoryBytes": gpu.bytes,
        "gpus": inputs.parallel.gpus,
        "reservedBytesPerGpu": s.reserve,
        "kvCacheBytesPerGpu": s.kv_memory,
        "kvCacheTokens": s.plan.tokens,
        "maxConcurrentSequences": int(s.plan.concurrency),
        "maxModelLen": s.max_len,
    }
    if gpu.product:
        numbers["gpuProduct"] = gpu.product
    if facts.revision:
        numbers["revision"] = facts.revision
    return numbers


def _fits(shape: ModelShape, facts: ModelFacts, inputs: FitInputs, gpu: GpuMemory) -> Sizing | None:
    try:
        sizing = size(shape, facts.tensors, inputs, gpu)
    except UnknownModel:
        return None
    return sizing if sizing.plan.fits else None


def _more_gpus(
    shape: ModelShape, facts: ModelFacts, inputs: FitInputs, gpu: GpuMemory
) -> str | None:
    par = inputs.parallel
    per_node = gpu.per_node or DEFAULT_GPUS_PER_NODE
    for tp in TP_CANDIDATES:
        if tp <= par.tensor or shape.num_heads % tp or tp * par.pipeline * par.data > per_node:
            continue
        more = dataclasses.replace(inputs, parallel=dataclasses.replace(par, tensor=tp))
        if (found := _fits(shape, facts, more, gpu)) is not None:
            return (
                f"spec.resources.gpus: {more.parallel.gpus} with spec.engine.tensorParallelSize: "
                f"{tp} ({found.plan.tokens:,} tokens of KV cache)"
            )
    return None


def _suggestions(
    shape: ModelShape, facts: ModelFacts, inputs: FitInputs, gpu: GpuMemory, s: Sizing
) -> list[str]:
    out: list[str] = []
    if s.weights_fit and s.plan.longest > 0:
        out.append(f"spec.engine.maxModelLen: {s.plan.longest:,} or less")
    if s.weights_fit and s.kv_dtype in ("bfloat16", "float16", "float32"):
        fp8 = _fits(shape, facts, dataclasses.replace(inputs, kv_cache_dtype="fp8"), gpu)
        if fp8 is not None:
            out.append(
                f"an FP8 KV cache, spec.engine.args: {{kv-cache-dtype: fp8}} ({fp8.plan.tokens:,} "
                "tokens)"
            )
    if inputs.gpu_memory_utilization < HIGHEST_UTILIZATION and not inputs.kv_cache_memory_bytes:
        higher = dataclasses.replace(inputs, gpu_memory_utilization=HIGHEST_UTILIZATION)
        if (found := _fits(shape, facts, higher, gpu)) is not None:
            out.append(
                f"spec.engine.gpuMemoryUtilization: {HIGHEST_UTILIZATION} ({found.plan.tokens:,} "
                "tokens)"
            )
    if (more := _more_gpus(shape, facts, inputs, gpu)) is not None:
        out.append(more)
    elif not s.weights_fit:
        out.append("a checkpoint quantized to 8 or 4 bits (FP8, AWQ, GPTQ) of the model")
    return out


def _where(gpu: GpuMemory, inputs: FitInputs) -> str:
    """ "the 65.0 GiB vLLM may use (90%) of each of the 4 GPUs (...), NVIDIA-L4 of 22.5 GiB (...)"."""
    par = inputs.parallel
    layout = f"tensor parallel {par.tensor}"
    if par.pipeline > 1:
        layout += f", pipeline parallel {par.pipeline}"
    which = "the GPU" if par.gpus == 1 else f"each of the {par.gpus} GPUs ({layout})"
    usable = int(gpu.bytes * inputs.gpu_memory_utilization)
    return (
        f"the {_gib(usable)} vLLM may use ({inputs.gpu_memory_utilization:.0%}) of {which}, "
        f"{gpu.product or 'a GPU'} of {_gib(gpu.bytes)} ({gpu.source})"
    )


def _refusal(shape, facts, inputs, gpu, s: Sizing) -> Fit:
    advice = _suggestions(shape, facts, inputs, gpu, s)
    change = "; to fit, change one of: " + "; or ".join(advice) if advice else ""
    if not s.weights_fit:
        whole = f" ({_gib(s.weights_total)} in all)" if s.weights_total != s.weights_per_gpu else ""
        message = f"the weights need {_gib(s.weights_per_gpu)} per GPU{whole}, more than {_where(gpu, inputs)}"
        return Fit("False", "WeightsDoNotFit", message + change, _numbers(s, gpu, inputs, facts))
    needed = s.kv_per_token * s.max_len // max(1, inputs.parallel.tensor * inputs.parallel.pipeline)
    message = (
        f"one sequence of maxModelLen {s.max_len:,} tokens needs about {_gib(needed)} of KV cache "
        f"per GPU, but only {_gib(s.kv_memory)} remain of {_where(gpu, inputs)}, after the "
        f"weights ({_gib(s.weights_per_gpu)}) and vLLM's reserve ({_gib(s.reserve)})"
    )
    return Fit("False", "ContextDoesNotFit", message + change, _numbers(s, gpu, inputs, facts))


def assess(facts: ModelFacts, inputs: FitInputs, gpu: GpuMemory) -> Fit:
    """The ModelFits condition for a model, an endpoint's settings and its GPU."""
    try:
        shape = read_config(facts.config)
        if shape.num_heads % inputs.parallel.tensor:
            return Fit(
                "False",
                "InvalidParallelism",
                f"tensor parallel {inputs.parallel.tensor} does not divide the model's "
                f"{shape.num_heads} attention heads (vLLM refuses it): choose one of "
                + ", ".join(str(t) for t in (1, *TP_CANDIDATES) if shape.num_heads % t == 0),
            )
        if inputs.max_model_len and inputs.max_model_len > shape.max_position:
            return Fit(
                "False",
                "ContextDoesNotFit",
                f"maxModelLen {inputs.max_model_len:,} is longer than the model's "
                f"{shape.max_position:,} tokens (vLLM refuses it): set spec.engine.maxModelLen "
                f"to {shape.max_position:,} or less",
            )
        if inputs.draft_model is not None:
            return unknown("SettingUnknown", f"{inputs.draft_model}: the check does not size it")
        central = size(shape, facts.tensors, inputs, gpu)
        hopeful = size(shape, facts.tensors, inputs, gpu, reserve_scale=OPTIMISTIC)
    except UnknownModel as exc:
        return unknown("ModelUnknown", str(exc))
    if central.plan.fits:
        return _fit(central, gpu, inputs, facts)
    if not central.weights_fit or not hopeful.plan.fits:
        return _refusal(shape, facts, inputs, gpu, central)
    return Fit(
        "Unknown",
        "Borderline",
        f"one sequence of maxModelLen {central.max_len:,} fits only if vLLM reserves less than "
        f"the estimated {_gib(central.reserve)} per GPU for activations and CUDA graphs; the "
        "rollout goes on (vLLM measures it at start-up)",
        _numbers(central, gpu, inputs, facts),
    )


def _fit(s: Sizing, gpu: GpuMemory, inputs: FitInputs, facts: ModelFacts) -> Fit:
    message = (
        f"fits: of {_where(gpu, inputs)}, the weights take {_gib(s.weights_per_gpu)} and vLLM's "
        f"reserve about {_gib(s.reserve)}; the remaining {_gib(s.kv_memory)} of KV cache hold "
        f"{s.plan.tokens:,} tokens, {int(s.plan.concurrency):,} sequences of {s.max_len:,} at once"
    )
    return Fit("True", "Fits", message, _numbers(s, gpu, inputs, facts))

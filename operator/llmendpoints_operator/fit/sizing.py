"""vLLM's start-up arithmetic for one configuration: the weights on each GPU, what its memory
profiling reserves, and the KV cache the rest holds. PURE.

`size` raises UnknownModel where the check cannot tell (a KV cache dtype or an online
quantization whose layout it does not know). verdict.py turns sizings into ModelFits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmendpoints_operator.fit import kvcache, overhead, weights
from llmendpoints_operator.fit.architecture import ModelShape, UnknownModel, model_dtype
from llmendpoints_operator.fit.inputs import FitInputs
from llmendpoints_operator.fit.safetensors import FLOAT_DTYPES, Tensor

GiB = 1 << 30
# KV cache dtypes whose layout the check knows: bytes per element (None: the model's dtype).
KV_DTYPES: dict[str, int | None] = {
    "auto": None,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
}
FP8_DS_MLA_BYTES = 656  # FlashMLA's FP8 latent: 512 FP8 values, 4 float32 scales, 64 bf16 RoPE


@dataclass(frozen=True)
class ModelFacts:
    """What the hub (or a local folder) says about the model."""

    config: Mapping[str, Any]
    tensors: tuple[Tensor, ...]
    revision: str | None  # the commit the files were read at
    source: str


@dataclass(frozen=True)
class GpuMemory:
    bytes: int
    product: str | None
    source: str  # where the number comes from, for messages
    per_node: int | None = None  # the most GPUs one eligible node has


@dataclass(frozen=True)
class Sizing:
    weights_total: int
    weights_per_gpu: int
    reserve: int  # per GPU, the largest stage's
    usable: int  # what vLLM may use of one GPU
    kv_memory: int  # per GPU, the smallest stage's
    kv_per_token: int  # whole model
    kv_dtype: str
    max_len: int
    plan: kvcache.KvPlan

    @property
    def weights_fit(self) -> bool:
        return self.weights_per_gpu < self.usable


def _kv_bytes(shape: ModelShape, inputs: FitInputs, dtype_bytes: int) -> tuple[str, int]:
    name = inputs.kv_cache_dtype
    if name == "auto" and shape.fp8_kv_cache_scheme:
        name = "fp8"  # the checkpoint's kv_cache_scheme, honoured for auto (Attention layer)
    if name == "fp8_ds_mla" and shape.mla_dim is not None:
        return name, 0
    if name not in KV_DTYPES:
        raise UnknownModel(f"kv-cache-dtype {name}: the check knows {', '.join(KV_DTYPES)}")
    if name == "auto":
        return model_dtype(shape, inputs.dtype)
    return name, KV_DTYPES[name] or dtype_bytes


def _online_fp8(shape: ModelShape, tensors: Sequence[Tensor], inputs: FitInputs) -> bool:
    method = inputs.quantization
    if method is None or method == shape.quant_method:
        return False
    stored_16bit = all(t.dtype in FLOAT_DTYPES for t in tensors if len(t.shape) == 2)
    if method == "fp8" and shape.quant_method is None and stored_16bit:
        return True
    raise UnknownModel(
        f"quantization {method} of a {shape.quant_method or 'unquantized'} checkpoint: the "
        "check knows the checkpoint's own quantization and fp8 of a 16-bit one"
    )


def _shape_for(shape: ModelShape, inputs: FitInputs, kv_name: str) -> ModelShape:
    if inputs.disable_sliding_window:
        shape = dataclasses.replace(shape, windows=(None,) * shape.num_layers)
    if kv_name == "fp8_ds_mla":  # per token and layer, in bytes (kv_bytes 1)
        shape = dataclasses.replace(shape, mla_dim=FP8_DS_MLA_BYTES)
    return shape


def _batch(inputs: FitInputs, gpu: GpuMemory) -> overhead.Batch:
    seqs, tokens = overhead.batch_defaults(gpu.bytes, gpu.product)
    pp = inputs.parallel.pipeline
    return overhead.Batch(
        max_num_seqs=inputs.max_num_seqs or seqs,
        max_num_batched_tokens=inputs.max_num_batched_tokens or tokens,
        concurrent_batches=(2 if pp == 1 else pp) if inputs.async_scheduling else pp,
    )


def _stage_weights(
    shape: ModelShape, tensors: Sequence[Tensor], inputs: FitInputs, dtype_bytes: int
) -> list[int]:
    """Weights on one GPU of each pipeline stage, less CPU offload, plus LoRA's buffers."""
    par = inputs.parallel
    stage_weights = weights.per_stage(
        tensors, shape, par, dtype_bytes, online_fp8=_online_fp8(shape, tensors, inputs)
    )
    extra = -inputs.cpu_offload_bytes
    if inputs.lora is not None:
        extra += weights.lora_bytes(tensors, par, *inputs.lora, dtype_bytes)
    return [max(0, w + extra) for w in stage_weights]


def size(
    shape: ModelShape,
    tensors: Sequence[Tensor],
    inputs: FitInputs,
    gpu: GpuMemory,
    *,
    reserve_scale: float = 1.0,
) -> Sizing:
    """vLLM's start-up arithmetic for this configuration (UnknownModel where it cannot tell)."""
    par = inputs.parallel
    _, dtype_bytes = model_dtype(shape, inputs.dtype)
    kv_name, kv_bytes = _kv_bytes(shape, inputs, dtype_bytes)
    shape = _shape_for(shape, inputs, kv_name)
    kv_bytes = kv_bytes or 1
    stages = weights.stage_layers(shape.num_layers, par.pipeline)
    stage_weights = _stage_weights(shape, tensors, inputs, dtype_bytes)
    batch = _batch(inputs, gpu)
    reserves = [
        overhead.estimate(
            shape, par, dtype_bytes, batch, eager=inputs.enforce_eager, last_stage=i == len(stages) - 1
        ).total
        for i in range(len(stages))
    ]  # fmt: skip
    usable = math.ceil(gpu.bytes * inputs.gpu_memory_utilization)
    if inputs.kv_cache_memory_bytes:  # vLLM then skips profiling and takes this as the budget
        budgets = [inputs.kv_cache_memory_bytes] * len(stages)
    else:
        budgets = [
            usable - w - int(r * reserve_scale)
            for w, r in zip(stage_weights, reserves, strict=True)
        ]
    max_len = inputs.max_model_len or shape.max_position
    layout = kvcache.layout(
        shape, kv_bytes, par.tensor, inputs.block_size or (64 if shape.mla_dim else 16),
        hybrid=inputs.hybrid_kv_cache,
    )  # fmt: skip
    plan = _plan(layout, stages, budgets, max_len, batch, inputs, shape)
    if max_len == -1:  # --max-model-len auto: vLLM picks the longest that fits
        max_len = max(plan.longest, 1)
        plan = _plan(layout, stages, budgets, max_len, batch, inputs, shape)
    return Sizing(
        weights_total=weights.on_disk(tensors),
        weights_per_gpu=max(stage_weights),
        reserve=max(reserves),
        usable=usable,
        kv_memory=max(0, min(budgets)),
        kv_per_token=kvcache.model_bytes_per_token(shape, kv_bytes),
        kv_dtype=kv_name,
        max_len=max_len,
        plan=plan,
    )


def _plan(layout, stages, budgets, max_len, batch, inputs, shape) -> kvcache.KvPlan:
    length = shape.max_position if max_len == -1 else max_len
    if min(budgets) <= 0:
        return kvcache.KvPlan(blocks=0, tokens=0, concurrency=0.0, fits=False, longest=0)
    return kvcache.plan(
        layout, stages, budgets, length, batch.in_flight_tokens, inputs.num_gpu_blocks_override
    )

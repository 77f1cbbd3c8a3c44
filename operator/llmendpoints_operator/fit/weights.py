"""The bytes of weights one GPU holds, from the checkpoint's tensors. PURE.

vLLM loads every floating-point tensor in the model's dtype (a float32 checkpoint served in
bfloat16 takes half its file size) and every other tensor as stored (packed 4-bit, FP8, integer
scales). Then it shards (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py,
distributed/utils.py):

- tensor parallel splits the linear layers `tensor_parallel` ways, except the K and V projections,
  split only as many ways as there are KV heads (beyond that, ranks hold copies), and norms and
  MoE routers, which every rank holds whole; expert weights are split over tensor parallel x data
  parallel ranks with expert parallelism, over tensor parallel ranks without;
- the embedding and the LM head are padded to a multiple of 64 rows, then split;
- pipeline parallel gives each stage its layers (vLLM's get_pp_indices: the remainder to the
  stages before the last), the embedding to the first and the final norm and LM head to the last
  (a tied LM head is a copy of the embedding there when the stages differ);
- data parallel replicates everything (each replica has its own GPUs).

`per_gpu` is the largest stage's share: vLLM sizes every GPU's KV cache after the fullest one.
`online_fp8` is `--quantization fp8` on a 16-bit checkpoint: the linear layers' weights take one
byte per element (plus one float32 scale per output row, a rounding error here).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmendpoints_operator.fit.architecture import ModelShape
from llmendpoints_operator.fit.safetensors import FLOAT_DTYPES, Tensor

VOCAB_PADDING = 64
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_REPLICATED = re.compile(
    r"norm|\.mlp\.gate\.weight$|e_score_correction_bias|kv_a_proj_with_mqa|\.q_a_proj\."
)
_KV_PROJ = re.compile(r"\.(k_proj|v_proj)\.")
_LINEAR = re.compile(r"_proj\.weight$|\.experts\..*\.weight$|w[123]\.weight$")


@dataclass(frozen=True)
class Parallelism:
    """How one replica spreads the model: tensor x pipeline GPUs per engine, data-parallel
    engines, over `nodes` nodes (LeaderWorkerSet groups)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    nodes: int = 1
    expert: bool = False  # --enable-expert-parallel

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data


def stage_layers(num_layers: int, pipeline: int) -> list[range]:
    """The layers of each pipeline stage (vllm.distributed.utils.get_pp_indices)."""
    sizes = [num_layers // pipeline] * pipeline
    for i in range(2, num_layers % pipeline + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pipeline)]
    return [range(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def _loaded_bytes(tensor: Tensor, dtype_bytes: int, online_fp8: bool) -> int:
    if tensor.dtype not in FLOAT_DTYPES:
        return tensor.nbytes
    if online_fp8 and len(tensor.shape) == 2 and _LINEAR.search(tensor.name):
        return tensor.elements + tensor.shape[0] * 4
    return tensor.elements * dtype_bytes


def _split(tensor: Tensor, shape: ModelShape, par: Parallelism) -> int:
    """How many ways tensor parallelism (and expert parallelism) splits this tensor."""
    if _REPLICATED.search(tensor.name) or len(tensor.shape) < 1:
        return 1
    if ".experts." in tensor.name:
        return par.tensor * par.data if par.expert else par.tensor
    if _KV_PROJ.search(tensor.name) and shape.mla_dim is None:
        return min(par.tensor, shape.num_kv_heads)
    return par.tensor


def _is_vocab(tensor: Tensor, shape: ModelShape) -> bool:
    return (
        bool(tensor.shape)
        and tensor.shape[0] == shape.vocab_size
        and ("embed" in tensor.name or "lm_head" in tensor.name)
    )


def _rank_bytes(tensor: Tensor, shape: ModelShape, par: Parallelism, loaded: int) -> int:
    if _is_vocab(tensor, shape):
        rows = -(-shape.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        per_rank_rows = -(-rows // par.tensor)
        return loaded // shape.vocab_size * per_rank_rows
    return -(-loaded // _split(tensor, shape, par))


def _stage_of(name: str, stages: Sequence[range]) -> set[int]:
    """The pipeline stages holding a tensor (by its layer index; else by what it is)."""
    match = _LAYER.search(name)
    if match:
        layer = int(match.group(1))
        return {i for i, r in enumerate(stages) if layer in r} or {len(stages) - 1}
    if "embed" in name:
        return {0}
    return {len(stages) - 1}  # final norm, LM head


def per_stage(
    tensors: Iterable[Tensor],
    shape: ModelShape,
    par: Parallelism,
    dtype_bytes: int,
    *,
    online_fp8: bool = False,
) -> list[int]:
    """Bytes of weights on one GPU of each pipeline stage."""
    stages = stage_layers(shape.num_layers, par.pipeline)
    totals = [0] * par.pipeline
    tied_head = 0
    for tensor in tensors:
        share = _rank_bytes(tensor, shape, par, _loaded_bytes(tensor, dtype_bytes, online_fp8))
        for stage in _stage_of(tensor.name, stages):
            totals[stage] += share
        if shape.tie_word_embeddings and "embed_tokens" in tensor.name:
            tied_head = share
    if par.pipeline > 1:
        totals[-1] += tied_head  # the last stage's LM head is its own copy of the embedding
    return totals


def on_disk(tensors: Iterable[Tensor]) -> int:
    """The checkpoint's tensor bytes: the sum over the safetensors headers."""
    return sum(t.nbytes for t in tensors)


def lora_bytes(tensors: Iterable[Tensor], par: Parallelism, max_loras: int, rank: int,
               dtype_bytes: int) -> int:  # fmt: skip
    """What vLLM preallocates per GPU for `max_loras` adapters of rank `rank`: an A (rank x in)
    and a B (out x rank) matrix per adapter for every linear layer it wraps."""
    total = 0
    for tensor in tensors:
        if (
            len(tensor.shape) == 2
            and _LINEAR.search(tensor.name)
            and ".experts." not in tensor.name
        ):
            out_features, in_features = tensor.shape
            total += max_loras * rank * (in_features + out_features) * dtype_bytes
    return -(-total // (par.tensor * par.pipeline))

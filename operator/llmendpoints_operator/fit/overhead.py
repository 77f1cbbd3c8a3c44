"""What vLLM 0.32 reserves on a GPU besides the weights and the KV cache. PURE; an ESTIMATE.

vLLM measures these at start-up (vllm/v1/worker/gpu_worker.py, determine_available_memory):

    KV cache = ceil(GPU memory x gpu_memory_utilization)
               - (weights + other persistent tensors + non-torch memory + transient peak)
               - CUDA graph memory (its estimate, on by default since v0.21)

where the transient peak is the largest activation of a dummy forward pass over
max_num_batched_tokens tokens followed by the sampler over max_num_seqs rows of logits
(gpu_model_runner.profile_run), non-torch memory is what NCCL, cuBLAS and the attention backends
allocate outside PyTorch, and the CUDA graph estimate is one graph at the largest capture size plus
at least 1 MiB for each other graph (profile_cudagraph_memory). The CUDA context itself is in use
before vLLM's first snapshot and lives in the (1 - utilization) part.

Without a GPU these are estimated from the shapes, as the largest tensors alive at once:

- forward: the residual and normed hidden states (2 x hidden), plus the larger of attention's
  q, k, v and output projections and the MLP's gate/up and activation (3 x intermediate, the
  routed experts' per token for MoE), for every token of the batch, in the model dtype;
- sampler: float32 logits of every sequence over the whole vocabulary, and the sampler's
  softmax, sort (values and int64 indices) and cumulative sums of them: 24 bytes per logit;
- CUDA graphs: the forward at the largest capture size (min(2 x max_num_seqs, 512)) plus 1 MiB per
  other graph, for piecewise and full graphs (none with --enforce-eager);
- non-torch: 0.5 GiB on one GPU, 1 GiB with tensor or pipeline parallelism (NCCL, custom
  all-reduce buffers);
- other persistent tensors: the rotary embedding's cos/sin cache and 64 MiB of input, block-table
  and sampler buffers.

The verdict treats the total as uncertain (ModelFits is False only when the model would not fit
with half of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmendpoints_operator.fit.architecture import ModelShape
from llmendpoints_operator.fit.weights import Parallelism

GiB = 1 << 30
MiB = 1 << 20
SAMPLER_BYTES_PER_LOGIT = 24
BUFFERS = 64 * MiB
MAX_CAPTURE_SIZE = 512


@dataclass(frozen=True)
class Batch:
    """The scheduler's limits vLLM profiles with."""

    max_num_seqs: int
    max_num_batched_tokens: int
    concurrent_batches: int = 1  # 2 with async scheduling, PP with pipeline parallelism

    @property
    def in_flight_tokens(self) -> int:
        return self.concurrent_batches * self.max_num_batched_tokens


def batch_defaults(gpu_memory: int, product: str | None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM's API server picks for a GPU
    (EngineArgs.get_batch_defaults, usage context OPENAI_API_SERVER)."""
    if gpu_memory >= 160 * GiB:
        return 1024, 16384
    if gpu_memory >= 70 * GiB and "a100" not in (product or "").lower():
        return 1024, 8192
    return 256, 2048


def capture_sizes(max_num_seqs: int, max_tokens: int) -> list[int]:
    """vLLM's default CUDA graph capture sizes (VllmConfig._set_cudagraph_sizes)."""
    largest = min(max_num_seqs * 2, MAX_CAPTURE_SIZE, max_tokens)
    sizes = [i for i in (1, 2, 4) if i <= largest]
    sizes += list(range(8, min(largest + 1, 256), 8))
    sizes += list(range(256, largest + 1, 16))
    return sizes


@dataclass(frozen=True)
class Overhead:
    activation: int
    cuda_graphs: int
    non_torch: int
    buffers: int

    @property
    def total(self) -> int:
        return self.activation + self.cuda_graphs + self.non_torch + self.buffers


def _forward_bytes(shape: ModelShape, par: Parallelism, tokens: int, dtype_bytes: int) -> int:
    tp = par.tensor
    q = shape.num_heads * shape.head_dim // tp
    kv = 2 * max(1, shape.num_kv_heads // tp) * shape.head_dim
    mlp = max(shape.intermediate_size, shape.experts_per_token * shape.moe_intermediate_size)
    per_token = 2 * shape.hidden_size + max(2 * q + kv, 3 * mlp // tp)
    return tokens * per_token * dtype_bytes


def estimate(
    shape: ModelShape,
    par: Parallelism,
    dtype_bytes: int,
    batch: Batch,
    *,
    eager: bool = False,
    last_stage: bool = True,
) -> Overhead:
    forward = _forward_bytes(shape, par, batch.max_num_batched_tokens, dtype_bytes)
    rows = min(batch.max_num_seqs, batch.max_num_batched_tokens)
    sampler = rows * shape.vocab_size * SAMPLER_BYTES_PER_LOGIT if last_stage else 0
    graphs = 0
    if not eager:
        sizes = capture_sizes(batch.max_num_seqs, batch.max_num_batched_tokens)
        graphs = _forward_bytes(shape, par, sizes[-1], dtype_bytes) + 2 * (len(sizes) - 1) * MiB
    rope = shape.max_position * shape.head_dim * dtype_bytes
    return Overhead(
        activation=max(forward, sampler),
        cuda_graphs=graphs,
        non_torch=GiB // 2 if par.tensor * par.pipeline == 1 else GiB,
        buffers=rope + BUFFERS,
    )

"""The KV cache as vLLM 0.32 lays it out: bytes per token, blocks, tokens, sequences. PURE.

Follows vllm/v1/kv_cache_interface.py and vllm/v1/core/kv_cache_utils.py:

- a layer's page (one block of `block_size` tokens) is block_size x KV heads on this GPU x
  (K head size + V head size) x the cache dtype's bytes; KV heads on a GPU are
  max(1, KV heads // tensor parallel) (ranks beyond the KV head count hold copies); an MLA layer
  stores one latent vector of kv_lora_rank + qk_rope_head_dim per token, the same on every rank;
- layers with one spec form one group; a model mixing full and sliding-window attention is split
  into groups of equal layer counts (the smaller bucket's size, or the larger's when it is under
  1.5x), each with its own block table, all drawing from one pool (the hybrid KV cache manager;
  `--disable-hybrid-kv-cache-manager` turns sliding layers into full ones);
- bytes per block = the largest group's layers on that GPU x the page; blocks = the KV memory //
  bytes per block, the same on every GPU (the smallest wins);
- a request of max_model_len tokens takes, per group, cdiv(max_model_len, block_size) blocks of a
  full-attention group and cdiv(min(window - 1 + in-flight tokens, max_model_len), block_size) + 1
  of a sliding one; vLLM refuses to start unless one such request fits in all blocks but the
  null block, and reports `KV cache size: tokens = blocks / blocks per request x max_model_len`,
  `Maximum concurrency: blocks / blocks per request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmendpoints_operator.fit.architecture import ModelShape


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KvLayout:
    """The KV cache groups of a model on one tensor-parallel rank."""

    page_bytes: int  # one layer's block
    block_size: int
    groups: tuple[tuple[int, ...], ...]  # the layers (global indices) of each group
    windows: tuple[int | None, ...]  # each group's sliding window (None: full attention)


def token_bytes_per_layer(shape: ModelShape, kv_bytes: int, tensor: int = 1) -> int:
    if shape.mla_dim is not None:
        return shape.mla_dim * kv_bytes
    return max(1, shape.num_kv_heads // tensor) * shape.head_dim * 2 * kv_bytes


def model_bytes_per_token(shape: ModelShape, kv_bytes: int) -> int:
    """KV cache bytes per token of the whole model (every layer, every KV head)."""
    if shape.mla_dim is not None:
        return shape.num_layers * shape.mla_dim * kv_bytes
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_bytes


def _group_size(buckets: Sequence[Sequence[int]]) -> int:
    """vLLM's _get_kv_cache_groups_uniform_page_size: groups as large as the smallest bucket,
    or the largest when it is under 1.5x the smallest (less padding)."""
    smallest, largest = min(map(len, buckets)), max(map(len, buckets))
    return largest if largest < smallest * 1.5 else smallest


def layout(
    shape: ModelShape, kv_bytes: int, tensor: int, block_size: int, *, hybrid: bool = True
) -> KvLayout:
    windows = shape.windows if hybrid else (None,) * shape.num_layers
    page = block_size * token_bytes_per_layer(shape, kv_bytes, tensor)
    buckets: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        buckets.setdefault(window, []).append(layer)
    size = _group_size(list(buckets.values()))
    groups: list[tuple[int, ...]] = []
    group_windows: list[int | None] = []
    for window, layers in buckets.items():
        count = cdiv(len(layers), size)
        for i in range(count):  # layers[i::count]: each pipeline stage gets a share of each
            groups.append(tuple(layers[i::count]))
            group_windows.append(window)
    return KvLayout(page, block_size, tuple(groups), tuple(group_windows))


def bytes_per_block(kv: KvLayout, stage: range) -> int:
    """One block across the layers of the fullest group on a GPU holding `stage`'s layers."""
    return kv.page_bytes * max(sum(1 for layer in g if layer in stage) for g in kv.groups)


def blocks_per_request(kv: KvLayout, max_len: int, in_flight: int) -> int:
    total = 0
    for window in kv.windows:
        if window is None:
            total += cdiv(max_len, kv.block_size)
        else:
            total += cdiv(min(window - 1 + in_flight, max_len), kv.block_size) + 1
    return total


@dataclass(frozen=True)
class KvPlan:
    blocks: int  # on every GPU
    tokens: int  # vLLM's "KV cache size: N tokens"
    concurrency: float  # sequences of max_len at once
    fits: bool  # one sequence of max_len fits (vLLM starts)
    longest: int  # the longest max_len that would fit (0: not even one token)


def plan(
    kv: KvLayout,
    stages: Sequence[range],
    budgets: Sequence[int],
    max_len: int,
    in_flight: int,
    blocks_override: int | None = None,
) -> KvPlan:
    """The KV cache vLLM allocates when the GPUs of each pipeline stage have `budgets` bytes."""
    per_block = [bytes_per_block(kv, stage) for stage in stages]
    if blocks_override is not None:
        budgets = [blocks_override * b for b in per_block]

    def fits(length: int) -> bool:
        # checked per GPU: all blocks but the null block hold one request of `length` tokens
        return all(
            budget - block >= block * blocks_per_request(kv, length, in_flight)
            for budget, block in zip(budgets, per_block, strict=True)
        )

    blocks = max(0, min(budget // block for budget, block in zip(budgets, per_block, strict=True)))
    need = blocks_per_request(kv, max_len, in_flight)
    return KvPlan(
        blocks=blocks,
        tokens=int(blocks / need * max_len),
        concurrency=blocks / need,
        fits=fits(max_len),
        longest=_longest(fits, max_len),
    )


def _longest(fits, upper: int) -> int:
    """vLLM's estimate_max_model_len: a binary search over [1, upper]."""
    if not fits(1):
        return 0
    low, high, best = 1, upper, 1
    while low <= high:
        mid = (low + high) // 2
        if fits(mid):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best

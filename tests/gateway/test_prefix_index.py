"""Pure: rendering prompts, chained block hashes, the per-replica LRU index and its bounds."""

from __future__ import annotations

import random

import pytest
from llmendpoints_gateway.prefix_index import (
    DEFAULT_REPLICA_BLOCKS,
    MAX_BLOCKS_PER_REQUEST,
    MAX_REPLICA_BLOCKS,
    Capacity,
    PrefixIndex,
    block_hashes,
    render_prompt,
)

CHUNK = 16


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(n))


def chat(*turns: tuple[str, str]) -> dict:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in turns]}


# --- rendering --------------------------------------------------------------------------------


def test_chat_renders_every_message_in_order_with_its_role() -> None:
    text = render_prompt("/v1/chat/completions", chat(("system", "S"), ("user", "Q")))
    assert text.index("system") < text.index("S") < text.index("user") < text.index("Q")
    # The role is part of the text: the same words from another role are another prompt.
    assert text != render_prompt("/v1/chat/completions", chat(("user", "S"), ("user", "Q")))
    # Message boundaries count: ["ab", "c"] is not ["a", "bc"].
    assert render_prompt("/v1/chat/completions", chat(("user", "ab"), ("user", "c"))) != (
        render_prompt("/v1/chat/completions", chat(("user", "a"), ("user", "bc")))
    )


def test_a_growing_conversation_renders_as_an_extension_of_its_last_turn() -> None:
    first = chat(("system", "S" * 40), ("user", "Q1"))
    second = chat(("system", "S" * 40), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"))
    path = "/v1/chat/completions"
    assert render_prompt(path, second).startswith(render_prompt(path, first))


def test_content_parts_images_and_completions() -> None:
    parts = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                ],
            }
        ],
    }
    text = render_prompt("/v1/chat/completions", parts)
    assert "What is this?" in text and "image_url:https://x/cat.png" in text
    assert render_prompt("/v1/completions", {"prompt": "Once upon"}) == "Once upon"
    assert render_prompt("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert render_prompt("/v1/completions", {"prompt": [1, 2, 3]}) == "1,2,3"
    assert render_prompt("/v1/completions", {"prompt": [[4, 5], [6]]}) == "4,5"
    assert render_prompt("/v1/embeddings", {"input": "x"}) is None
    assert render_prompt("/v1/chat/completions", {"messages": []}) is None
    responses = {"instructions": "Be brief.", "input": "Hi"}
    assert render_prompt("/v1/responses", responses).startswith("Be brief.")


# --- block hashes -----------------------------------------------------------------------------


def test_hashes_chain_so_equal_hashes_mean_equal_prefixes() -> None:
    base = "x" * CHUNK * 3
    a = block_hashes("m", base + "A" * CHUNK, CHUNK)
    b = block_hashes("m", base + "B" * CHUNK, CHUNK)
    assert a[:3] == b[:3] and a[3] != b[3]
    # Same chunk text after a different start: a different hash (it is a different prefix).
    c = block_hashes("m", "y" * CHUNK + "x" * CHUNK * 2, CHUNK)
    assert c[1:] != a[1:3]
    # Another model (or adapter) shares nothing: its KV cache is another one.
    assert not set(block_hashes("adapter-a", base, CHUNK)) & set(a)


def test_only_whole_chunks_count_and_a_request_hashes_a_bounded_prefix() -> None:
    assert block_hashes("m", "x" * (CHUNK - 1), CHUNK) == []
    assert len(block_hashes("m", "x" * (CHUNK * 2 + 5), CHUNK)) == 2
    huge = "x" * (MAX_BLOCKS_PER_REQUEST + 10) * CHUNK
    assert len(block_hashes("m", huge, CHUNK)) == MAX_BLOCKS_PER_REQUEST


# --- the index --------------------------------------------------------------------------------


def test_longest_match_is_the_leading_run_each_replica_holds() -> None:
    index = PrefixIndex(chunk_chars=CHUNK)
    shared = words(40, 1)
    request = block_hashes("m", shared + words(20, 2), CHUNK)
    other = block_hashes("m", shared + words(20, 3), CHUNK)
    index.record("a", request)
    index.record("b", block_hashes("m", words(60, 4), CHUNK))
    common = sum(1 for x, y in zip(request, other, strict=False) if x == y)
    assert 0 < common < len(other)
    assert index.longest_match(other) == {"a": common, "b": 0}
    assert index.longest_match(request) == {"a": len(request), "b": 0}
    assert index.longest_match([]) == {"a": 0, "b": 0}


def test_the_lru_is_bounded_by_what_the_engine_can_hold() -> None:
    index = PrefixIndex(chunk_chars=CHUNK, chars_per_token=2.0)
    # 64 tokens of KV cache = 128 characters = 8 blocks of 16 characters.
    index.set_kv_tokens("a", 64)
    assert index.capacity("a") == 8
    first = block_hashes("m", words(40, 1), CHUNK)
    assert len(first) > 8
    index.record("a", first)
    assert index.size("a") == 8
    # Prompts are evicted tail first, as engines do: the head stays matchable.
    assert index.longest_match(first)["a"] == 8
    second = block_hashes("m", words(40, 2), CHUNK)
    index.record("a", second)
    assert index.size("a") == 8
    assert index.longest_match(first)["a"] == 0  # the older prompt is gone
    assert index.longest_match(second)["a"] == 8


def test_touching_a_prefix_again_keeps_it_over_newer_ones() -> None:
    index = PrefixIndex(chunk_chars=CHUNK, chars_per_token=1.0)
    index.set_kv_tokens("a", 6 * CHUNK)  # six blocks
    hot = block_hashes("m", "h" * CHUNK * 3, CHUNK)
    index.record("a", hot)
    for i in range(5):
        index.record("a", block_hashes("m", f"{i}" * CHUNK * 1, CHUNK))
        index.record("a", hot)  # the shared system prompt, asked for again and again
    assert index.longest_match(hot)["a"] == 3


def test_capacity_defaults_and_is_capped() -> None:
    assert Capacity(None, 4.0, 256).blocks == DEFAULT_REPLICA_BLOCKS
    assert Capacity(10**12, 4.0, 256).blocks == MAX_REPLICA_BLOCKS
    assert Capacity(100_000, 4.0, 256).blocks == 1562


def test_the_learned_characters_per_token_resize_every_replica() -> None:
    index = PrefixIndex(chunk_chars=CHUNK, chars_per_token=4.0)
    index.set_kv_tokens("a", 64)
    index.record("a", block_hashes("m", words(60, 1), CHUNK))
    assert index.size("a") == 16
    for _ in range(200):  # answers keep saying 1 character per token: the cache holds less text
        index.observe_chars_per_token(1000, 1000)
    assert index.chars_per_token == pytest.approx(1.0, abs=0.01)
    assert index.size("a") == index.capacity("a") == 4
    index.observe_chars_per_token(0, 10)  # nonsense is ignored
    assert index.chars_per_token == pytest.approx(1.0, abs=0.01)


def test_departed_replicas_are_forgotten_with_their_blocks() -> None:
    index = PrefixIndex(chunk_chars=CHUNK)
    blocks = block_hashes("m", words(30, 1), CHUNK)
    index.record("a", blocks)
    index.record("b", blocks)
    index.set_kv_tokens("c", 1000)
    index.retain(["b"])
    assert index.replicas() == ["b"]
    assert index.longest_match(blocks) == {"b": len(blocks)}
    index.remove("b")
    assert index.longest_match(blocks) == {}
    assert index._owners == {}  # no block left behind in the reverse map

"""Pure routing pieces: the consistent-hash ring, the load bound, the prefix key, the strategies
that look at no prompt (prefix-aware scoring: test_scoring.py)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from llmendpoints_gateway.routing import (
    HashRing,
    Outcome,
    Router,
    Strategy,
    hash64,
    load_bound,
    prefix_key,
)

KEYS = [hash64(f"conversation-{i}".encode()) for i in range(20_000)]


def owners(replicas: list[str]) -> list[str]:
    ring = HashRing(replicas)
    return [ring.owner(k) for k in KEYS]


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_a_joining_replica_takes_about_one_nth_of_the_keys_and_only_onto_itself(n):
    before = owners([f"http://r{i}" for i in range(n)])
    after = owners([f"http://r{i}" for i in range(n + 1)])
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert all(b == f"http://r{n}" for _, b in moved)  # nothing shuffles between old replicas
    assert abs(len(moved) / len(KEYS) - 1 / (n + 1)) < 0.35 / (n + 1)


@pytest.mark.parametrize("n", [3, 5, 8])
def test_a_leaving_replica_moves_only_its_own_keys(n):
    before = owners([f"http://r{i}" for i in range(n)])
    after = owners([f"http://r{i}" for i in range(n - 1)])
    moved = [a for a, b in zip(before, after, strict=True) if a != b]
    assert set(moved) == {f"http://r{n - 1}"}
    assert abs(len(moved) / len(KEYS) - 1 / n) < 0.35 / n


def test_keys_spread_evenly():
    counts = Counter(owners([f"http://r{i}" for i in range(4)]))
    assert all(abs(c / len(KEYS) - 0.25) < 0.06 for c in counts.values())


def test_load_bound():
    assert load_bound(0, 2, 1.25) == 1
    assert load_bound(9, 2, 1.25) == math.ceil(1.25 * 10 / 2)


def test_prefix_key_follows_the_shared_prefix_not_the_json():
    system = {"role": "system", "content": "You are a pirate."}
    first = {"role": "user", "content": "hi"}
    turn1 = {"model": "m", "messages": [system, first]}
    turn3 = {
        "model": "m",
        "temperature": 0.2,
        "messages": [
            system,
            first,
            {"role": "assistant", "content": "arr"},
            {"role": "user", "content": "more"},
        ],
    }
    reordered = {"messages": [system, first], "model": "m", "stream": True}
    path = "/v1/chat/completions"
    assert prefix_key(path, turn1) == prefix_key(path, turn3) == prefix_key(path, reordered)
    other_user = {"model": "m", "messages": [system, {"role": "user", "content": "hello"}]}
    assert prefix_key(path, other_user) != prefix_key(path, turn1)
    # Adapters do not share KV cache: the model name is part of the key.
    assert prefix_key(path, {**turn1, "model": "m-lora"}) != prefix_key(path, turn1)
    # Completions: the start of the prompt.
    long = "instructions " * 1000
    assert prefix_key("/v1/completions", {"model": "m", "prompt": long + "a"}) == prefix_key(
        "/v1/completions", {"model": "m", "prompt": long + "b"}
    )
    assert prefix_key("/v1/embeddings", {"model": "m"}) is None


def test_strategies():
    loads = {"a": 3, "b": 1, "c": 2}
    router = Router(Strategy.LEAST_LOADED)
    router.set_replicas(["a", "b", "c"])
    assert router.choose(loads) == ("b", Outcome.LEAST_LOADED)
    assert router.choose(loads, exclude=frozenset({"b"})) == ("c", Outcome.LEAST_LOADED)
    router.strategy = Strategy.ROUND_ROBIN
    assert [router.choose(loads)[0] for _ in range(6)] == ["b", "c", "a", "b", "c", "a"]
    router.strategy = Strategy.PREFIX_AWARE
    assert router.choose(loads) == ("b", Outcome.LEAST_LOADED)  # scored by the registry
    assert Router().choose({}) is None  # no replicas yet

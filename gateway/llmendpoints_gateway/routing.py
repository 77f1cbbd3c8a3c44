"""PURE: which replica gets a request.

Three strategies per endpoint (``spec.routing``):

- ``prefix-aware`` (default): consistent hashing with bounded loads (Mirrokni, Thorup and
  Zadimoghaddam, 2016). Each replica owns many points on a hash ring; a request's prefix key
  hashes to a point and walks clockwise to the first replica whose in-flight count is below
  ``ceil(load_factor * (total + 1) / replicas)``. Requests that share a prefix land on the same
  replica (its vLLM prefix cache stays warm) until that replica carries more than its share,
  then they spill to the next replica on the ring -- the same one for every such request, so
  the spill is cache-friendly too. Adding or removing a replica moves only the keys on its own
  points: about 1/N of them.
- ``least-loaded``: the replica with the fewest in-flight requests from this gateway.
- ``round-robin``: in turn.

Loads are this gateway replica's own in-flight counts: no coordination between gateway
replicas is needed and every count is exact for the traffic it sees.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class Strategy(enum.StrEnum):
    PREFIX_AWARE = "prefix-aware"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


class Outcome(enum.StrEnum):
    """How a replica was chosen (a metric label; prefix-aware's are scoring.Reason's)."""

    AFFINITY = "affinity"  # where its longest cached prefix is (or, cached nowhere, its home)
    SPILLED = "spilled"  # that replica was at its load bound; the next best took it
    LOAD = "load"  # the replica that starts it soonest, no cached prefix deciding
    ADAPTER = "adapter"  # its LoRA adapter being active there decided it
    LEAST_LOADED = "least_loaded"  # the least-loaded strategy
    ROUND_ROBIN = "round_robin"
    RETRY = "retry"  # the first choice failed before answering


VIRTUAL_NODES = 160
DEFAULT_LOAD_FACTOR = 1.25


def hash64(data: bytes) -> int:
    # blake2b is in the standard library, fast, and spreads well; 8 bytes are plenty for a ring.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Replicas' points on a 64-bit ring; immutable, rebuilt when the replica set changes."""

    def __init__(self, replicas: Sequence[str], virtual_nodes: int = VIRTUAL_NODES):
        points = sorted(
            (hash64(f"{replica}#{i}".encode()), replica)
            for replica in set(replicas)
            for i in range(virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]
        self.replicas = frozenset(replicas)

    def walk(self, key_hash: int) -> list[str]:
        """Distinct replicas in ring order starting at the key's point."""
        if not self._hashes:
            return []
        start = bisect.bisect_left(self._hashes, key_hash)
        seen: list[str] = []
        n = len(self._hashes)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.replicas):
                    break
        return seen

    def owner(self, key_hash: int) -> str | None:
        walk = self.walk(key_hash)
        return walk[0] if walk else None


def load_bound(total_in_flight: int, replicas: int, load_factor: float) -> int:
    """The most a replica may carry when one more request arrives (at least 1)."""
    return max(1, math.ceil(load_factor * (total_in_flight + 1) / max(1, replicas)))


def choose_bounded(
    ring: HashRing,
    key_hash: int,
    loads: Mapping[str, int],
    load_factor: float = DEFAULT_LOAD_FACTOR,
    exclude: frozenset[str] = frozenset(),
) -> tuple[str, Outcome] | None:
    candidates = [r for r in ring.walk(key_hash) if r not in exclude]
    if not candidates:
        return None
    bound = load_bound(sum(loads.get(r, 0) for r in candidates), len(candidates), load_factor)
    for i, replica in enumerate(candidates):
        if loads.get(replica, 0) < bound:
            return replica, (Outcome.AFFINITY if i == 0 else Outcome.SPILLED)
    # Unreachable in theory (the bound leaves room somewhere); stay total anyway.
    return least_loaded(candidates, loads), Outcome.SPILLED


def least_loaded(replicas: Sequence[str], loads: Mapping[str, int]) -> str:
    return min(replicas, key=lambda r: (loads.get(r, 0), r))


def prefix_key(path: str, body: Mapping[str, Any], max_chars: int = 4096) -> bytes | None:
    """What decides which KV-cache blocks a request can reuse, as bytes to hash.

    The model (or LoRA adapter) name first: adapters do not share cache with each other. Then
    the start of the prompt, where requests that share cache agree: for chat, the system
    messages and the first user turn (a conversation keeps them while it grows, so every turn
    lands where its history is cached); for completions, the prompt's first ``max_chars``
    characters. Not the raw JSON: key order and sampling parameters must not matter.
    None when there is nothing to be sticky about (the caller then balances by load).
    """
    model = body.get("model")
    parts: list[str] = [model if isinstance(model, str) else ""]
    messages = body.get("messages")
    prompt = body.get("prompt")
    if isinstance(messages, list) and messages:
        for message in messages:
            if not isinstance(message, Mapping):
                break
            parts.append(f"{message.get('role')}\x1f{_content_text(message.get('content'))}")
            if message.get("role") not in ("system", "developer"):
                break  # the first non-system turn closes the shared prefix
    elif isinstance(body.get("input"), (str, list)) and path.endswith("/responses"):
        parts.append(str(body.get("instructions") or ""))
        parts.append(_content_text(body["input"]))
    elif isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list) and prompt:
        parts.append(str(prompt[0]) if not isinstance(prompt[0], int) else str(prompt))
    else:
        return None
    text = "\x1e".join(parts)[: max_chars + len(parts[0]) + 1]
    return text.encode("utf-8", "surrogatepass")


def home_key(path: str, body: Mapping[str, Any]) -> bytes | None:
    """Where a prefix-aware request lives on the hash ring when nothing decides otherwise
    (scoring's ``home``): the model and the leading system/developer messages of a chat that
    opens with them -- every conversation sharing an instruction shares a home, and keeps it as
    it grows -- else ``prefix_key``."""
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and _instruction(messages[0])):
        return prefix_key(path, body)
    model = body.get("model")
    parts = [model if isinstance(model, str) else ""]
    for message in messages:
        if not _instruction(message):
            break
        parts.append(f"{message.get('role')}\x1f{_content_text(message.get('content'))}")
    return "\x1e".join(parts).encode("utf-8", "surrogatepass")


def _instruction(message: Any) -> bool:
    return isinstance(message, Mapping) and message.get("role") in ("system", "developer")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Multi-part content: the text parts, and parts of other kinds by their type.
        return "\x1d".join(
            str(part.get("text", part.get("type", ""))) if isinstance(part, Mapping) else str(part)
            for part in content
        )
    return "" if content is None else str(content)


@dataclass
class Router:
    """One endpoint's routing state: its strategy, ready replicas and their ring."""

    strategy: Strategy = Strategy.PREFIX_AWARE
    load_factor: float = DEFAULT_LOAD_FACTOR
    ring: HashRing | None = None
    _turn: int = 0

    def set_replicas(self, replicas: Sequence[str]) -> None:
        if self.ring is None or self.ring.replicas != frozenset(replicas):
            self.ring = HashRing(replicas)

    def choose(
        self,
        key: bytes | None,
        loads: Mapping[str, int],
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[str, Outcome] | None:
        if self.ring is None:
            return None
        replicas = sorted(r for r in self.ring.replicas if r not in exclude)
        if not replicas:
            return None
        if self.strategy is Strategy.ROUND_ROBIN:
            self._turn += 1
            return replicas[self._turn % len(replicas)], Outcome.ROUND_ROBIN
        if self.strategy is Strategy.PREFIX_AWARE and key is not None:
            return choose_bounded(self.ring, hash64(key), loads, self.load_factor, exclude)
        return least_loaded(replicas, loads), Outcome.LEAST_LOADED

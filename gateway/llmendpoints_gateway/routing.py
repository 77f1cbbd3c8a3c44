"""PURE: the building blocks of routing -- the hash ring, the load bound, the keys a request is
placed by -- and the two strategies that look at no prompt.

Three strategies per endpoint (``spec.routing``):

- ``prefix-aware`` (default): scored by scoring.py over the registry's prefix index (the longest
  prompt prefix each replica was sent, its engine's queue and KV cache, adapters). Two pieces of
  it live here. ``load_bound``: bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2016) -- no
  replica takes a request while it carries ``ceil(load_factor * (total + 1) / replicas)`` of this
  gateway's in-flight requests, so a hot prefix spills instead of piling up. And a request's
  home: ``home_key`` hashed onto a consistent-hash ring (``HashRing``: each replica owns many
  points; adding or removing one moves only about 1/N of the keys), whose clockwise order is
  where a prompt no replica holds a block of goes -- so conversations that share an instruction
  meet where it will be cached, in every gateway process alike.
- ``least-loaded``: the replica with the fewest in-flight requests from this gateway.
- ``round-robin``: in turn.

Loads here are this gateway process's own in-flight counts: exact for the traffic it sees, with
no coordination between processes.
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
    ring: HashRing | None = None
    _turn: int = 0

    def set_replicas(self, replicas: Sequence[str]) -> None:
        if self.ring is None or self.ring.replicas != frozenset(replicas):
            self.ring = HashRing(replicas)

    def choose(
        self, loads: Mapping[str, int], exclude: frozenset[str] = frozenset()
    ) -> tuple[str, Outcome] | None:
        """Round-robin or least-loaded (prefix-aware endpoints are scored by the registry, and
        balance by load here only when they have nothing else to go by)."""
        if self.ring is None:
            return None
        replicas = sorted(r for r in self.ring.replicas if r not in exclude)
        if not replicas:
            return None
        if self.strategy is Strategy.ROUND_ROBIN:
            self._turn += 1
            return replicas[self._turn % len(replicas)], Outcome.ROUND_ROBIN
        return least_loaded(replicas, loads), Outcome.LEAST_LOADED

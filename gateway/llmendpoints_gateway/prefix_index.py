"""PURE: which prompt blocks each replica of an endpoint has been sent, and so probably holds in
its KV cache.

A request's prompt is rendered to text in the order the engine sees it (chat: every message in
order, role then content parts; completions: the prompt) and cut into fixed-size chunks of
characters. Each chunk's hash chains the previous one (``h[i] = H(h[i-1], chunk[i])``, seeded
with the model name, because an adapter's KV cache is not the base model's), so equal hashes
mean equal prefixes -- the same scheme vLLM uses for its own KV blocks, over characters instead
of tokens, so the gateway needs no tokenizer.

`PrefixIndex` keeps, per replica, the block hashes it was sent, in an LRU bounded by what that
replica's engine can hold (its KV capacity in tokens, converted to characters with the observed
characters per token, divided by the chunk size). `longest_match` tells, for a request's blocks,
how many leading blocks each replica has. After a request is routed, `record` marks its blocks
as the replica's most recently used, the prefix most recent of all: engines evict the tail of a
prompt before its head, and so does the index.

Only whole chunks count (vLLM caches only whole blocks, and a trailing partial chunk is never a
prefix of the next turn). Indexes of several gateway replicas are independent: each knows what
it sent itself.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHUNK_CHARS = 256  # characters per block: ~64 tokens of English, a few vLLM blocks
MAX_BLOCKS_PER_REQUEST = 1024  # 256 KiB of prompt text: the hashing cost per request is bounded
DEFAULT_REPLICA_BLOCKS = 4096  # 1 MiB of prompt text per replica when its capacity is unknown
MAX_REPLICA_BLOCKS = 1 << 16  # whatever an engine reports: at most 16 MiB of text per replica
DEFAULT_CHARS_PER_TOKEN = 4.0  # English with a modern BPE tokenizer; learned from usage when known
_SEP = "\x1e"  # between messages: "a" + "bc" and "ab" + "c" must not render alike


def render_prompt(path: str, body: Mapping[str, Any]) -> str | None:
    """The prompt text of an OpenAI request, in the engine's order; None when there is none.

    Chat: every message, role and content (text parts verbatim, other parts by type and URL, so
    the same image twice renders alike), name and tool calls. Completions: the prompt (a string,
    the first of a list of strings, or token ids). Responses: instructions, then input."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return _SEP.join(_message(m) for m in messages) if messages else None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first  # a batch of prompts is routed by its first (all go to one replica)
        if isinstance(first, int):
            return ",".join(str(t) for t in prompt)  # token ids
        if isinstance(first, list):
            return ",".join(str(t) for t in first)
        return None
    if path.endswith("/responses") and isinstance(body.get("input"), str | list):
        return _SEP.join((str(body.get("instructions") or ""), _content(body["input"])))
    return None


def _message(message: Any) -> str:
    if not isinstance(message, Mapping):
        return str(message)
    parts = [str(message.get("role", "")), _content(message.get("content"))]
    if message.get("name"):
        parts.append(str(message["name"]))
    if message.get("tool_calls"):
        parts.append(str(message["tool_calls"]))
    return "\x1f".join(parts)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\x1d".join(_part(part) for part in content)
    return "" if content is None else str(content)


def _part(part: Any) -> str:
    if not isinstance(part, Mapping):
        return str(part)
    if "text" in part:
        return str(part["text"])
    kind = str(part.get("type", ""))
    media = part.get(kind) if isinstance(part.get(kind), Mapping) else {}
    return f"{kind}:{media.get('url', '')}"  # an image by its URL (data URLs included)


def block_hashes(
    model: str,
    text: str,
    chunk_chars: int = CHUNK_CHARS,
    max_blocks: int = MAX_BLOCKS_PER_REQUEST,
) -> list[int]:
    """Chained 64-bit hashes of the text's whole chunks (at most `max_blocks`)."""
    previous = hashlib.blake2b(model.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    hashes: list[int] = []
    whole = min(len(text) // chunk_chars, max_blocks)
    for i in range(whole):
        chunk = text[i * chunk_chars : (i + 1) * chunk_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + chunk, digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "big"))
    return hashes


@dataclass(frozen=True)
class Capacity:
    """How many blocks of a replica's prompts its engine can hold."""

    kv_tokens: int | None  # the engine's KV cache in tokens (num_gpu_blocks x block_size)
    chars_per_token: float
    chunk_chars: int

    @property
    def blocks(self) -> int:
        if not self.kv_tokens:
            return DEFAULT_REPLICA_BLOCKS
        blocks = int(self.kv_tokens * self.chars_per_token // self.chunk_chars)
        return max(1, min(blocks, MAX_REPLICA_BLOCKS))


class PrefixIndex:
    """One endpoint's index: replica -> LRU of the block hashes it was sent.

    Memory: at most `capacity` entries per replica (each an int in an OrderedDict and in the
    reverse map), so a few hundred bytes per block, ~1-2 MB per replica at the default."""

    def __init__(
        self,
        chunk_chars: int = CHUNK_CHARS,
        chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
    ) -> None:
        self.chunk_chars = chunk_chars
        self.chars_per_token = chars_per_token
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._kv_tokens: dict[str, int | None] = {}
        self._owners: dict[int, set[str]] = {}  # block -> replicas holding it

    # -- reads --

    def replicas(self) -> list[str]:
        return sorted(self._blocks)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def capacity(self, replica: str) -> int:
        return Capacity(self._kv_tokens.get(replica), self.chars_per_token, self.chunk_chars).blocks

    def longest_match(self, blocks: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `blocks` each indexed replica holds (0 for those holding none).

        One pass over the request's blocks, narrowing the set of replicas still matching:
        the cost is the longest match, not the number of replicas times the prompt."""
        matched = dict.fromkeys(self._blocks, 0)
        alive = set(self._blocks)
        for i, block in enumerate(blocks):
            alive &= self._owners.get(block, set())
            if not alive:
                break
            for replica in alive:
                matched[replica] = i + 1
        return matched

    # -- writes --

    def record(self, replica: str, blocks: Sequence[int]) -> None:
        """`replica` was sent these blocks: now its most recently used, the first block most of
        all (touched last), so the LRU evicts prompts tail first, as engines do."""
        held = self._blocks.get(replica)
        if held is None:
            held = self._blocks[replica] = OrderedDict()
            self._kv_tokens.setdefault(replica, None)
        for block in reversed(blocks):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
                self._owners.setdefault(block, set()).add(replica)
        self._evict(replica)

    def set_kv_tokens(self, replica: str, kv_tokens: int | None) -> None:
        """What the replica's engine can hold (from its metrics); shrinks its LRU if needed."""
        self._kv_tokens[replica] = kv_tokens
        if replica in self._blocks:
            self._evict(replica)

    def observe_chars_per_token(self, chars: int, tokens: int, weight: float = 0.05) -> None:
        """Learn the endpoint's characters per token from a request's prompt length and the
        prompt_tokens its answer reported (a moving average; capacities follow)."""
        if chars <= 0 or tokens <= 0:
            return
        ratio = chars / tokens
        self.chars_per_token += weight * (ratio - self.chars_per_token)
        for replica in list(self._blocks):
            self._evict(replica)

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget replicas that are gone (their caches went with them)."""
        keep = set(replicas)
        for replica in [r for r in self._blocks if r not in keep]:
            self.remove(replica)
        for replica in [r for r in self._kv_tokens if r not in keep]:
            del self._kv_tokens[replica]

    def remove(self, replica: str) -> None:
        for block in self._blocks.pop(replica, {}):
            self._disown(block, replica)
        self._kv_tokens.pop(replica, None)

    def _evict(self, replica: str) -> None:
        held = self._blocks[replica]
        limit = self.capacity(replica)
        while len(held) > limit:
            block, _ = held.popitem(last=False)
            self._disown(block, replica)

    def _disown(self, block: int, replica: str) -> None:
        owners = self._owners.get(block)
        if owners is not None:
            owners.discard(replica)
            if not owners:
                del self._owners[block]


# -- routing records between gateway processes (route_sharing.py) ------------------------------

_HEAD = struct.Struct(">HHH")  # endpoint id length, replica length, blocks
MAX_RECORD_BLOCKS = 0xFFFF


def encode_records(records: Iterable[tuple[str, str, Sequence[int]]]) -> bytes:
    """(endpoint id, replica, blocks) records as bytes: per record the three lengths, the two
    names (UTF-8) and the blocks (unsigned 64-bit, big-endian)."""
    parts: list[bytes] = []
    for endpoint, replica, blocks in records:
        name, url = endpoint.encode(), replica.encode()
        count = min(len(blocks), MAX_RECORD_BLOCKS)
        parts.append(_HEAD.pack(len(name), len(url), count) + name + url)
        parts.append(struct.pack(f">{count}Q", *blocks[:count]))
    return b"".join(parts)


def decode_records(data: bytes) -> list[tuple[str, str, list[int]]]:
    """Inverse of ``encode_records``; ValueError for bytes that are not records."""
    records = []
    at = 0
    try:
        while at < len(data):
            name_len, url_len, count = _HEAD.unpack_from(data, at)
            at += _HEAD.size
            endpoint = data[at : at + name_len].decode()
            replica = data[at + name_len : at + name_len + url_len].decode()
            at += name_len + url_len
            if at > len(data):
                raise ValueError("a record's names run past its end")
            blocks = list(struct.unpack_from(f">{count}Q", data, at))
            at += 8 * count
            records.append((endpoint, replica, blocks))
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"not routing records: {exc}") from exc
    return records

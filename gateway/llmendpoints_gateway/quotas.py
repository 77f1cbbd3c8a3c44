"""PURE: per-key limits, the limiter's state, its decisions and the headers that report them.

A key name (the tenant) has one state, shared by every gateway replica (limiter.py keeps it in
the ``LLMEP_QUOTAS`` bucket and changes it by compare-and-set):

- ``window``: the current minute (``floor(epoch seconds / 60)``), and in it ``requests`` (the
  requests admitted) and ``tokens`` (prompt + completion tokens of requests that ended);
- ``leases``: requests in flight, ``{lease id: expiry}``; a lease is renewed while its request
  runs, so a gateway replica that dies stops holding its leases once they expire.

Fixed minute windows, aligned to the clock's minute: the counts, the ``remaining`` and ``reset``
headers are exact (no estimate), and a burst that straddles a minute boundary may use two
minutes' allowances back to back -- the trade-off OpenAI's headers also make visible.
Tokens are known only when a request ends, so a request reserves what it may use when it is
admitted (``n`` x ``max_tokens`` and an estimate of its prompt, at most the whole limit) and is
admitted only if the reservation fits in what is left of the minute; when it ends, the
reservation is settled against what the engine reported (the difference charged, or given back
while the window lasts). Requests in flight can therefore never take the window past its limit
by more than their estimates of their prompts were short.

A replica may hold an ``Allowance`` of a key's minute (requests and tokens counted in the shared
state when it took them, not used yet) and admit and settle requests from it with no round trip
(``admit_shared`` takes it, ``admit_locally`` uses it, ``settle_locally`` settles in it). It is
never more than a 1/RESERVE_SHARE share of what was left, none near the limit; what a replica
holds when it dies, or when the minute ends, is lost for that minute.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

WINDOW_SECONDS = 60
# A lease lives this long unless renewed; its gateway renews it every LEASE_RENEW_SECONDS.
LEASE_TTL_SECONDS = 60.0
LEASE_RENEW_SECONDS = 20.0
# Retry-After for a key at its concurrency limit: a slot frees when any request ends.
CONCURRENCY_RETRY_AFTER_SECONDS = 1
# A replica that writes an admission may take this share of what is left of the minute's
# requests as a local allowance (admitted later with no round trip), at most RESERVE_MAX.
RESERVE_SHARE = 8
RESERVE_MAX = 32

LIMIT_FIELDS = {
    "requestsPerMinute": "requests_per_minute",
    "tokensPerMinute": "tokens_per_minute",
    "maxConcurrent": "max_concurrent",
}


class LimitsError(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def any(self) -> bool:
        return (
            self.requests_per_minute is not None
            or self.tokens_per_minute is not None
            or self.max_concurrent is not None
        )


NO_LIMITS = Limits()


def parse_limits(value: Any, where: str) -> Limits:
    """``{requestsPerMinute, tokensPerMinute, maxConcurrent}`` (each optional, a positive
    whole number); unknown names are refused, so a typo never silently means "unlimited"."""
    if value is None:
        return NO_LIMITS
    if not isinstance(value, Mapping):
        raise LimitsError(f"{where}: must be a mapping of {', '.join(LIMIT_FIELDS)}")
    unknown = sorted(set(value) - set(LIMIT_FIELDS))
    if unknown:
        raise LimitsError(f"{where}.{unknown[0]}: unknown limit (known: {', '.join(LIMIT_FIELDS)})")
    parsed: dict[str, int] = {}
    for name, attr in LIMIT_FIELDS.items():
        raw = value.get(name)
        if raw is None:
            continue
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
            raise LimitsError(f"{where}.{name}: must be a whole number >= 1, got {raw!r}")
        parsed[attr] = raw
    return Limits(**parsed)


def window_of(now: float) -> int:
    return int(now // WINDOW_SECONDS)


def window_end(window: int) -> float:
    return float((window + 1) * WINDOW_SECONDS)


@dataclass
class QuotaState:
    window: int = 0
    requests: int = 0
    tokens: int = 0
    leases: dict[str, float] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {"w": self.window, "r": self.requests, "t": self.tokens, "l": self.leases},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes | None) -> QuotaState:
        # A malformed value (a hand edit, another version) must not stop admissions: start over.
        if not data:
            return cls()
        try:
            raw = json.loads(data)
            return cls(
                int(raw.get("w", 0)),
                int(raw.get("r", 0)),
                int(raw.get("t", 0)),
                {str(k): float(v) for k, v in (raw.get("l") or {}).items()},
            )
        except (ValueError, TypeError, AttributeError):
            return cls()

    def current(self, now: float) -> QuotaState:
        """The state as of ``now``: a new window starts at zero, expired leases are gone. A
        window ahead of this clock (another replica's clock runs ahead) is kept, never rolled
        back."""
        window = window_of(now)
        if window > self.window:
            state = QuotaState(window, 0, 0)
        else:
            state = QuotaState(self.window, self.requests, self.tokens)
        state.leases = {k: v for k, v in self.leases.items() if v > now}
        return state

    def ttl(self, now: float) -> float:
        """How long the stored value is needed: to the end of its window, or of its last
        lease, and a window more (a replica whose clock lags still reads it)."""
        until = max([window_end(self.window), *self.leases.values()])
        return max(1.0, until - now + WINDOW_SECONDS)


@dataclass(frozen=True)
class Denied:
    limit: str  # requestsPerMinute | tokensPerMinute | maxConcurrent
    retry_after: int  # seconds


def reserved_tokens(limits: Limits, estimate: int) -> int:
    """What a request reserves of tokensPerMinute: its estimate, never more than the whole
    limit (a request larger than a minute's budget runs alone in an otherwise empty window)."""
    if limits.tokens_per_minute is None:
        return 0
    return max(0, min(estimate, limits.tokens_per_minute))


def admit(
    state: QuotaState, limits: Limits, now: float, lease: str | None, reserve: int = 0
) -> tuple[QuotaState, Denied | None]:
    """Admit one request: the new state (count + lease + reserved tokens) or, over a limit, the
    current state and which limit refused it. ``lease``: an id for the concurrency lease (None:
    do not hold one); ``reserve``: the tokens it may use (``reserved_tokens``)."""
    state = state.current(now)
    reset = max(1, math.ceil(window_end(state.window) - now))
    if limits.requests_per_minute is not None and state.requests >= limits.requests_per_minute:
        return state, Denied("requestsPerMinute", reset)
    if limits.tokens_per_minute is not None and (
        state.tokens >= limits.tokens_per_minute
        or state.tokens + reserve > limits.tokens_per_minute
    ):
        return state, Denied("tokensPerMinute", reset)
    if (
        limits.max_concurrent is not None
        and lease is not None
        and len(state.leases) >= limits.max_concurrent
    ):
        return state, Denied("maxConcurrent", CONCURRENCY_RETRY_AFTER_SECONDS)
    state.requests += 1
    state.tokens += reserve
    if lease is not None and limits.max_concurrent is not None:
        state.leases[lease] = now + LEASE_TTL_SECONDS
    return state, None


def reservation(state: QuotaState, limits: Limits) -> int:
    """How many more of the minute's requests a replica may reserve after admitting one: a
    1/RESERVE_SHARE share of what is left, so near the limit it is 0 and every admission is
    exact. Reserved requests count in the shared state at once: reservations never overshoot;
    what a replica reserved and did not use before the minute ended is lost (at most the share
    it took, by each replica)."""
    if limits.requests_per_minute is None:
        return 0
    left = limits.requests_per_minute - state.requests
    return max(0, min(RESERVE_MAX, left // RESERVE_SHARE))


def token_block(state: QuotaState, limits: Limits, reserve: int) -> int:
    """How many of the minute's tokens a replica may take as a local allowance after admitting
    a request that reserved ``reserve``: the same 1/RESERVE_SHARE share of what is left as for
    requests, at most RESERVE_MAX requests' worth of ``reserve``, and none when the share could
    not cover one more such request (near the limit every admission is a compare-and-set). Like
    reserved requests, the block counts in the shared state at once: never an overshoot; a
    replica that dies holding one loses at most it, until its window ends."""
    if limits.tokens_per_minute is None or reserve <= 0:
        return 0
    left = limits.tokens_per_minute - state.tokens
    block = min(RESERVE_MAX * reserve, left // RESERVE_SHARE)
    return block if block >= reserve else 0


@dataclass(frozen=True)
class Allowance:
    """What one replica holds of a key's minute, already counted in the shared state: requests
    and tokens it may admit with no round trip. Only valid in ``window``."""

    window: int
    requests: int = 0
    tokens: int = 0

    def held(self, window: int) -> Allowance:
        return self if self.window == window else Allowance(window)

    def add(self, other: Allowance) -> Allowance:
        if other.window != self.window:
            return other
        return Allowance(self.window, self.requests + other.requests, self.tokens + other.tokens)


def own_view(state: QuotaState, held: Allowance) -> QuotaState:
    """The counts a client of this replica is shown: the shared ones less what this replica
    holds and has not used (its allowance is the client's to use, not used yet)."""
    held = held.held(state.window)
    return QuotaState(state.window, state.requests - held.requests, state.tokens - held.tokens)


def admit_locally(
    state: QuotaState, held: Allowance | None, limits: Limits, reserve: int
) -> Allowance | None:
    """Admit one request with no round trip, from ``state`` (this replica's copy of the shared
    state, made current) and its allowance: the allowance after it, or None (decide by a write).

    A request takes one of the allowance's requests (when the key has requestsPerMinute) and
    ``reserve`` of its tokens. A request that reserves no tokens (a job: its tokens are charged
    when it ends) of a key with tokensPerMinute needs the minute's tokens below the limit in the
    copy (a window's counts only grow: a stale copy may admit it by the charges in flight)."""
    allowance = (held or Allowance(state.window)).held(state.window)
    if (
        reserve == 0
        and limits.tokens_per_minute is not None
        and state.tokens >= limits.tokens_per_minute
    ):
        return None
    requests = 1 if limits.requests_per_minute is not None else 0
    if allowance.requests < requests or allowance.tokens < reserve:
        return None
    return Allowance(state.window, allowance.requests - requests, allowance.tokens - reserve)


def admit_shared(
    state: QuotaState,
    limits: Limits,
    now: float,
    lease: str | None,
    reserve: int,
    held: Allowance | None,
    take: bool,
) -> tuple[QuotaState, Denied | None, Allowance, QuotaState]:
    """Admit one request by a write to the shared state (``admit``) and, when ``take`` (no
    lease, the state is shared), refill what this replica's allowance ``held`` lacks: a block of
    requests when it has none left, a block of tokens when it cannot cover ``reserve``. Returns
    the state to write, the refusal (or None), the allowance taken and the view for headers."""
    after, denied = admit(state, limits, now, lease, reserve)
    have = (held or Allowance(after.window)).held(after.window)
    extra = Allowance(after.window)
    if denied is None and take:
        requests = reservation(after, limits) if have.requests == 0 else 0
        after.requests += requests
        tokens = token_block(after, limits, reserve) if have.tokens < reserve else 0
        after.tokens += tokens
        extra = Allowance(after.window, requests, tokens)
    return after, denied, extra, own_view(after, have.add(extra))


def settle_locally(
    held: Allowance | None, now: float, window: int | None, reserved: int, tokens: int
) -> tuple[Allowance | None, int]:
    """A request admitted from the allowance (it reserved ``reserved`` of it in ``window``) ended
    having used ``tokens``: what it did not use goes back to the allowance, what it used beyond
    its reservation is taken from the allowance; returns the allowance after and the tokens left
    to charge in the shared state (0: no write). Once the window has ended, the reservation
    stays counted in it (a later window never counted it) and only an excess is charged."""
    tokens = max(0, tokens)
    current = window_of(now)
    if held is not None and held.window == window == current:
        left = held.tokens + reserved - tokens
        return Allowance(held.window, held.requests, max(0, left)), max(0, -left)
    return held, max(0, tokens - reserved)


def finish(
    state: QuotaState,
    now: float,
    lease: str | None,
    tokens: int,
    reserved: int = 0,
    window: int | None = None,
) -> QuotaState:
    """A request ended: its lease goes, its tokens count in the current window -- less what it
    reserved when it was admitted in ``window``; what it reserved and did not use is given back
    while that window lasts (a later window never counted it)."""
    state = state.current(now)
    if lease is not None:
        state.leases.pop(lease, None)
    tokens = max(0, tokens)
    if reserved and window == state.window:
        state.tokens = max(0, state.tokens + tokens - reserved)
    else:
        state.tokens += max(0, tokens - reserved) if reserved else tokens
    return state


def renew(state: QuotaState, now: float, leases: set[str]) -> QuotaState:
    """Extend these leases (the ones this replica still holds; one that expired meanwhile, its
    request still running, is put back: it does use a slot)."""
    state = state.current(now)
    for lease in leases:
        state.leases[lease] = now + LEASE_TTL_SECONDS
    return state


# ------------------------------------------------------------------ headers


def duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: ``20ms``, ``17s``, ``1m0s``, ``6m12s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


def rate_headers(state: QuotaState, limits: Limits, now: float) -> list[tuple[bytes, bytes]]:
    """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limits the key has."""
    headers: list[tuple[bytes, bytes]] = []
    reset = duration(max(0.0, window_end(state.window) - now)).encode()
    if limits.requests_per_minute is not None:
        headers += [
            (b"x-ratelimit-limit-requests", str(limits.requests_per_minute).encode()),
            (
                b"x-ratelimit-remaining-requests",
                str(max(0, limits.requests_per_minute - state.requests)).encode(),
            ),
            (b"x-ratelimit-reset-requests", reset),
        ]
    if limits.tokens_per_minute is not None:
        headers += [
            (b"x-ratelimit-limit-tokens", str(limits.tokens_per_minute).encode()),
            (
                b"x-ratelimit-remaining-tokens",
                str(max(0, limits.tokens_per_minute - state.tokens)).encode(),
            ),
            (b"x-ratelimit-reset-tokens", reset),
        ]
    return headers


_LIMIT_WORDS = {
    "requestsPerMinute": ("requests per minute", "requests_per_minute"),
    "tokensPerMinute": ("tokens per minute", "tokens_per_minute"),
    "maxConcurrent": ("concurrent requests", "max_concurrent"),
}


def too_large(key_name: str, limits: Limits, asked: int, field: str | None) -> str | None:
    """Why a request asking for ``asked`` completion tokens (``field`` x n) can never be served
    under the key's tokensPerMinute, or None. Admitted, it would wait for an empty minute and
    then take all of it; refused at once, the client learns what to change."""
    budget = limits.tokens_per_minute
    if budget is None or field is None or asked <= budget:
        return None
    return (
        f"Request too large for API key {key_name!r}: {field} (x n) asks for {asked} tokens, "
        f"above the key's limit tokensPerMinute = {budget} tokens per minute; lower {field} "
        "(retrying will not help)"
    )


def denial_message(key_name: str, limits: Limits, denied: Denied) -> str:
    """Names the limit and the key's name (never the key)."""
    words, attr = _LIMIT_WORDS[denied.limit]
    value = getattr(limits, attr)
    return (
        f"Rate limit reached for API key {key_name!r}: limit {denied.limit} = {value} "
        f"{words}; retry after {denied.retry_after} s"
    )

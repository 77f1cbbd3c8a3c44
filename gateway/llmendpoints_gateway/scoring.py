"""PURE: which replica starts a request soonest, within bounded load.

For each ready replica the scorer estimates the work standing between the request and its first
token, in blocks of prompt to prefill (prefix_index's blocks):

- the request's own uncached prefill: its blocks minus the longest prefix the replica holds
  (prefix_index.longest_match);
- the requests waiting in the replica's engine queue ahead of it (vllm:num_requests_waiting),
  each costing a typical request's prefill;
- the requests running (vllm:num_requests_running), which share every engine step with it;
  this gateway's requests sent since the sample and still in flight count as waiting when the
  engine had a queue, as running when it had none;
- a full KV cache (vllm:kv_cache_usage_perc above `kv_high`): the engine must evict or preempt
  before it admits more;
- for a LoRA adapter, a replica that does not have it active (vllm:lora_requests_info) must load it
  first, cheaply with a free adapter slot, dearly without.

The lowest estimate wins. Bounded load still holds first (Mirrokni et al., as routing.py):
a replica already carrying ``load_bound`` of this gateway's in-flight requests is not a
candidate, so a hot prefix spills to the next-best replica instead of piling up on one. Without
fresh engine load for every replica (a new pod, a failed scrape), this gateway's own in-flight
counts stand in for the queue, for all replicas alike, so the units stay comparable.

`choose` returns the replica, the reason (affinity, spill, load, adapter) and every replica's
score for debug logs. No I/O, no clock: the caller passes the engine loads and their age.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llmendpoints_gateway.routing import DEFAULT_LOAD_FACTOR, load_bound


class Reason(enum.StrEnum):
    """Why the replica was chosen (a metric label, like routing.Outcome)."""

    AFFINITY = "affinity"  # it holds the longest cached prefix, and it starts soonest
    SPILL = "spill"  # the replica(s) with the longest prefix are at their load bound
    LOAD = "load"  # no cached prefix decides: the least work ahead (or a shorter prefix won)
    ADAPTER = "adapter"  # the adapter being active there decided it


@dataclass(frozen=True)
class EngineState:
    """What a replica's engine reported (engine_load.EngineLoad, reduced to what scores)."""

    running: float
    waiting: float
    kv_usage: float  # 0..1
    active_adapters: frozenset[str] = frozenset()
    max_lora: int | None = None  # None: LoRA off or not reported
    age_s: float = 0.0  # how old the sample is


@dataclass(frozen=True)
class Candidate:
    """One ready replica as the request path sees it."""

    replica: str
    in_flight: int  # this gateway's requests to it now (exact)
    engine: EngineState | None = None
    sent_since_sample: int = 0  # this gateway's requests routed to it since `engine` was taken


@dataclass(frozen=True)
class Weights:
    """The estimate's constants, in blocks of prefill. Defaults: a running request costs a block
    (it shares every step with the new one, and where a new conversation starts is where its
    history will be: leaning to the less busy replica then spares bounded-load spills later; on
    the demo model 1.0 spilled less than 0.25 at hit rates within noise, bench/RESULTS.md -- to
    be tuned on real GPUs); a full cache costs four typical requests; loading an adapter one
    typical request with a free slot, four without."""

    running_blocks: float = 1.0
    kv_high: float = 0.9
    kv_full_requests: float = 4.0
    adapter_free_slot_requests: float = 1.0
    adapter_no_slot_requests: float = 4.0
    max_engine_age_s: float = 5.0  # older samples do not count (the pod may be gone)
    # A prefix no replica holds a block of leans to its home on the ring by this many blocks:
    # near-ties break alike in every gateway process (each knows only what it sent), so a new
    # system prompt lands on one replica, not one per process. 0: only exact ties go home.
    home_blocks: float = 2.0


DEFAULT_WEIGHTS = Weights()


@dataclass(frozen=True)
class Score:
    """One replica's estimate, for the debug log."""

    replica: str
    matched: int  # leading blocks it holds
    uncached: int  # blocks it would prefill
    queue: float  # requests ahead (engine-reported waiting + sent since, or our in-flight)
    running: float
    kv_usage: float | None
    adapter_cost: float
    in_flight: int
    bounded: bool  # at its load bound: not a candidate
    cost: float  # blocks of work before the first token (inf when bounded)


@dataclass(frozen=True)
class Choice:
    replica: str
    reason: Reason
    scores: tuple[Score, ...] = field(default_factory=tuple)

    def log_line(self) -> str:
        """The scores as one debug-log line: replica matched/uncached q= r= kv= cost."""
        parts = []
        for s in self.scores:
            kv = "-" if s.kv_usage is None else f"{s.kv_usage:.2f}"
            cost = "bound" if s.bounded else f"{s.cost:.1f}"
            parts.append(
                f"{s.replica} match={s.matched} uncached={s.uncached} q={s.queue:g} "
                f"run={s.running:g} kv={kv} inflight={s.in_flight} cost={cost}"
            )
        return f"{self.replica} ({self.reason}): " + "; ".join(parts)


def choose(
    candidates: Sequence[Candidate],
    request_blocks: int,
    matched: Mapping[str, int],
    *,
    typical_blocks: float = 1.0,
    adapter: str | None = None,
    load_factor: float = DEFAULT_LOAD_FACTOR,
    weights: Weights = DEFAULT_WEIGHTS,
    home: Sequence[str] = (),
) -> Choice | None:
    """The replica that starts the request soonest among those within the load bound.

    `request_blocks`: the request's whole blocks; `matched`: leading blocks each replica holds
    (PrefixIndex.longest_match); `typical_blocks`: a typical request's uncached prefill (the
    caller's moving average, at least 1); `adapter`: the LoRA adapter the request names, if any;
    `home`: the request's replicas in its consistent-hash order (routing.HashRing.walk of its
    prefix key), which breaks ties -- so a prefix nobody holds yet goes to the same replica
    from every gateway process, each of which only knows what it sent itself.
    None when there is no candidate."""
    if not candidates:
        return None
    rank = {replica: i for i, replica in enumerate(home)}
    typical = max(1.0, typical_blocks)
    bound = load_bound(sum(c.in_flight for c in candidates), len(candidates), load_factor)
    use_engine = all(
        c.engine is not None and c.engine.age_s <= weights.max_engine_age_s for c in candidates
    )
    scores = [
        _score(
            c,
            request_blocks,
            matched.get(c.replica, 0),
            typical,
            adapter,
            bound,
            use_engine,
            weights,
        )
        for c in candidates
    ]
    if weights.home_blocks and home and max(s.matched for s in scores) == 0:
        own = min(
            (s for s in scores if s.replica in rank), key=lambda s: rank[s.replica], default=None
        )
        if own is not None and not own.bounded:
            scores[scores.index(own)] = _with_cost(own, own.cost - weights.home_blocks)
    eligible = [s for s in scores if not s.bounded]
    last = len(rank)
    best = min(eligible, key=lambda s: _order(s, rank.get(s.replica, last)))
    return Choice(best.replica, _reason(best, scores, eligible, home), tuple(scores))


def _with_cost(s: Score, cost: float) -> Score:
    # dataclasses.replace, written out: it reads the class's fields on every call.
    return Score(
        s.replica,
        s.matched,
        s.uncached,
        s.queue,
        s.running,
        s.kv_usage,
        s.adapter_cost,
        s.in_flight,
        s.bounded,
        cost,
    )


def _score(
    c: Candidate,
    request_blocks: int,
    matched: int,
    typical: float,
    adapter: str | None,
    bound: int,
    use_engine: bool,
    w: Weights,
) -> Score:
    matched = min(matched, request_blocks)
    uncached = request_blocks - matched
    engine = c.engine if use_engine else None
    if engine is not None:
        queue, running = max(engine.waiting, 0.0), max(engine.running, 0.0)
        # What this gateway sent since the sample and is still waiting for is not in it: it
        # queues behind the engine's queue if there is one, else it is running already.
        new = min(c.sent_since_sample, c.in_flight)
        if queue > 0:
            queue += new
        else:
            running += new
        kv = min(max(engine.kv_usage, 0.0), 1.0)
        kv_cost = max(0.0, kv - w.kv_high) / (1 - w.kv_high) * w.kv_full_requests * typical
    else:
        # No engine view: this gateway's own in-flight requests are the queue it knows.
        queue, running, kv, kv_cost = float(c.in_flight), 0.0, None, 0.0
    adapter_cost = _adapter_cost(engine, adapter, typical, w)
    bounded = c.in_flight >= bound
    cost = (
        float("inf")
        if bounded
        else uncached + queue * typical + running * w.running_blocks + kv_cost + adapter_cost
    )
    return Score(
        c.replica, matched, uncached, queue, running, kv, adapter_cost, c.in_flight, bounded, cost
    )


def _adapter_cost(
    engine: EngineState | None, adapter: str | None, typical: float, w: Weights
) -> float:
    if adapter is None or engine is None or engine.max_lora is None:
        return 0.0  # no adapter asked, or nothing known about the replica's adapters
    if adapter in engine.active_adapters:
        return 0.0
    if len(engine.active_adapters) < engine.max_lora:
        return w.adapter_free_slot_requests * typical
    return w.adapter_no_slot_requests * typical


def _order(s: Score, home_rank: int = 0) -> tuple[float, int, int, int, str]:
    # Ties: the longer cached prefix, then the request's place on the hash ring (the same in
    # every gateway process), then fewer of our requests, then a stable name order.
    return (s.cost, -s.matched, home_rank, s.in_flight, s.replica)


def _reason(
    best: Score, scores: Sequence[Score], eligible: Sequence[Score], home: Sequence[str] = ()
) -> Reason:
    longest = max(s.matched for s in scores)
    # Where a prefix nobody holds a block of goes: its home on the ring (the first candidate
    # in `home` order), where its blocks will be.
    by_name = {s.replica: s for s in scores}
    own = next((by_name[r] for r in home if r in by_name), None) if longest == 0 else None
    if (
        longest > 0
        and best.matched < longest
        and any(s.bounded and s.matched == longest for s in scores)
    ) or (own is not None and own.bounded):
        return Reason.SPILL
    if best.adapter_cost == 0 and any(s.adapter_cost > 0 for s in eligible):
        rank = {replica: i for i, replica in enumerate(home)}
        without = min(
            eligible, key=lambda s: _order(_without_adapter(s), rank.get(s.replica, len(rank)))
        )
        if without.replica != best.replica:
            return Reason.ADAPTER
    if own is not None and best.replica == own.replica:
        return Reason.AFFINITY
    if longest > 0 and best.matched == longest:
        return Reason.AFFINITY
    return Reason.LOAD


def _without_adapter(s: Score) -> Score:
    return Score(
        s.replica, s.matched, s.uncached, s.queue, s.running, s.kv_usage, 0.0,
        s.in_flight, s.bounded, s.cost - s.adapter_cost,
    )  # fmt: skip

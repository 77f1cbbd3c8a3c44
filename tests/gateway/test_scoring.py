"""The scorer with the prefix index, through the registry's own request path -- conversations
stay where their history is, shared system prompts go where they are cached, bounded load holds,
engine load and adapters count -- and the pure scorer's terms one by one."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest
from llmendpoints_gateway.engine_load import EngineLoad
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.prefix_index import PrefixIndex
from llmendpoints_gateway.registry import Registry, RouteKey
from llmendpoints_gateway.routing import Outcome, Strategy, prefix_key
from llmendpoints_gateway.scoring import Candidate, EngineState, Reason, Weights, choose

CHUNK = 64
PATH = "/v1/chat/completions"
IDLE = EngineState(running=0, waiting=0, kv_usage=0.1)


def text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["refund", "order", "ticket", "policy", "agent"]) for _ in range(n))


SYSTEM = [text(150, 100 + i) for i in range(4)]  # long shared instructions (~1,000 chars)


def route_key(body: dict) -> RouteKey:
    return RouteKey.of(PATH, body, CHUNK)


def engine(running: float, waiting: float, kv_usage: float) -> EngineLoad:
    """A fresh sample of a replica's engine, as the engine-load feed holds it."""
    return EngineLoad(running, waiting, kv_usage, taken_at=time.monotonic())


class Gateway:
    """One prefix-aware endpoint in the gateway's own registry: a request takes the request
    path's way (its route key; the registry's choice: longest match, scoring, the index
    recording it). Blocks of CHUNK characters keep the prompts here short; ``engines`` stands
    for the engine-load feed (replica -> its latest sample)."""

    def __init__(self, replicas: list[str], *, load_factor: float = 1.25):
        self.registry = Registry(GatewayMetrics(), hold_queue_length=10, load_factor=load_factor)
        self.ep = self.registry.upsert("e", ["m"], Strategy.PREFIX_AWARE)
        self.ep.index = PrefixIndex(chunk_chars=CHUNK)
        self.registry.set_ready(self.ep.id, replicas)
        self.engines: dict[str, EngineLoad] = {}
        self.registry.feed = self.engines  # what the pod reader's get answers

    def route(self, body: dict, *, hold: bool = False) -> tuple[str, Outcome]:
        replica, outcome = self.registry.choose(self.ep, route_key(body))
        if hold:  # still in flight: counts in the replica's load
            self.registry.acquire(self.ep, replica)
        return replica, outcome


def conversation(system: str, question: str, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    bodies = []
    for t in range(turns):
        bodies.append({"model": "m", "messages": list(messages)})
        messages += [
            {"role": "assistant", "content": text(20, t)},
            {"role": "user", "content": f"And {t}? " + text(15, 50 + t)},
        ]
    return bodies


def test_a_conversation_stays_where_its_history_is() -> None:
    gw = Gateway(["a", "b", "c"])
    # Other traffic first, so that the conversation does not start on an empty index.
    for i in range(6):
        gw.route(conversation(SYSTEM[i % 4], f"other {i}", 1)[0])
    turns = conversation(text(80, 7), "My order never arrived.", 5)
    home, _ = gw.route(turns[0])
    for before, body in itertools.pairwise(turns):
        # Only what the new turn added is to prefill there: the whole previous prompt matches.
        matched = gw.ep.index.longest_match(route_key(body).blocks).get(home)
        assert matched == len(route_key(before).blocks)
        assert gw.route(body) == (home, Outcome.AFFINITY)


def opening(system: str, question: str) -> dict:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }


def test_a_shared_system_prompt_goes_where_it_is_cached() -> None:
    gw = Gateway(["a", "b", "c", "d"])
    first, _ = gw.route(opening(SYSTEM[0], "Question one?"))
    users = [opening(SYSTEM[0], f"User {i} asks: " + text(8, i)) for i in range(12)]
    # Many users, one instruction, each their own first question: all where it is cached.
    assert {gw.route(body) for body in users} == {(first, Outcome.AFFINITY)}
    # Today's prefix key (system messages + first user turn) gives those requests 12 keys.
    assert len({prefix_key(PATH, body) for body in users}) == 12


@pytest.mark.parametrize("replicas", [2, 3, 5])
@pytest.mark.parametrize("load_factor", [1.25, 1.5])
def test_bounded_load_holds_under_a_burst_of_one_prefix(replicas: int, load_factor: float) -> None:
    """Every request of a burst shares one hot prefix and stays in flight: no replica ever
    carries more than ceil(c x mean) of them, and the hot prefix spills rather than piles up."""
    gw = Gateway([f"r{i}" for i in range(replicas)], load_factor=load_factor)
    outcomes = []
    for i in range(40):
        _, outcome = gw.route(opening(SYSTEM[1], f"q{i}"), hold=True)
        outcomes.append(outcome)
        in_flight = gw.ep.loads
        assert max(in_flight.values()) <= math.ceil(
            load_factor * sum(in_flight.values()) / replicas
        )
    assert Outcome.SPILLED in outcomes and Outcome.AFFINITY in outcomes
    assert sum(1 for n in gw.ep.loads.values() if n) >= 2  # the hot prefix spread


def test_a_busy_engine_loses_a_short_cached_prefix_but_keeps_a_long_one() -> None:
    gw = Gateway(["a", "b"])
    gw.ep.typical = 4.0  # a typical request's uncached blocks, as the registry has learned it
    long_body = conversation(text(400, 1), "q", 1)[0]  # ~2,400 characters: ~37 blocks
    short_body = conversation(text(30, 2), "q", 1)[0]  # a few blocks
    gw.ep.index.record("a", route_key(long_body).blocks)
    gw.ep.index.record("a", route_key(short_body).blocks)
    # "a" holds both prompts, but its engine has 3 requests waiting.
    gw.engines.update(a=engine(running=8, waiting=3, kv_usage=0.5), b=engine(0, 0, 0.1))
    assert gw.route(short_body) == ("b", Outcome.LOAD)  # 12 blocks of queue > the prefix
    assert gw.route(long_body) == ("a", Outcome.AFFINITY)  # ~37 cached blocks > the queue


def test_the_replica_that_starts_soonest_wins_among_equals() -> None:
    blocks = route_key(conversation(text(40, 3), "q", 1)[0]).blocks
    for engines, expected in [
        ({"a": EngineState(4, 2, 0.3), "b": EngineState(4, 0, 0.3)}, "b"),  # shorter queue
        ({"a": EngineState(2, 0, 0.3), "b": EngineState(30, 0, 0.3)}, "a"),  # fewer running
        ({"a": EngineState(1, 0, 0.99), "b": EngineState(1, 0, 0.5)}, "b"),  # a full KV cache
    ]:
        candidates = [Candidate(r, 0, e) for r, e in engines.items()]
        choice = choose(candidates, len(blocks), {})
        assert (choice.replica, choice.reason) == (expected, Reason.LOAD), engines


def test_requests_sent_since_the_last_sample_are_added_while_in_flight() -> None:
    """The engine's numbers are up to a second old: what this gateway sent since, and still
    waits for, is added -- to the queue behind a queue, to the running batch otherwise."""
    candidates = [
        Candidate("a", 5, EngineState(0, 2, 0.1), sent_since_sample=7),
        Candidate("b", 1, EngineState(0, 3, 0.1), sent_since_sample=0),
        Candidate("c", 3, EngineState(2, 0, 0.1), sent_since_sample=30),
    ]
    choice = choose(candidates, 4, {}, load_factor=4)
    # "a": 5 of the 7 it was sent are still in flight, behind 2 waiting; "c": 3 more running.
    assert [(s.queue, s.running) for s in choice.scores] == [(7, 0), (3, 0), (0, 5)]
    assert [s.cost for s in choice.scores] == [4 + 7, 4 + 3, 4 + 5]
    assert choice.replica == "b"


def test_without_fresh_engine_load_everywhere_our_in_flight_counts_stand_in() -> None:
    stale = EngineState(0, 0, 0.0, age_s=60)
    candidates = [Candidate("a", 3, stale), Candidate("b", 1, IDLE)]
    choice = choose(candidates, 2, {})
    assert choice.replica == "b"
    assert [(s.queue, s.kv_usage) for s in choice.scores] == [(3, None), (1, None)]
    # Fresh everywhere: the engines' own queues decide (ours are not the whole picture).
    fresh = [Candidate("a", 3, IDLE), Candidate("b", 1, EngineState(0, 9, 0.1))]
    assert choose(fresh, 2, {}).replica == "a"


def test_an_adapter_prefers_replicas_where_it_is_active() -> None:
    engines = {
        "a": EngineState(2, 0, 0.3, active_adapters=frozenset({"sql"}), max_lora=2),
        "b": EngineState(1, 0, 0.3, active_adapters=frozenset({"x"}), max_lora=2),
        "c": EngineState(0, 0, 0.3, active_adapters=frozenset({"x", "y"}), max_lora=2),
    }
    candidates = [Candidate(r, 0, e) for r, e in engines.items()]
    choice = choose(candidates, 3, {}, typical_blocks=2, adapter="sql")
    assert (choice.replica, choice.reason) == ("a", Reason.ADAPTER)
    costs = {s.replica: s.adapter_cost for s in choice.scores}
    assert costs == {"a": 0, "b": 2.0, "c": 8.0}  # a free slot is cheaper than a full batch
    # The base model, or an adapter nobody reports: no adapter term at all.
    assert choose(candidates, 3, {}).replica == "c"
    assert all(s.adapter_cost == 0 for s in choose(candidates, 3, {}, adapter=None).scores)


def test_spill_affinity_and_the_debug_line() -> None:
    candidates = [Candidate("a", 4), Candidate("b", 0)]
    choice = choose(candidates, 10, {"a": 10, "b": 0}, load_factor=1.25)
    # Bound for 5 requests over 2 replicas at 1.25: ceil(3.125) = 4; "a" is at it.
    assert (choice.replica, choice.reason) == ("b", Reason.SPILL)
    line = choice.log_line()
    assert line.startswith("b (spill): ")
    assert "a match=10 uncached=0" in line and "cost=bound" in line
    assert "b match=0 uncached=10" in line
    assert choose([], 3, {}) is None


def test_weights_are_tunable() -> None:
    candidates = [Candidate("a", 0, EngineState(40, 0, 0.2)), Candidate("b", 0, IDLE)]
    # "a" holds 6 more blocks; 40 running requests cost 40 blocks at the default weight.
    assert choose(candidates, 6, {"a": 6}).replica == "b"
    assert choose(candidates, 6, {"a": 6}, weights=Weights(running_blocks=0.05)).replica == "a"

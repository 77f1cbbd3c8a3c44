"""Prefix-aware routing wired end to end: the real gateway process scoring two stand-in replicas
(bench/gateway_standin.py) that report their engine's load through a real /metrics, as vLLM
names it, and keep a pretend prefix cache.

- a shared system prompt goes where the gateway sent it before, whatever its requests' homes
  on the hash ring say (the prompt's own, and the CHWBL key's of each request);
- a replica whose engine reports a queue or a full KV cache loses requests it would otherwise
  get, and gets them back once its engine is idle again;
- a request for a LoRA adapter goes to the replica whose engine has it active;
- /metrics: choices by reason, the index's hits, the engines' own prefix-cache counters.

All of it with one process and with GATEWAY_WORKERS=2 sharing their prefix indexes through a
real nats-server (route_sharing.py): each request on a connection of its own, so on either
worker.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from pathlib import Path

import httpx
import pytest
from integration.nats_kit import nats_server
from llmendpoints_gateway.routing import HashRing, hash64, home_key, prefix_key

from .harness import Process, metric_sum, running_gateway, running_standins, write_endpoints

CHAT = "/v1/chat/completions"
MODEL = "scored-model"
SYSTEM = " ".join(f"rule {i}: answer the customer politely and cite the policy." for i in range(40))


def opening(question: str, model: str = MODEL) -> dict:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
    }


def short(text: str, model: str = MODEL) -> dict:
    """A prompt shorter than one block (256 characters): only its home on the ring places it."""
    return {"model": model, "messages": [{"role": "user", "content": text}]}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scored-routing")


@pytest.fixture(scope="module")
def standins(logs):
    with running_standins(logs, "s1", "s2") as procs:
        yield procs


@pytest.fixture(scope="module", params=["1-process", "2-workers"])
def gateway(logs, standins, request):
    with contextlib.ExitStack() as stack:
        settings = {}
        if request.param == "2-workers":
            url = stack.enter_context(nats_server())
            settings = {"GATEWAY_WORKERS": "2", "JOBS_QUEUE_URL": url}
        yield stack.enter_context(_gateway(logs, standins, settings))


@contextlib.contextmanager
def _gateway(logs, standins, settings: dict[str, str]):
    endpoints = write_endpoints(
        logs / "endpoints.yaml",
        [
            {
                "name": "scored",
                "models": [MODEL, "sql-adapter"],
                "backends": [standins["s1"].url, standins["s2"].url],
            }
        ],
    )
    with running_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=str(endpoints),
        GATEWAY_REQUIRE_KEYS="false",
        GATEWAY_ENGINE_LOAD_INTERVAL_SECONDS="0.2",
        LLMEP_LOG_LEVEL="debug",
        **settings,
    ) as gw:
        _wait(lambda: _ready_replicas(gw) == 2, "both replicas ready")
        yield gw


@pytest.fixture(autouse=True)
def idle_engines(standins):
    for proc in standins.values():
        _set_engine(proc)
    yield
    for proc in standins.values():
        _set_engine(proc)


def _set_engine(proc: Process, **state) -> None:
    body = {"running": 0, "waiting": 0, "kv_usage": 0.0, "adapters": [], "max_lora": 0, **state}
    httpx.post(proc.url + "/standin/engine", json=body, timeout=5).raise_for_status()


def _ready_replicas(gw: Process) -> int:
    data = httpx.get(gw.url + "/v1/models", timeout=5).json()["data"]
    return next(m["ready_replicas"] for m in data if m["id"] == MODEL)


def _until_routed(gw: Process, bodies, want: str, what: str) -> None:
    """Until requests go to ``want`` -- six in a row, so that every worker (each reads the
    engines on its own) has seen what changed."""
    _wait(lambda: all(_send(gw, next(bodies)) == want for _ in range(6)), what)


def _wait(condition, what: str = "condition", timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _metric(gw: Process, name: str, **labels: str) -> float:
    return metric_sum(gw.metrics_url, name, **labels)


def _requests(proc: Process) -> int:
    return httpx.get(proc.url + "/stats", timeout=5).json()["requests"]


def _send(gw: Process, body: dict) -> str:
    """The replica (stand-in name) that answered."""
    response = httpx.post(gw.url + CHAT, json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["replica"]


def _home(standins, body: dict, key=prefix_key) -> str:
    """The replica owning ``body``'s key on the ring: by default its prefix key's (where the
    CHWBL before the scorer sent it; the scorer's home for a chat without system messages)."""
    ring = HashRing([standins["s1"].url, standins["s2"].url])
    owner = ring.owner(hash64(key(CHAT, body)))
    return next(name for name, proc in standins.items() if proc.url == owner)


def _homed(standins, name: str, make, count: int, start: int = 0) -> list[dict]:
    """``count`` bodies ``make(i)`` whose home on the ring is replica ``name``."""
    found = (make(i) for i in itertools.count(start))
    return list(itertools.islice((b for b in found if _home(standins, b) == name), count))


def test_a_shared_system_prompt_goes_where_it_is_cached(gateway, standins):
    # Its home on the ring (the system prompt's) is busy when the prompt is first sent: it goes
    # to the other replica, which from then on holds it.
    home = _home(standins, opening("any question"), home_key)
    other = "s2" if home == "s1" else "s1"
    _set_engine(standins[home], waiting=20)
    probes = iter(_homed(standins, home, lambda i: short(f"probe {i}"), 200))
    _until_routed(gateway, probes, other, f"the gateway to see {home}'s queue")
    assert _send(gateway, opening("Where is my order?")) == other
    # Every process knows it: the one that routed it told the others (none with one process).
    records = "llmendpoints_gateway_prefix_index_shared_records_total"
    _wait(
        lambda: (
            _metric(gateway, records, direction="received")
            >= _metric(gateway, records, direction="sent")
        ),
        "the other worker to hear of it",
    )
    _set_engine(standins[home])
    _until_routed(gateway, probes, home, f"the gateway to see {home} idle")
    hits_before = _metric(gateway, "llmendpoints_gateway_prefix_index_hits_total")
    affinity_before = _metric(
        gateway, "llmendpoints_gateway_routing_decisions_total", outcome="affinity"
    )
    # Ten users, each their own first question, the system prompt's home idle again, and each
    # user's own CHWBL key (system prompt + question) homed there too: only the index (the
    # prompt's blocks were sent to `other`) sends them to `other`.
    users = _homed(standins, home, lambda i: opening(f"User {i} asks about a refund."), 10)
    assert {_send(gateway, body) for body in users} == {other}
    assert (
        _metric(gateway, "llmendpoints_gateway_routing_decisions_total", outcome="affinity")
        == affinity_before + 10
    )
    assert _metric(gateway, "llmendpoints_gateway_prefix_index_hits_total") > hits_before
    # The engines' own counters reach the gateway's /metrics (the stand-in's pretend cache hit
    # the system prompt nine times out of ten).
    _wait(
        lambda: _metric(gateway, "llmendpoints_gateway_engine_prefix_cache_hits_total") > 0,
        "the engines' prefix-cache hits on the gateway's /metrics",
    )
    assert "match=" in gateway.log() and "(affinity)" in gateway.log()  # scores at debug level


def test_an_engine_with_a_queue_loses_new_prompts_until_it_is_idle(gateway, standins):
    _set_engine(standins["s1"], waiting=20)
    bodies = iter(_homed(standins, "s1", lambda i: short(f"new question {i}"), 200))
    # The feed reads /metrics five times a second: wait until the gateway has seen the queue.
    _until_routed(gateway, bodies, "s2", "the gateway to see s1's queue")
    load_before = _metric(gateway, "llmendpoints_gateway_routing_decisions_total", outcome="load")
    s1_before = _requests(standins["s1"])
    assert [_send(gateway, next(bodies)) for _ in range(5)] == ["s2"] * 5
    assert _requests(standins["s1"]) == s1_before
    assert (
        _metric(gateway, "llmendpoints_gateway_routing_decisions_total", outcome="load")
        == load_before + 5
    )
    _set_engine(standins["s1"])  # idle again: prompts homed there go there again
    _until_routed(gateway, bodies, "s1", "the gateway to see s1 idle")
    assert [_send(gateway, next(bodies)) for _ in range(3)] == ["s1"] * 3


def test_an_engine_with_a_full_kv_cache_is_avoided(gateway, standins):
    _set_engine(standins["s2"], kv_usage=0.99)
    bodies = iter(_homed(standins, "s2", lambda i: short(f"cache question {i}"), 200))
    _until_routed(gateway, bodies, "s1", "the gateway to see s2's full cache")
    assert [_send(gateway, next(bodies)) for _ in range(5)] == ["s1"] * 5


def test_an_adapter_goes_where_it_is_active(gateway, standins):
    _set_engine(standins["s2"], adapters=["sql-adapter"], max_lora=2)
    _set_engine(standins["s1"], adapters=["other"], max_lora=1)
    bodies = iter(_homed(standins, "s1", lambda i: short(f"select {i}", "sql-adapter"), 200))
    _until_routed(gateway, bodies, "s2", "the gateway to see the adapters")
    before = _metric(gateway, "llmendpoints_gateway_routing_decisions_total", outcome="adapter")
    assert [_send(gateway, next(bodies)) for _ in range(3)] == ["s2"] * 3
    assert (
        _metric(gateway, "llmendpoints_gateway_routing_decisions_total", outcome="adapter")
        == before + 3
    )
    # The base model is no adapter: its requests still go to their homes.
    base = _homed(standins, "s1", lambda i: short(f"plain {i}"), 3)
    assert [_send(gateway, body) for body in base] == ["s1"] * 3

"""The real gateway in front of two real runtimes (vLLM CPU, demo model, prefix caching on).

Replica ``e1`` serves ``demo``; ``e2`` serves ``demo`` and ``demo-b``. Endpoint ``chat``
(model ``demo``) has both; endpoint ``other`` (model ``demo-b``) only ``e2``, so a ``demo-b``
request routed anywhere else would be a 404 from vLLM (vLLM names the first served name in its
answers, so the replicas' own request counters tell where requests went). The gateway starts before the engines:
the first test is a request held while its only replica starts. Both runtimes also take the
jobs of endpoint ``chat`` from a real nats-server, which the gateway's job API writes to.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import proc_kit
import pytest
from integration.nats_kit import nats_server
from ports import free_port
from runtime_process import RuntimeServer

from .harness import launch_runtime, running_gateway, write_endpoints

pytestmark = pytest.mark.engine

SYSTEM = "You are a helpful assistant who answers briefly and in plain words. " * 3
# A stream long enough to be cut mid-way: ~10 s of the demo model's generation, so that no
# moment the test process is held off its CPU (1.6 s seen on a loaded run, with the engines let
# go: they ended a 2,000-token request in it) lets the engine finish it first.
STREAM_TOKENS = 12_000


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    """The demo model with room for STREAM_TOKENS positions."""
    from llmendpoints_runtime.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo-model"), STREAM_TOKENS + 64)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway-runtime-logs")


@pytest.fixture(scope="module")
def queue_url():
    with nats_server() as url:
        yield url


@pytest.fixture(scope="module")
def replicas(demo_model, logs, queue_url):
    # Both take the jobs of endpoint "chat" from the shared queue.
    queue = {
        "JOBS_QUEUE_URL": queue_url,
        "ENDPOINT_ID": "chat",
        "MAX_MODEL_LEN": str(STREAM_TOKENS + 16),
    }
    # Their control ports on, as the operator's pods have them: the gateway reads them there.
    e1 = launch_runtime(
        demo_model, logs, SERVED_MODEL_NAME="demo", LLMEP_CONTROL_PORT=str(free_port()), **queue
    )
    e2 = launch_runtime(
        demo_model,
        logs,
        SERVED_MODEL_NAME="demo demo-b",
        LLMEP_CONTROL_PORT=str(free_port()),
        **queue,
    )
    yield {"e1": e1, "e2": e2}
    for replica in (e1, e2):
        replica.stop()


@pytest.fixture(scope="module")
def gateway(logs, replicas, queue_url):
    e1, e2 = replicas["e1"], replicas["e2"]
    endpoints = write_endpoints(
        logs / "endpoints.yaml",
        [
            {"name": "chat", "models": ["demo"], "backends": [e1.url, e2.url]},
            {"name": "other", "models": ["demo-b"], "backends": [e2.url]},
        ],
    )
    # Engine start-up takes 25-90 s on a quiet 2-core machine and several minutes on a busy one:
    # the hold must outlast it.
    with running_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=str(endpoints),
        GATEWAY_HOLD_TIMEOUT_SECONDS="900",
        JOBS_QUEUE_URL=queue_url,
        GATEWAY_REQUIRE_KEYS="false",  # the replicas and the endpoints are open here
    ) as gw:
        yield gw


def _metric_sum(metrics_url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _ready(replica: RuntimeServer) -> bool:
    try:
        return httpx.get(replica.url + "/ready?strict=1", timeout=5).status_code == 200
    except httpx.TransportError:
        return False  # not even listening yet


def _finished(replica: RuntimeServer, reason: str | None = None) -> float:
    labels = {"finished_reason": reason} if reason else {}
    return _metric_sum(replica.url + "/metrics", "vllm:request_success_total", **labels)


def test_a_request_is_held_while_the_only_replica_starts(gateway, replicas):
    result: dict = {}

    def call():
        client = openai.OpenAI(
            base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=900
        )
        result["reply"] = client.completions.create(model="demo-b", prompt="Hello", max_tokens=4)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 30
    while (
        _metric_sum(
            gateway.metrics_url, "llmendpoints_gateway_held_requests", endpoint="default/other"
        )
        != 1
    ):
        assert time.monotonic() < deadline, "the request was not held"
        time.sleep(0.1)
    assert not _ready(replicas["e2"])  # still starting
    caller.join(900)
    assert result["reply"].usage.completion_tokens == 4
    for replica in replicas.values():
        replica.wait_http("/ready?strict=1", timeout=900)
    deadline = time.monotonic() + 10
    while (
        _metric_sum(
            gateway.metrics_url, "llmendpoints_gateway_ready_replicas", endpoint="default/chat"
        )
        != 2
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_openai_sdk_streamed_and_not(gateway):
    for base in ("/v1", "/v2/chat/openai/v1"):
        client = openai.OpenAI(base_url=gateway.url + base, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Say hello"}]
        reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=8)
        assert 0 < reply.usage.completion_tokens <= 8
        assert reply.choices[0].finish_reason in ("length", "stop")
        stream = client.chat.completions.create(
            model="demo",
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens <= 8
        assert any(c.choices and c.choices[0].delta.content for c in chunks)
        models = [m.id for m in client.models.list()]
        assert "demo" in models


def test_requests_go_to_the_endpoint_serving_their_model(gateway, replicas):
    e1_before = _finished(replicas["e1"])
    e2_before = _finished(replicas["e2"])
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    for _ in range(4):
        reply = client.completions.create(model="demo-b", prompt="Once upon a time", max_tokens=2)
        assert reply.usage.completion_tokens == 2
    assert _finished(replicas["e1"]) == e1_before  # e1 cannot serve demo-b: never asked
    assert _finished(replicas["e2"]) == e2_before + 4
    with pytest.raises(openai.NotFoundError, match="demo-c"):
        client.completions.create(model="demo-c", prompt="x", max_tokens=2)


def test_a_conversation_stays_on_the_replica_that_has_its_prefix_cached(gateway, replicas):
    before = {name: _finished(r) for name, r in replicas.items()}
    hits_before = {
        name: _metric_sum(r.url + "/metrics", "vllm:prefix_cache_hits_total")
        for name, r in replicas.items()
    }
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Tell me a story."},
    ]
    for turn in range(5):
        reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=6)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"And then? ({turn})"},
        ]
    served = {name: _finished(r) - before[name] for name, r in replicas.items()}
    assert sorted(served.values()) == [0, 5], served
    home = max(served, key=served.get)
    assert (
        _metric_sum(replicas[home].url + "/metrics", "vllm:prefix_cache_hits_total")
        > hits_before[home]
    )


def test_a_client_disconnect_aborts_the_request_in_the_engine(gateway, replicas):
    # vLLM does not count aborted requests in request_success_total{finished_reason="abort"};
    # what shows the abort is that the request never finishes and its tokens stop.
    def totals():
        return (
            sum(_finished(r, "length") for r in replicas.values()),
            sum(
                _metric_sum(r.url + "/metrics", "vllm:generation_tokens_total")
                for r in replicas.values()
            ),
        )

    for replica in replicas.values():  # (when this test runs alone)
        replica.wait_ready()
    # vLLM counts a finished request a moment after its answer has left (the previous test's
    # last one, +1 seen on a loaded run): the counters are read once they have settled.
    finished_before, tokens_before = totals()
    while True:
        time.sleep(0.5)
        if (settled := totals()) == (finished_before, tokens_before):
            break
        finished_before, tokens_before = settled
    body = {
        "model": "demo",
        "prompt": "Count:",
        "max_tokens": STREAM_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    pids = [r.process.pid for r in replicas.values()]
    seen: dict = {}
    first_line, leave = threading.Event(), threading.Event()

    def client() -> None:
        with httpx.stream(
            "POST", gateway.url + "/v1/completions", json=body, timeout=60
        ) as response:
            seen["status"] = response.status_code
            seen["first"] = next(response.iter_lines())
            first_line.set()
            leave.wait(60)  # then it leaves, mid-answer

    # The demo model writes a thousand tokens or more a second: the engines run in slices until
    # the first event reaches the client, and wait while it leaves, so the request is surely
    # mid-way when the abort reaches them. (Three loaded runs failed here with a 2,000-token
    # request: in one, every process but the engines stood still for 1.6 s while they ran, and
    # the whole stream reached the client -- 200 in the gateway's access log -- before the
    # slice ended; the slices are niced now, and the request is STREAM_TOKENS long.)
    with proc_kit.engines_frozen(*pids) as cores:
        reader = threading.Thread(target=client)
        reader.start()
        longest = proc_kit.run_in_slices(
            cores, lambda: first_line.is_set() or not reader.is_alive()
        )
        leave.set()
        reader.join(60)
        assert seen.get("status") == 200 and seen.get("first", "").startswith("data: "), seen
        # The runtimes' API processes (not frozen) see the disconnect and let the request go.
        proc_kit.wait_until(
            lambda: (
                not any(
                    _metric_sum(r.url + "/metrics", "llmendpoints_requests_in_flight")
                    for r in replicas.values()
                )
            ),
            20,
            "the runtimes still count the request in flight after the client left",
        )
    deadline = time.monotonic() + 20
    while any(
        _metric_sum(r.url + "/metrics", "vllm:num_requests_running") for r in replicas.values()
    ):
        assert time.monotonic() < deadline, "the engine kept running the request"
        time.sleep(0.05)
    _, tokens = totals()
    # The engines generated fewer tokens than the request asked for: it was cut when the
    # client left. (Counting finished requests instead also counted, on some loaded runs, one
    # that was not this test's.)
    assert tokens - tokens_before < STREAM_TOKENS, f"the longest engine slice: {longest:.2f} s"


def _main_port_probes_and_scrapes(replica: RuntimeServer) -> float:
    """The runtime's own count of /ready, /health and /metrics requests on its main port, read
    on its control port (which serves what the API process published, at most 0.5 s old)."""
    url = f"http://127.0.0.1:{replica.env['LLMEP_CONTROL_PORT']}/metrics"
    return sum(
        _metric_sum(url, "llmendpoints_http_requests_total", route=route)
        for route in ("/ready", "/health", "/metrics")
    )


def test_the_gateway_reads_the_runtimes_on_their_control_ports_and_leaves_them_idle(
    gateway, replicas
):
    """Each runtime names its control port on its main port's probes; the gateway learns it and
    probes and reads engine load there only: an idle endpoint's runtimes get nothing from the
    gateway on the port that serves requests (issue 33: their API processes rendered the
    gateway's /metrics reads, N workers x M pods a second)."""
    for replica in replicas.values():
        answer = httpx.get(replica.url + "/ready", timeout=10)
        assert answer.headers["x-llmep-control-port"] == replica.env["LLMEP_CONTROL_PORT"]
        assert f"control port {replica.env['LLMEP_CONTROL_PORT']}" in gateway.log()
    openai.OpenAI(base_url=gateway.url + "/v1", api_key="none").completions.create(
        model="demo", prompt="Hello", max_tokens=2
    )
    time.sleep(3.0)  # past the endpoint's activity grace (2 x the harness's 1 s idle probes)
    before = {name: _main_port_probes_and_scrapes(r) for name, r in replicas.items()}
    time.sleep(4.0)  # four idle probe periods; then one more publication of the counts
    after = {name: _main_port_probes_and_scrapes(r) for name, r in replicas.items()}
    assert after == before


def test_a_job_sent_to_the_gateway_runs_on_a_runtime_through_the_shared_queue(gateway):
    import runpod

    runpod.endpoint_url_base = gateway.url + "/v2"
    runpod.api_key = "none"
    endpoint = runpod.Endpoint("chat")
    job_input = {"prompt": "Hello", "sampling_params": {"max_tokens": 4, "ignore_eos": True}}
    (batch,) = endpoint.run_sync({"input": job_input}, timeout=120)
    assert batch["usage"]["output"] == 4
    job = endpoint.run({"input": job_input})
    assert job.output(timeout=120)[0]["usage"]["output"] == 4
    assert job.status() == "COMPLETED"

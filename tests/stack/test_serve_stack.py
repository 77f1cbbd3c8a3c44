"""`make serve-stack` (scripts/serve_stack.py) on the demo model: it comes up, the README's tour
runs as written (the OpenAI and RunPod SDKs, a 429 with x-ratelimit-*, the usage export), what
every component serves on /metrics passes promtool, and SIGTERM stops all of it, leaving no
process.

The tour's blocks are read from README.md (between the stack-tour markers) and run with this
test's ports in place of the defaults, so another stack on the machine is no obstacle.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ports import free_port

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DEMO_MODEL = ROOT / ".cache" / "demo-model"


def descendants(pid: int) -> set[int]:
    """Every process under `pid` now (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def tour_blocks(ports: dict[str, int], state: Path) -> list[tuple[str, str]]:
    """(language, code) of the README's tour, with this test's ports and STACK_DIR."""
    text = (ROOT / "README.md").read_text()
    tour = text.split("<!-- stack-tour:start -->", 1)[1].split("<!-- stack-tour:end -->", 1)[0]
    blocks = re.findall(r"```(python|bash)\n(.*?)```", tour, re.S)
    assert [lang for lang, _ in blocks] == ["python", "python", "python", "bash"]
    swaps = {
        "127.0.0.1:8080": f"127.0.0.1:{ports['gateway']}",
        "127.0.0.1:8001": f"127.0.0.1:{ports['replica1']}",
        "127.0.0.1:8002": f"127.0.0.1:{ports['replica2']}",
        "127.0.0.1:4222": f"127.0.0.1:{ports['nats']}",
        ".cache/serve-stack/": f"{state}/",
    }
    result = []
    for lang, code in blocks:
        for old, new in swaps.items():
            code = code.replace(old, new)
        result.append((lang, code))
    return result


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not (DEMO_MODEL / "config.json").is_file():
        subprocess.run([BIN / "llmendpoints-runtime", "demo-model", DEMO_MODEL], check=True)
    state = tmp_path_factory.mktemp("stack")
    ports = {
        name: free_port() for name in ("gateway", "gateway_metrics", "replica1", "replica2", "nats")
    }
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "STACK_DIR": str(state),
        "STACK_GATEWAY_PORT": str(ports["gateway"]),
        "STACK_GATEWAY_METRICS_PORT": str(ports["gateway_metrics"]),
        "STACK_REPLICA_PORTS": f"{ports['replica1']},{ports['replica2']}",
        "STACK_NATS_PORT": str(ports["nats"]),
    }
    out = (state / "serve-stack.out").open("wb")
    began = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "serve_stack.py")],
        env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    output = state / "serve-stack.out"
    try:
        deadline = time.monotonic() + 900
        while "Ctrl-C stops everything" not in output.read_text():
            assert process.poll() is None, output.read_text()[-3000:]
            assert time.monotonic() < deadline, output.read_text()[-3000:]
            time.sleep(0.5)
        print(f"serve-stack up in {time.monotonic() - began:.0f} s")
        yield {"process": process, "ports": ports, "output": output, "state": state}
    finally:
        if process.poll() is None:  # (the last test stops it; not when it is left out)
            # Its processes before it dies: then they are init's children, found no more.
            family = descendants(process.pid)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            for pid in family:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        out.close()


def test_it_prints_the_urls_and_keys(stack):
    text = stack["output"].read_text()
    for needle in (
        f"http://127.0.0.1:{stack['ports']['gateway']}/v1",
        f"http://127.0.0.1:{stack['ports']['replica1']}",
        f"nats://127.0.0.1:{stack['ports']['nats']}",
        "sk-tenant-a",
        "10 requests per minute",
        "llmendpoints-gateway usage",
    ):
        assert needle in text, needle


def test_the_queue_refuses_a_client_without_a_credential(stack):
    """NATS runs with the chart's JWT authentication (before: no auth at all, so anything on
    the machine read every job and usage record): no creds file, no connection; the gateway's
    own reaches it."""
    import asyncio

    import nats

    url = f"nats://127.0.0.1:{stack['ports']['nats']}"

    async def attempt(**options) -> str:
        try:
            nc = await nats.connect(
                url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, **options
            )
        except Exception as exc:  # nats-py raises its own error types
            return str(exc)
        await nc.close()
        return "connected"

    assert "Authorization Violation" in asyncio.run(attempt())
    gateway = stack["state"] / "creds" / "gateway.creds"
    assert asyncio.run(attempt(user_credentials=str(gateway))) == "connected"
    assert f"JOBS_QUEUE_CREDS_FILE={gateway}" in stack["output"].read_text()


def test_the_readme_tour_runs_as_written(stack, capsys):
    blocks = tour_blocks(stack["ports"], stack["state"])
    namespace: dict = {}
    # The OpenAI SDK through the gateway.
    exec(compile(blocks[0][1], "README tour: openai", "exec"), namespace)
    assert namespace["reply"].choices[0].message.content is not None
    # A RunPod job submitted to replica 1, its output read from replica 2.
    exec(compile(blocks[1][1], "README tour: runpod", "exec"), namespace)
    output = namespace["Job"]("demo", namespace["job"].job_id, namespace["RunPodClient"]())
    assert namespace["runpod"].endpoint_url_base.endswith(f":{stack['ports']['replica2']}/v2")
    assert output.status() == "COMPLETED"
    # Over the limit: a 429 naming the key, with the headers.
    exec(compile(blocks[2][1], "README tour: 429", "exec"), namespace)
    answer = namespace["answer"]
    assert answer.status_code == 429
    assert "tenant-a" in answer.json()["error"]["message"]
    assert answer.headers["x-ratelimit-limit-requests"] == "10"
    assert answer.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in answer.headers
    # The usage export lists the tenant's requests through the gateway.
    export = subprocess.run(
        ["bash", "-c", blocks[3][1]], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert export.returncode == 0, export.stderr
    rows = [line.split(",") for line in export.stdout.strip().splitlines()]
    header, body = rows[0], [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]
    assert "key" in header and "requests" in header
    tenant = [row for row in body if row["key"] == "tenant-a" and row["endpoint"] == "default/demo"]
    # The chat, then requests up to the limit of 10 (more if the minute turned meanwhile).
    assert tenant and int(tenant[0]["requests"]) >= 10


def _promtool(text: str) -> subprocess.CompletedProcess[str]:
    promtool = BIN / "promtool"
    assert promtool.is_file(), "promtool is missing: run `make setup` (scripts/tools.sh)"
    return subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )


def _families(text: str, prefix: str) -> str:
    """The exposition's lines of the metric families whose names start with `prefix`."""
    kept = []
    for line in text.splitlines():
        name = line.split()[2] if line.startswith("# ") else re.split(r"[{ ]", line, maxsplit=1)[0]
        if name.startswith(prefix):
            kept.append(line)
    return "\n".join(kept) + "\n"


def test_every_component_s_metrics_pass_promtool(stack):
    """The live /metrics of the gateway and of a runtime, ours in full. What promtool says of
    the runtime's /metrics is about vLLM's own series alone (named `vllm:...`, which promtool
    reserves for recording rules): vLLM's names are its contract with every vLLM dashboard, not
    ours to change."""
    ports = stack["ports"]
    gateway = httpx.get(f"http://127.0.0.1:{ports['gateway_metrics']}/metrics", timeout=10).text
    runtime = httpx.get(f"http://127.0.0.1:{ports['replica1']}/metrics", timeout=10).text
    for text in (gateway, runtime):
        assert "_created" not in text  # vLLM's series included
    for text in (gateway, _families(runtime, "llmendpoints_")):
        result = _promtool(text)
        assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
            result.stdout + result.stderr
        )
    result = _promtool(runtime)
    complaints = (result.stdout + result.stderr).strip().splitlines()
    others = [line for line in complaints if not line.startswith("vllm:")]
    assert complaints and not others, others


def test_sigterm_stops_all_of_it_leaving_no_process(stack):
    process = stack["process"]
    before = descendants(process.pid)
    # nats-server, the gateway, two runtimes and their engine cores (at least).
    assert len(before) >= 6, before
    process.send_signal(signal.SIGTERM)
    assert process.wait(120) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in before if alive(pid)]
    assert "serve-stack: stopped" in stack["output"].read_text()
    for port in stack["ports"].values():  # nothing listens any more
        with (
            pytest.raises(ConnectionRefusedError),
            socket.create_connection(("127.0.0.1", port), 2),
        ):
            pass

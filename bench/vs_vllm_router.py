"""Our gateway side by side with `vllm-router` (the vLLM project's Rust router, PyPI), in one run.

    nice -n 10 .venv/bin/python bench/vs_vllm_router.py --part cpu --rounds 6
    nice -n 10 .venv/bin/python bench/vs_vllm_router.py --part cpu --before /path/to/main/checkout
    nice -n 10 .venv/bin/python bench/vs_vllm_router.py --part memory --streams 500
    # prefix routing: bench/prefix_routing.py with the peer's policies as strategies
    nice -n 10 .venv/bin/python bench/prefix_routing.py --strategies \
        round-robin,scored,vr-cache_aware,vr-round_robin,vr-consistent_hash

Part ``cpu`` (issue 33): one real runtime (the demo model, its control port on as the operator's
pods have it) and, in front of it, every router at once, each its own process: ``ours`` (this
checkout's gateway, no keys), ``ours-key`` (the same code with an API key that has per-minute
limits: every request carries it), ``peer`` (``vllm-router``, its default policy
``cache_aware``), and with ``--before PATH`` the gateway of that checkout (``before``,
``before-key``). ``direct`` is the runtime without a router. vLLM's own benchmark client sends
the same load to each in turn -- ``--num-prompts`` streamed chats of ``--output-len`` tokens,
``--concurrency`` in flight -- in rounds whose order rotates, so the machine's drift hits every
side alike.

Measured, per run (psutil, user + system of one process):

- each router's CPU per request, **gross** (everything the process used during the run, its idle
  work included) and **net** of its own idle rate (measured first, below), the way the two
  figures in issue 33 were made;
- the runtime API process's CPU per request for the same requests (the runtime's main process,
  not its engine, not its control-port process), net of its own idle rate (all routers
  stopped) -- through a router vs direct: what a router adds to the pod's serving process per
  request. During each run every other router is SIGSTOPped: only the measured one talks to the
  runtime (and uses the machine);
- idle: each router alone for ``--idle-seconds`` (every other router SIGSTOPped), its own CPU per
  second and what it adds per second to the runtime's API process and to its control-port
  process, against all routers stopped.

The ratios are per round (the runs of a round are back to back and share the machine's load)
and their median over rounds, with the range. The load average is recorded with every run.

Part ``memory``: two stand-in backends (bench/gateway_standin.py) and each router in turn:
``--streams`` slow streams (an event every 0.5 s for 15 s) opened at once; memory per open
stream = (RSS with all open - RSS idle) / streams (bench/gateway_streams.py's phases), and its
CPU per proxied request on the stand-ins (3,000 requests, 100 in flight).

Results: bench/out/vs_vllm_router_<part>.json and a Markdown section on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway_streams as gs
import runtime_vs_vllm as rv

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
BIN = Path(sys.executable).parent
BENCH_KEY = "sk-bench-side-by-side-0123456789"
# Per-minute limits far above the load: every request is checked and counted, none refused.
BENCH_LIMITS = {"requestsPerMinute": 1_000_000, "tokensPerMinute": 1_000_000_000}
PEER_POLICY = "cache_aware"  # vllm-router's default


# --- routers ------------------------------------------------------------------------------------


@dataclass
class Router:
    name: str
    url: str
    process: subprocess.Popen
    key: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu(self) -> float:
        return process_cpu(self.pid)

    def times(self) -> tuple[float, float]:
        """(user, system) CPU seconds of its processes (psutil: 10 ms ticks)."""
        main = psutil.Process(self.pid)
        user = system = 0.0
        for process in [main, *main.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = process.cpu_times()
                user, system = user + t.user, system + t.system
        return user, system

    def rss(self) -> int:
        return psutil.Process(self.pid).memory_info().rss

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


def process_cpu(pid: int, *, tree: bool = True) -> float:
    """CPU seconds of ``pid`` (and, ``tree``, its descendants: a gateway's workers), to the
    nanosecond: the sum of its threads' run time (/proc/PID/task/*/schedstat). psutil's
    user + system time counts in 10 ms ticks, too coarse for an idle router's few ms a second;
    what a thread that ended ran is lost here, which the long-lived threads of these servers
    (event loops, tokio's workers, vLLM's) do not do during a run."""
    main = psutil.Process(pid)
    total = 0
    for process in [main, *(main.children(recursive=True) if tree else [])]:
        for task in Path(f"/proc/{process.pid}/task").glob("*/schedstat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(task.read_text().split()[0])
    return total / 1e9


def gateway_env(code: Path, port: int, endpoints_file: Path, workers: int) -> dict[str, str]:
    return {
        **os.environ,
        "GATEWAY_ENDPOINTS_FILE": str(endpoints_file),
        "PORT": str(port),
        "HOST": "127.0.0.1",
        "LLMEP_LOG_LEVEL": "warning",
        "LOG_LEVEL": "warning",
        "GATEWAY_REQUIRE_KEYS": "false",
        "GATEWAY_METRICS_PORT": "0",
        "GATEWAY_WORKERS": str(workers),
        "PYTHONPATH": gs.gateway_code_path(code),
    }


def start_gateway(
    name: str, code: Path, backends: list[str], model: str, out: Path, *, keyed: bool, workers: int
) -> Router:
    document: dict = {"endpoints": [{"name": "demo", "models": [model], "backends": backends}]}
    if keyed:
        document["apiKeys"] = [{"name": "bench", "key": BENCH_KEY, "limits": BENCH_LIMITS}]
    endpoints = out / f"{name}.yaml"
    endpoints.write_text(yaml.safe_dump(document))
    port = rv.free_port()
    log = (out / f"{name}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "llmendpoints_gateway", "serve"],
        env=gateway_env(code, port, endpoints, workers),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    return Router(name, f"http://127.0.0.1:{port}", process, BENCH_KEY if keyed else None)


def start_peer(name: str, backends: list[str], out: Path, policy: str = PEER_POLICY) -> Router:
    port = rv.free_port()
    log = (out / f"{name}.log").open("wb")
    argv = [
        str(BIN / "vllm-router"),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--policy", policy,
        "--log-level", "warning",
        "--worker-urls", *backends,
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    return Router(name, f"http://127.0.0.1:{port}", process)


def wait_routable(router: Router, model: str, timeout: float = 300.0) -> None:
    """Until a one-token request through ``router`` succeeds (its backends found ready)."""
    headers = {"authorization": f"Bearer {router.key}"} if router.key else {}
    body = {"model": model, "prompt": "hello", "max_tokens": 1}
    deadline = time.monotonic() + timeout
    while True:
        assert router.process.poll() is None, f"{router.name} exited; see its log"
        with contextlib.suppress(httpx.TransportError):
            response = httpx.post(
                router.url + "/v1/completions", json=body, headers=headers, timeout=30
            )
            if response.status_code == 200:
                return
        assert time.monotonic() < deadline, f"{router.name} not routable in {timeout:.0f} s"
        time.sleep(0.5)


@contextlib.contextmanager
def stopped(routers: list[Router]) -> Iterator[None]:
    for r in routers:
        r.pause()
    try:
        yield
    finally:
        for r in routers:
            r.resume()


# --- the runtime ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Runtime:
    url: str
    pid: int

    def api_cpu(self) -> float:
        return process_cpu(self.pid, tree=False)

    def control_cpu(self) -> float:
        """The control port's process (a child of the API process: python -m ...control_listener)."""
        for child in psutil.Process(self.pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if any("control_listener" in part for part in child.cmdline()):
                    return process_cpu(child.pid, tree=False)
        return 0.0


@contextlib.contextmanager
def running_runtime(model: Path, out: Path) -> Iterator[Runtime]:
    """The runtime with its control port on, as the operator's pods have it."""
    control = {"LLMEP_CONTROL_PORT": str(rv.free_port())}
    with rv.running_server(
        rv.OURS, model, out / "runtime.log", extra_env=control, start_timeout=900
    ) as server:
        yield Runtime(server.url, server.pid)


# --- the client -----------------------------------------------------------------------------------


def chat_client(
    url: str, model: Path, load: rv.Load, out: Path, name: str, key: str | None
) -> dict:
    """vLLM's benchmark client (in this process), streamed chat completions; ``key`` goes in the
    Authorization header (the client reads OPENAI_API_KEY)."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = rv.client_argv(url, model, load, out, name)
    argv[argv.index("--backend") + 1] = "openai-chat"
    argv[argv.index("--endpoint") + 1] = "/v1/chat/completions"
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    saved = os.environ.pop("OPENAI_API_KEY", None)
    if key:
        os.environ["OPENAI_API_KEY"] = key
    try:
        with (
            (out / f"{name}.client.log").open("w") as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            return asyncio.run(main_async(args))
    finally:
        os.environ.pop("OPENAI_API_KEY", None)
        if saved is not None:
            os.environ["OPENAI_API_KEY"] = saved


# --- part cpu -------------------------------------------------------------------------------------


@dataclass
class Run:
    side: str
    round: int
    load_avg: float
    wall_s: float
    requests: int
    failed: int
    request_throughput: float
    median_ttft_ms: float
    router_cpu_ms_gross: float | None  # per request
    router_cpu_ms_net: float | None
    router_user_ms: float | None  # the gross figure's user / system split (psutil: 10 ms ticks)
    router_system_ms: float | None
    runtime_api_cpu_ms: float
    runtime_api_cpu_ms_net: float  # less the runtime's own idle rate (all routers stopped)
    runtime_control_cpu_ms: float


@dataclass
class Idle:
    """CPU per second with only this router running (ms/s): its own, and the runtime's."""

    router_ms_per_s: float
    runtime_api_ms_per_s: float
    runtime_control_ms_per_s: float


def measure_idle(routers: list[Router], runtime: Runtime, seconds: float) -> dict[str, Idle]:
    """Each router alone (the others SIGSTOPped), then none: CPU per second over ``seconds``."""
    idle: dict[str, Idle] = {}
    for alone in [*routers, None]:
        others = [r for r in routers if r is not alone]
        with stopped(others):
            time.sleep(1.0)  # let what the stop interrupted settle
            started = time.perf_counter()
            own0 = alone.cpu() if alone else 0.0
            api0, control0 = runtime.api_cpu(), runtime.control_cpu()
            time.sleep(seconds)
            wall = time.perf_counter() - started
            own = (alone.cpu() - own0) if alone else 0.0
            idle[alone.name if alone else "none"] = Idle(
                own * 1000 / wall,
                (runtime.api_cpu() - api0) * 1000 / wall,
                (runtime.control_cpu() - control0) * 1000 / wall,
            )
        print(
            f"  idle {alone.name if alone else 'none'}: {idle[alone.name if alone else 'none']}",
            flush=True,
        )
    return idle


def one_run(
    side: str,
    round_: int,
    router: Router | None,
    runtime: Runtime,
    model: Path,
    load: rv.Load,
    out: Path,
    idle: dict[str, Idle],
) -> Run:
    requests = load.num_prompts + load.warmups
    load_avg = os.getloadavg()[0]
    own0 = router.cpu() if router else 0.0
    times0 = router.times() if router else (0.0, 0.0)
    api0, control0 = runtime.api_cpu(), runtime.control_cpu()
    started = time.perf_counter()
    data = chat_client(
        router.url if router else runtime.url,
        model,
        load,
        out,
        f"{side}-{round_}",
        router.key if router else None,
    )
    wall = time.perf_counter() - started
    gross = (router.cpu() - own0) if router else None
    net = gross - idle[side].router_ms_per_s / 1000 * wall if router and gross is not None else None
    times1 = router.times() if router else (0.0, 0.0)
    api = runtime.api_cpu() - api0
    api_net = api - idle["none"].runtime_api_ms_per_s / 1000 * wall
    per = 1000 / requests
    return Run(
        side=side,
        round=round_,
        load_avg=round(load_avg, 2),
        wall_s=round(wall, 2),
        requests=requests,
        failed=int(data.get("failed", 0)),
        request_throughput=round(float(data["request_throughput"]), 2),
        median_ttft_ms=round(float(data["median_ttft_ms"]), 2),
        router_cpu_ms_gross=None if gross is None else round(gross * 1000 / requests, 4),
        router_cpu_ms_net=None if net is None else round(net * 1000 / requests, 4),
        router_user_ms=round((times1[0] - times0[0]) * per, 4) if router else None,
        router_system_ms=round((times1[1] - times0[1]) * per, 4) if router else None,
        runtime_api_cpu_ms=round(api * per, 4),
        runtime_api_cpu_ms_net=round(api_net * per, 4),
        runtime_control_cpu_ms=round((runtime.control_cpu() - control0) * 1000 / requests, 4),
    )


def rotated(sides: list[str], round_: int) -> list[str]:
    k = round_ % len(sides)
    return sides[k:] + sides[:k]


def chat_load(args) -> rv.Load:
    """The streamed-chat load of ``--num-prompts``, ``--input-len``, ``--output-len`` and
    ``--concurrency`` (8 warm-up requests, seed 0): this bench's, and bench/profile_front_door.py's."""
    return rv.Load(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        warmups=8,
        seed=0,
    )


def cpu_part(args, out: Path) -> dict:
    model = rv.ensure_demo_model(OUT / "demo-model")
    load = chat_load(args)
    with contextlib.ExitStack() as stack:
        runtime = stack.enter_context(running_runtime(model, out))
        backends = [runtime.url]
        codes = {"ours": REPO}
        if args.before is not None:
            codes["before"] = args.before.resolve()
        routers: list[Router] = []
        for label, code in codes.items():
            for keyed in (False, True):
                name = f"{label}-key" if keyed else label
                routers.append(
                    start_gateway(
                        name, code, backends, rv.SERVED_NAME, out, keyed=keyed, workers=args.workers
                    )
                )
        routers.append(start_peer("peer", backends, out))
        for router in routers:
            stack.callback(_stop, router)
        for router in routers:
            wait_routable(router, rv.SERVED_NAME)
        by_name = {r.name: r for r in routers}
        sides = ["direct", *by_name]
        # A short untimed pass through every side: the first requests of a process (imports,
        # the chat template, connection pools) are not what is measured.
        warm = rv.Load(16, load.input_len, load.output_len, load.concurrency, 0, 1)
        for side in sides:
            router = by_name.get(side)
            chat_client(
                router.url if router else runtime.url, model, warm, out, f"warm-{side}",
                router.key if router else None,
            )  # fmt: skip
        # Past our gateway's activity grace (2 x GATEWAY_IDLE_PROBE_INTERVAL_SECONDS): idle.
        time.sleep(args.settle_seconds)
        idle = measure_idle(routers, runtime, args.idle_seconds)
        time.sleep(3.0)
        for router in routers:  # resumed: each finds its backend again before the rounds
            wait_routable(router, rv.SERVED_NAME)
        runs: list[Run] = []
        for round_ in range(args.rounds):
            for side in rotated(sides, round_):
                router = by_name.get(side)
                # Only the measured router talks to the runtime meanwhile: the others'
                # probes would land in its API process's CPU (and the machine's).
                with stopped([r for r in routers if r is not router]):
                    if router is not None:
                        wait_routable(router, rv.SERVED_NAME)
                    run = one_run(side, round_, router, runtime, model, load, out, idle)
                runs.append(run)
                print(f"  {json.dumps(asdict(run))}", flush=True)
    return {
        "load": asdict(load),
        "workers": args.workers,
        "before": str(args.before) if args.before else None,
        "peer": f"vllm-router {_version('vllm-router')}, policy {PEER_POLICY}",
        "idle": {k: asdict(v) for k, v in idle.items()},
        "runs": [asdict(r) for r in runs],
        "summary": summarize(runs, idle),
    }


def _stop(router: Router) -> None:
    with contextlib.suppress(ProcessLookupError):
        router.resume()
        router.process.terminate()
    try:
        router.process.wait(30)
    except subprocess.TimeoutExpired:
        router.process.kill()


def _version(distribution: str) -> str:
    import importlib.metadata

    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(distribution)
    return "unknown"


def _spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "rounds": [round(v, 4) for v in values],
    }


def summarize(runs: list[Run], idle: dict[str, Idle]) -> dict:
    """PURE: per side, medians over rounds; per round, the ratios that the goals are about."""
    by: dict[tuple[str, int], Run] = {(r.side, r.round): r for r in runs}
    rounds = sorted({r.round for r in runs})
    sides = list(dict.fromkeys(r.side for r in runs))
    out: dict = {"sides": {}, "ratios": {}}
    for side in sides:
        mine = [by[(side, n)] for n in rounds if (side, n) in by]
        entry = {
            "runtime_api_cpu_ms": _spread([r.runtime_api_cpu_ms for r in mine]),
            "runtime_api_cpu_ms_net": _spread([r.runtime_api_cpu_ms_net for r in mine]),
            "runtime_control_cpu_ms": _spread([r.runtime_control_cpu_ms for r in mine]),
            "median_ttft_ms": _spread([r.median_ttft_ms for r in mine]),
            "request_throughput": _spread([r.request_throughput for r in mine]),
            "failed": sum(r.failed for r in mine),
            "load_avg": _spread([r.load_avg for r in mine]),
        }
        if side != "direct":
            entry["router_cpu_ms_gross"] = _spread([r.router_cpu_ms_gross for r in mine])
            entry["router_cpu_ms_net"] = _spread([r.router_cpu_ms_net for r in mine])
            entry["router_user_ms"] = _spread([r.router_user_ms for r in mine])
            entry["router_system_ms"] = _spread([r.router_system_ms for r in mine])
            entry["idle"] = asdict(idle[side])
            entry["idle_added_runtime_api_ms_per_s"] = round(
                idle[side].runtime_api_ms_per_s - idle["none"].runtime_api_ms_per_s, 3
            )
            entry["idle_added_runtime_control_ms_per_s"] = round(
                idle[side].runtime_control_ms_per_s - idle["none"].runtime_control_ms_per_s, 3
            )
        out["sides"][side] = entry

    def ratio(a: str, b: str, attr: str) -> dict | None:
        values = [
            getattr(by[(a, n)], attr) / getattr(by[(b, n)], attr)
            for n in rounds
            if (a, n) in by and (b, n) in by and getattr(by[(b, n)], attr)
        ]
        return _spread(values) if values else None

    pairs = [("ours", "peer"), ("ours-key", "peer"), ("ours-key", "ours")]
    if "before" in sides:
        pairs += [("before", "peer"), ("before-key", "before"), ("ours", "before")]
    for a, b in pairs:
        out["ratios"][f"{a}/{b} gross"] = ratio(a, b, "router_cpu_ms_gross")
        out["ratios"][f"{a}/{b} net"] = ratio(a, b, "router_cpu_ms_net")
    for side in sides:
        if side != "direct":
            out["ratios"][f"runtime API via {side}/direct"] = ratio(
                side, "direct", "runtime_api_cpu_ms_net"
            )
    return out


def cpu_markdown(result: dict, argv: list[str]) -> str:
    s, load = result["summary"], result["load"]
    lines = [
        f"### Side by side with vllm-router: CPU per streamed request ({_now()})",
        "",
        f"`nice -n 10 .venv/bin/python bench/vs_vllm_router.py {' '.join(argv)}`; "
        f"{result['peer']}; gateway workers: {result['workers']}. Load: vLLM's client, "
        f"{load['num_prompts']} (+{load['warmups']} warm-up) streamed chats, {load['input_len']} "
        f"tokens in, {load['output_len']} out, {load['concurrency']} in flight, one runtime "
        f"(demo model, control port on).",
        "",
        "| side | router CPU ms/req gross (range) | net of idle (range) | user / system ms/req "
        "| router idle ms/s | runtime API ms/req net of its idle (range) | runtime API ms/s "
        "added idle | control port ms/s added idle | median TTFT ms | req/s | failed | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, e in s["sides"].items():
        gross = _cell(e.get("router_cpu_ms_gross"))
        net = _cell(e.get("router_cpu_ms_net"))
        idle = f"{e['idle']['router_ms_per_s']:.2f}" if "idle" in e else "-"
        split = (
            f"{e['router_user_ms']['median']:.2f} / {e['router_system_ms']['median']:.2f}"
            if "router_user_ms" in e
            else "-"
        )
        lines.append(
            f"| {side} | {gross} | {net} | {split} | {idle} | "
            f"{_cell(e['runtime_api_cpu_ms_net'])} | "
            f"{e.get('idle_added_runtime_api_ms_per_s', '-')} | "
            f"{e.get('idle_added_runtime_control_ms_per_s', '-')} | "
            f"{e['median_ttft_ms']['median']} | {e['request_throughput']['median']} | "
            f"{e['failed']} | {e['load_avg']['min']}-{e['load_avg']['max']} |"
        )
    lines += ["", "| ratio (per round) | median | range | rounds |", "| --- | --- | --- | --- |"]
    for name, r in s["ratios"].items():
        if r:
            rounds = ", ".join(f"{v:.3f}" for v in r["rounds"])
            lines.append(
                f"| {name} | **{r['median']:.3f}** | {r['min']:.3f}-{r['max']:.3f} | {rounds} |"
            )
    return "\n".join(lines) + "\n"


def _cell(spread: dict | None) -> str:
    if not spread:
        return "-"
    return f"{spread['median']:.3f} ({spread['min']:.3f}-{spread['max']:.3f})"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


# --- part memory ----------------------------------------------------------------------------------


@dataclass
class MemoryRun:
    side: str
    round: int
    load_avg: float
    cpu_ms_per_request: float
    requests_per_s: float
    streams: int
    streams_ok: int
    errors: dict = field(default_factory=dict)
    rss_idle_mib: float = 0.0
    rss_open_mib: float = 0.0
    kib_per_open_stream: float = 0.0


async def memory_one(router: Router, args) -> tuple[float, float, tuple]:
    url = router.url + "/v1/chat/completions"
    tree = gs.Tree(router.pid)
    cpu_ms, _, rps = await gs.cpu_phase(url, tree, args.requests)
    streams = await gs.open_streams_phase(url, tree, args.streams)
    return cpu_ms, rps, streams


def memory_part(args, out: Path) -> dict:
    standins, backends = [], []
    for i in range(2):
        port = rv.free_port()
        standins.append(
            gs.spawn(
                [sys.executable, str(REPO / "bench" / "gateway_standin.py"), "--port", str(port),
                 "--name", f"s{i}"],
                out / f"standin-{i}.log",
            )
        )  # fmt: skip
        backends.append(f"http://127.0.0.1:{port}")
    codes = {"ours": REPO, **({"before": args.before.resolve()} if args.before else {})}
    runs: list[MemoryRun] = []
    try:
        for b in backends:
            gs.wait_http(b + "/ready")
        sides = [*codes, "peer"]
        for round_ in range(args.rounds):
            for side in rotated(sides, round_):
                router = (
                    start_peer(side, backends, out)
                    if side == "peer"
                    else start_gateway(
                        side, codes[side], backends, "standin", out, keyed=False, workers=1
                    )
                )
                try:
                    wait_routable_standin(router)
                    time.sleep(1.0)
                    load_avg = os.getloadavg()[0]
                    cpu_ms, rps, (idle, opened, ok, errors, _) = asyncio.run(
                        memory_one(router, args)
                    )
                finally:
                    _stop(router)
                run = MemoryRun(
                    side, round_, round(load_avg, 2), round(cpu_ms, 3), round(rps, 1),
                    args.streams, ok, errors, round(idle / 2**20, 1), round(opened / 2**20, 1),
                    round((opened - idle) / args.streams / 1024, 1),
                )  # fmt: skip
                runs.append(run)
                print(f"  {json.dumps(asdict(run))}", flush=True)
    finally:
        for p in standins:
            p.terminate()
            p.wait(30)
    return {"streams": args.streams, "requests": args.requests, "runs": [asdict(r) for r in runs]}


def wait_routable_standin(router: Router, timeout: float = 60.0) -> None:
    body = {"model": "standin", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            if (
                httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10).status_code
                == 200
            ):
                return
        assert time.monotonic() < deadline, f"{router.name} not routable"
        time.sleep(0.3)


def memory_markdown(result: dict, argv: list[str]) -> str:
    lines = [
        f"### Side by side with vllm-router: memory per open stream ({_now()})",
        "",
        f"`nice -n 10 .venv/bin/python bench/vs_vllm_router.py {' '.join(argv)}`; two stand-in "
        f"backends; {result['streams']} streams opened at once (an event every 0.5 s for 15 s); "
        f"CPU over {result['requests']} short streamed requests (8 events, 100 in flight).",
        "",
        "| side (round) | KiB / open stream | RSS idle MiB | RSS all open MiB | streams OK | "
        "CPU ms / request (stand-ins) | req/s | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['side']} ({r['round']}) | {r['kib_per_open_stream']} | {r['rss_idle_mib']} | "
            f"{r['rss_open_mib']} | {r['streams_ok']}/{r['streams']} | {r['cpu_ms_per_request']} "
            f"| {r['requests_per_s']} | {r['load_avg']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["cpu", "memory"], default="cpu")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="per router")
    parser.add_argument(
        "--settle-seconds", type=float, default=12.0, help="quiet before the idle measure"
    )
    parser.add_argument("--workers", type=int, default=1, help="our gateway's GATEWAY_WORKERS")
    parser.add_argument("--before", type=Path, help="also the gateway of this older checkout")
    parser.add_argument("--streams", type=int, default=500, help="memory: streams held open")
    parser.add_argument("--requests", type=int, default=3000, help="memory: CPU-phase requests")
    args = parser.parse_args()
    out = OUT / f"vs_vllm_router_{args.part}"
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "cpu":
        result = cpu_part(args, out)
        text = cpu_markdown(result, sys.argv[1:])
    else:
        result = memory_part(args, out)
        text = memory_markdown(result, sys.argv[1:])
    result["load_before_after"] = os.getloadavg()
    (OUT / f"vs_vllm_router_{args.part}.json").write_text(json.dumps(result, indent=2))
    (OUT / f"vs_vllm_router_{args.part}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

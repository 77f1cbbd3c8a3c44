"""`make serve-stack`: the whole data plane on this machine, no cluster.

    nats-server (JetStream)      nats://127.0.0.1:4222   the shared job queue, limits, usage
    runtime replica 1            http://127.0.0.1:8001   the demo model, a worker of the queue
    runtime replica 2            http://127.0.0.1:8002   the same
    gateway                      http://127.0.0.1:8080   one URL: keys, limits, routing, holds
    gateway /metrics             http://127.0.0.1:9090   its own port, as in the chart

The replicas are staggered: the second starts when the first's server listens, so that the two
never import vLLM at the same time on two cores; each has a small context (MAX_MODEL_LEN) and KV
cache (VLLM_CPU_KVCACHE_SPACE=1 GiB). The gateway starts with the first replica and holds requests
until one is ready. Ctrl-C or SIGTERM stops everything: each process runs in its own process
group, which gets SIGTERM (a drain) and then SIGKILL; nothing is left behind.

Everything listens on 127.0.0.1 only. Ports, keys and the model can be changed from the
environment (STACK_* below); the README's tour uses the defaults. Logs go to STACK_DIR.

The gateway reaches the replicas as in a cluster: with the endpoint's gateway token (derived from
a secret written to STACK_DIR, as the operator does), never with the client's key; the replicas
trust the caller's name it sends next to that token. A setting for every replica is one entry in
`runtime_env` / `gateway_env`; a file they need goes in `write_files`.

NATS runs as the chart runs it: decentralised JWT authentication from an installation's keys
(STACK_DIR/nats-keys, made once by `llmendpoints-operator queue-auth keys`, kept so the stored
queue stays readable), each component with its own credential minted by the same command the
chart's init containers run -- the gateway's, the endpoint's for both replicas -- and the queue's
streams and the endpoint's consumers created with the operator's credential, as the operator
does (the others' may not). A client without a creds file is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENDPOINT = "demo"
ENDPOINT_ID = f"default/{ENDPOINT}"  # a static endpoint's namespace is "default"
STOP_GRACE_SECONDS = 20.0  # SIGTERM -> SIGKILL: a runtime drains, then stops its engine


@dataclass(frozen=True)
class StackConfig:
    model: Path
    state: Path  # logs, the queue's store, the gateway's files
    host: str = "127.0.0.1"
    nats_port: int = 4222
    replica_ports: tuple[int, ...] = (8001, 8002)
    gateway_port: int = 8080
    gateway_metrics_port: int = 9090
    tenant_key: str = "sk-tenant-a"
    tenant_rpm: int = 10
    admin_key: str = "sk-admin"
    max_model_len: int = 512
    ready_timeout: float = 600.0

    @classmethod
    def from_env(cls, env: dict[str, str]) -> StackConfig:
        ports = env.get("STACK_REPLICA_PORTS", "8001,8002")
        return cls(
            model=Path(env.get("STACK_MODEL", ROOT / ".cache" / "demo-model")).resolve(),
            state=Path(env.get("STACK_DIR", ROOT / ".cache" / "serve-stack")).resolve(),
            nats_port=int(env.get("STACK_NATS_PORT", "4222")),
            replica_ports=tuple(int(p) for p in ports.split(",") if p.strip()),
            gateway_port=int(env.get("STACK_GATEWAY_PORT", "8080")),
            gateway_metrics_port=int(env.get("STACK_GATEWAY_METRICS_PORT", "9090")),
            tenant_key=env.get("STACK_TENANT_KEY", "sk-tenant-a"),
            tenant_rpm=int(env.get("STACK_TENANT_RPM", "10")),
            admin_key=env.get("STACK_ADMIN_KEY", "sk-admin"),
            max_model_len=int(env.get("MAX_MODEL_LEN", "512")),
            ready_timeout=float(env.get("STACK_READY_TIMEOUT", "600")),
        )

    @property
    def nats_url(self) -> str:
        return f"nats://{self.host}:{self.nats_port}"

    def url(self, port: int) -> str:
        return f"http://{self.host}:{port}"


# ------------------------------------------------------------------ what each process gets


def base_env() -> dict[str, str]:
    """The caller's environment without settings that would change what the stack is."""
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("API_KEY", "ADMIN_API_KEY", "LLMEP_", "GATEWAY_", "JOBS_QUEUE", "SM_VLLM_")
        )
        and k not in ("MODEL_NAME", "HOST", "PORT", "ENDPOINT_ID", "KUBECONFIG")
    }
    keep.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return keep


def runtime_env(config: StackConfig, port: int, files: dict[str, Path]) -> dict[str, str]:
    return {
        "JOBS_QUEUE_CREDS_FILE": str(files["runtime_creds"]),
        **base_env(),
        "MODEL_NAME": str(config.model),
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "demo",
        "MAX_MODEL_LEN": str(config.max_model_len),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "HOST": config.host,
        "PORT": str(port),
        "JOBS_QUEUE_URL": config.nats_url,
        "ENDPOINT_ID": ENDPOINT,
        "GATEWAY_TOKEN_FILE": str(files["gateway_token"]),
        "LOG_FORMAT": "text",
    }


def gateway_env(config: StackConfig, files: dict[str, Path]) -> dict[str, str]:
    return {
        **base_env(),
        "HOST": config.host,
        "PORT": str(config.gateway_port),
        "GATEWAY_METRICS_PORT": str(config.gateway_metrics_port),
        "GATEWAY_TOKEN_SECRET_FILE": str(files["gateway_token_secret"]),
        "GATEWAY_ENDPOINTS_FILE": str(files["endpoints"]),
        "API_KEYS_FILE": str(files["keys"]),
        "JOBS_QUEUE_URL": config.nats_url,
        "JOBS_QUEUE_CREDS_FILE": str(files["gateway_creds"]),
        "GATEWAY_ID": "gateway-1",
        "LOG_FORMAT": "text",
    }


def write_files(config: StackConfig) -> dict[str, Path]:
    """The gateway's endpoints file and keys file (YAML, as docs/gateway.md describes them)."""
    config.state.mkdir(parents=True, exist_ok=True)
    endpoints = config.state / "endpoints.yaml"
    backends = [config.url(p) for p in config.replica_ports]
    # JSON is YAML: written without a YAML library.
    endpoints.write_text(
        json.dumps({"endpoints": [{"name": ENDPOINT, "models": ["demo"], "backends": backends}]})
    )
    keys = config.state / "keys.yaml"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {
                        "name": "tenant-a",
                        "key": config.tenant_key,
                        "endpoints": [ENDPOINT],
                        "limits": {"requestsPerMinute": config.tenant_rpm},
                    },
                    {"name": "ops", "key": config.admin_key, "admin": True},
                ]
            }
        )
    )
    keys.chmod(0o600)
    # The gateway token: the secret the gateway holds, and the endpoint's token the replicas
    # hold (in a cluster: the chart's Secret and the operator's <endpoint>-gateway-token).
    from llmendpoints_common import gateway_token

    secret_file = config.state / "gateway-token-secret"
    if not secret_file.is_file():
        secret_file.write_text(secrets.token_urlsafe(36))
    secret_file.chmod(0o600)
    token_file = config.state / "gateway-token"
    token_file.write_text(
        gateway_token.derive(gateway_token.read_secret(str(secret_file)), ENDPOINT_ID)
    )
    token_file.chmod(0o600)
    return {
        "endpoints": endpoints,
        "keys": keys,
        "gateway_token_secret": secret_file,
        "gateway_token": token_file,
        **queue_trust(config),
    }


def queue_auth(*args: str) -> None:
    """``llmendpoints-operator queue-auth ...``: what the chart's init containers run."""
    done = subprocess.run(
        [str(BIN / "llmendpoints-operator"), "queue-auth", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise StackError(f"queue-auth {args[0]}: {done.stderr.strip()}")


def queue_trust(config: StackConfig) -> dict[str, Path]:
    """The queue's keys (made once, kept), the server's trust (auth.conf) and a creds file for
    the gateway and one for the endpoint's replicas."""
    keys, creds = config.state / "nats-keys", config.state / "creds"
    if not (keys / "account-signing").is_file():
        queue_auth("keys", "--out-dir", str(keys))
    queue_auth("server-config", "--keys-dir", str(keys), "--out-dir", str(config.state))
    creds.mkdir(exist_ok=True)
    gateway, runtime = creds / "gateway.creds", creds / f"runtime-{ENDPOINT}.creds"
    queue_auth("creds", "--keys-dir", str(keys), "--role", "gateway", "--out", str(gateway))
    queue_auth(
        "creds", "--keys-dir", str(keys), "--role", "runtime", "--endpoint", ENDPOINT_ID,
        "--out", str(runtime),
    )  # fmt: skip
    return {"nats_keys": keys, "gateway_creds": gateway, "runtime_creds": runtime}


def provision_queue(config: StackConfig, keys: Path) -> None:
    """The streams and the endpoint's worker consumers, made as the operator makes them (its
    own credential, minted in memory): the gateway's and the replicas' may not create them."""
    import asyncio

    from llmendpoints_common.identity import EndpointRef
    from llmendpoints_common.queue.topology import QueueLayout
    from llmendpoints_common.queue.trust import Signer
    from llmendpoints_operator.jobs_queue import JobsQueue

    async def provision() -> None:
        queue = JobsQueue(config.nats_url, layout=QueueLayout(), signer=Signer.from_dir(keys))
        try:
            await queue.ensure_endpoint(EndpointRef(*ENDPOINT_ID.split("/")))
        finally:
            await queue.close()

    try:
        asyncio.run(provision())
    except Exception as exc:
        raise StackError(f"creating the queue's streams and consumers failed: {exc}") from exc


# ------------------------------------------------------------------ processes


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen | None = None

    def start(self) -> None:
        handle = self.log.open("ab")
        # Its own session and process group: a signal to the group reaches whatever it started
        # (vLLM's engine core, its workers), and a Ctrl-C at the terminal reaches only us.
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=handle,
            stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
        )  # fmt: skip
        handle.close()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Stack:
    config: StackConfig
    out: Callable[[str], None] = print
    children: list[Child] = field(default_factory=list)

    def _child(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        logs = self.config.state / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        child = Child(name, argv, env, logs / f"{name}.log")
        self.children.append(child)
        child.start()
        return child

    def start(self) -> None:
        config, began = self.config, time.monotonic()
        if not (config.model / "config.json").is_file():
            raise StackError(f"no model at {config.model} (make demo-model writes the demo model)")
        ports = (config.nats_port, config.gateway_port, config.gateway_metrics_port)
        for port in (*ports, *config.replica_ports):
            if not port_free(config.host, port):
                raise StackError(
                    f"port {port} on {config.host} is taken (STACK_*_PORT variables move the stack)"
                )
        files = write_files(config)
        store = config.state / "jetstream"
        nats_conf = config.state / "nats.conf"
        nats_conf.write_text(
            "max_payload: 33554432\n"  # /runsync bodies may be 20 MB
            f"jetstream {{ store_dir: {json.dumps(str(store))} }}\n"
            "include auth.conf\n"  # the installation's trust (queue_trust), as in the chart
        )
        self._child("nats", [str(BIN / "nats-server"), "-c", str(nats_conf),
                             "-a", config.host, "-p", str(config.nats_port)],
                    base_env())  # fmt: skip
        self._wait(lambda: port_open(config.host, config.nats_port), "nats-server", 30)
        provision_queue(config, files["nats_keys"])
        gateway = self._child(
            "gateway",
            [str(BIN / "llmendpoints-gateway"), "serve"],
            gateway_env(config, files),
        )
        # Staggered: the next replica starts once the previous one's server listens (its
        # imports are done and its engine is loading), so the two never import vLLM at once.
        for i, port in enumerate(config.replica_ports, 1):
            self._child(f"replica-{i}", [str(BIN / "llmendpoints-runtime"), "serve"],
                        runtime_env(config, port, files))  # fmt: skip
            self._wait(lambda port=port: answers(config.url(port)), f"replica {i}", 300)
        for i, port in enumerate(config.replica_ports, 1):
            self._wait(
                lambda port=port: ready(config.url(port)), f"replica {i}", config.ready_timeout
            )
            self.out(
                f"  replica {i} ready on {config.url(port)} ({time.monotonic() - began:.0f} s)"
            )
        self._wait(
            lambda: _gateway_ready_replicas(config) == len(config.replica_ports),
            "the gateway to see every replica", 30,
        )  # fmt: skip
        assert gateway.running
        self.out(f"  all up in {time.monotonic() - began:.0f} s")

    def _wait(self, predicate: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for child in self.children:
                if not child.running:
                    raise StackError(
                        f"{child.name} exited while waiting for {what}:\n{child.tail()}"
                    )
            if time.monotonic() > deadline:
                raise StackError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM every group (the gateway first: it stops taking requests), wait for the
        drains, SIGKILL whatever is left; reap every child."""
        for child in reversed(self.children):
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for child in reversed(self.children):
            if child.process is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.1, deadline - time.monotonic()))
        for child in self.children:
            child.signal_group(signal.SIGKILL)  # the group: an orphaned grandchild too
            if child.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(5)

    def banner(self) -> str:
        c = self.config
        replicas = "\n".join(
            f"  replica {i}   {c.url(p)}   (no key: 127.0.0.1 only)"
            for i, p in enumerate(c.replica_ports, 1)
        )
        return f"""
LLM Endpoints stack (demo model: random weights, gibberish answers)

  gateway     {c.url(c.gateway_port)}/v1            OpenAI API, model "demo"
              {c.url(c.gateway_port)}/v2/{ENDPOINT}       RunPod job API
              {c.url(c.gateway_metrics_port)}/metrics     its Prometheus metrics
{replicas}
  queue       {c.nats_url}   (a creds file needed)

  tenant key  {c.tenant_key}   (name tenant-a, {c.tenant_rpm} requests per minute)
  admin key   {c.admin_key}        (name ops)

  queue credentials (NATS JWT, one per role, as the chart mints them): {c.state / "creds"}
  usage:  JOBS_QUEUE_URL={c.nats_url} JOBS_QUEUE_CREDS_FILE={c.state / "creds" / "gateway.creds"} {BIN.relative_to(ROOT) if BIN.is_relative_to(ROOT) else BIN}/llmendpoints-gateway usage --since "$(date -u +%Y-%m-%dT00:00:00Z)"
  logs:   {c.state / "logs"}
  Ctrl-C stops everything.
"""


class StackError(Exception):
    pass


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
        return True
    return False


def answers(url: str) -> bool:
    """The server answers at all (/ready is 204 or 503 while the engine loads)."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready?strict=1", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _gateway_ready_replicas(config: StackConfig) -> int:
    try:
        metrics = config.url(config.gateway_metrics_port) + "/metrics"
        with urllib.request.urlopen(metrics, timeout=2) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return 0
    for line in text.splitlines():
        if line.startswith(f'llmendpoints_gateway_ready_replicas{{endpoint="{ENDPOINT_ID}"}}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def main() -> int:
    config = StackConfig.from_env(dict(os.environ))
    stack = Stack(config)
    stopping = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"serve-stack: starting (logs in {config.state / 'logs'}) ...", flush=True)
    try:
        stack.start()
        print(stack.banner(), flush=True)
        while all(child.running for child in stack.children):
            time.sleep(0.5)
        gone = next(child for child in stack.children if not child.running)
        print(f"serve-stack: {gone.name} exited; stopping the rest:\n{gone.tail()}", flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nserve-stack: stopping ...", flush=True)
        return 0
    except StackError as exc:
        print(f"serve-stack: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        print("serve-stack: stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())

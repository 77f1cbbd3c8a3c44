"""Each pod's readiness and engine load, read from its control port as often as routing needs.

Before (issue 33), every gateway process probed each static backend's main port twice a second
and read each replica's /metrics on its main port once a second, idle or not: 4.4 ms of CPU a
second in the gateway per replica, and 6.6 to 8.7 ms a second in each runtime's API process --
the very process that serves requests -- rendering /metrics for it; N worker processes did it N
times. Now:

**Where.** A runtime pod answers probes and /metrics on its control port (LLMEP_CONTROL_PORT),
from a small process of its own that serves what the API process publishes anyway
(runtime/control_listener.py): a read there costs the serving process nothing. Kubernetes: the
EndpointSlice's ``control`` port (discovery/kube.py). Static backends: learned from the pod --
the runtime names its control port in the ``x-llmep-control-port`` header of its main port's
/ready and /health answers, so the first probe of a backend (on its main port) learns it and
every later read goes there. A backend that names none (plain vLLM, another server) is probed
and read on its main port; a control port that stops answering is given up for
``CONTROL_RETRY_SECONDS`` (the main port meanwhile), so a pod whose control port is not
reachable from the gateway still serves.

**How often.** An endpoint is *active* while one of the pod's gateway processes has a request
of it in flight or held, and for ``activity grace`` seconds after (the next turn of a
conversation comes seconds later). Engine load (what the scorer weighs) is read every
``load_interval`` from the replicas of active endpoints, and not at all from idle ones: their
samples age out, and the first request after a quiet spell wakes the reader at once (its first
routing decisions weigh in-flight counts only, as with a sample too old). Readiness -- static
backends only; in Kubernetes the kubelet probes and the EndpointSlice tells -- is probed every
``idle_interval`` (the period of the readiness probe the operator gives its pods: readiness is
never staler than in Kubernetes), and every ``probe_interval`` for a backend that is not ready
while its endpoint is active or holds requests (a scale-up from zero). A request that finds a
replica gone routes around it at once (registry.mark_failed), so readiness need not be polled
fast for that.

**Once per gateway pod.** With GATEWAY_WORKERS > 1 one worker reads -- whichever holds the lock
of the pod's board (pod_board.py) -- and publishes what it read there; the others follow the
board, and tell the reader through it when their endpoints are active. Without workers the
process is its own reader.

Reads carry ``user-agent: llmendpoints-gateway-reader (pid N)``: a pod can tell who reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from llmendpoints_gateway.engine_load import (
    MAX_BODY_BYTES,
    EngineLoad,
    EngineMetricsError,
    load_from_json,
    load_to_json,
    parse_engine_metrics,
)
from llmendpoints_gateway.pod_board import Activity, PodBoard, slot_of
from llmendpoints_gateway.upstream import UpstreamError, UpstreamPool, describe

logger = logging.getLogger("llmendpoints.gateway.pods")

CONTROL_PORT_HEADER = b"x-llmep-control-port"
ANSWER_AGE_HEADER = b"x-llmep-answer-age-ms"
CONTROL_RETRY_SECONDS = 60.0
MAX_PROBE_BYTES = 64 * 1024
PROBE_TIMEOUTS = 2  # probes in a row that time out before a ready backend is not ready
USER_AGENT = f"llmendpoints-gateway-reader (pid {os.getpid()})"


class PodSource(Protocol):
    """What the reader asks the registry (registry.Registry)."""

    def engine_targets(self) -> list[str]: ...

    def control_url(self, replica: str) -> str | None: ...

    def active_replicas(self, now: float) -> set[str]: ...

    def engine_sampled(
        self, replica: str, previous: EngineLoad | None, new: EngineLoad
    ) -> None: ...


@dataclass
class Pod:
    url: str  # the main port's base URL (the replica)
    control: str | None = None  # the control port's base URL, when known
    control_retry_at: float = 0.0  # a control port that failed: the main port until then
    load: EngineLoad | None = None
    ready: bool | None = None  # static backends: the last probe's answer
    last_probe: float = -math.inf
    last_load: float = -math.inf
    failures: int = 0
    error: str | None = None
    timed_out: bool = False  # the last read did not answer in time
    timeouts: int = 0  # probes in a row that did

    def base(self, now: float) -> str:
        if self.control is not None and now >= self.control_retry_at:
            return self.control
        return self.url


@dataclass
class Watch:
    """A static backend whose readiness this gateway probes, for the endpoints listing it."""

    endpoints: set[str] = field(default_factory=set)
    on_ready: list[Callable[[str, bool], None]] = field(default_factory=list)


class PodReader:
    """Reads the pods (as the pod's reader) or follows the board (as another worker). Start
    with ``start()``; the request path reads ``get``."""

    def __init__(
        self,
        source: PodSource,
        activity: Activity,
        *,
        load_interval: float,
        probe_interval: float,
        idle_interval: float,
        board: PodBoard | None = None,
        timeout: float = 2.0,
        concurrency: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.activity = activity
        self.load_interval = load_interval
        self.probe_interval = probe_interval
        self.idle_interval = idle_interval
        self.board = board
        self.timeout = timeout
        self.clock = clock
        self.pods: dict[str, Pod] = {}
        self.watched: dict[str, Watch] = {}
        self.reads = 0  # HTTP reads made (tests, bench)
        self._limit = asyncio.Semaphore(concurrency)
        self._pool = UpstreamPool(timeout)
        self._wake = asyncio.Event()
        self._board_seq = 0
        self._task: asyncio.Task | None = None
        self._watching_fd = False
        activity.on_busy.append(self._wake.set)

    # -- what the rest of the gateway calls --

    def get(self, replica: str) -> EngineLoad | None:
        pod = self.pods.get(replica)
        return pod.load if pod is not None else None

    def loads(self) -> dict[str, EngineLoad]:
        return {url: pod.load for url, pod in self.pods.items() if pod.load is not None}

    def errors(self) -> dict[str, str]:
        return {url: pod.error for url, pod in self.pods.items() if pod.error}

    def watch(self, endpoint: str, backend: str, on_ready: Callable[[str, bool], None]) -> None:
        """Static discovery: probe ``backend``'s readiness for ``endpoint``; ``on_ready(backend,
        ready)`` on every change (and on the first answer)."""
        watch = self.watched.setdefault(backend, Watch())
        watch.endpoints.add(endpoint)
        watch.on_ready.append(on_ready)
        self.pods.setdefault(backend, Pod(backend))
        self._wake.set()

    @property
    def leading(self) -> bool:
        return self.board is None or self.board.leading

    async def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._unwatch_fd()
        await self._pool.close()

    async def run(self) -> None:
        while True:
            try:
                if self.board is None or self.board.try_lead():
                    self._watch_fd()
                    delay = await self.lead_once()
                else:
                    delay = self.follow_once()
            except Exception:  # a bug must not end the reading
                logger.exception("reading the pods failed")
                delay = self.idle_interval
            await self._sleep(delay)

    async def _sleep(self, delay: float) -> None:
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
        self._wake.clear()

    # -- the reader --

    async def lead_once(self) -> float:
        """Read what is due; the seconds until the next read is."""
        now = self.clock()
        targets = self._sync()
        active = self.source.active_replicas(now)
        reads = []
        for pod in self.pods.values():
            probe = pod.url in self.watched and now >= self._probe_due(pod, now)
            load = pod.url in targets and now >= self._load_due(pod, active)
            if probe or load:
                reads.append(self._read(pod, probe=probe, load=load))
        changed = any(await asyncio.gather(*reads)) if reads else False
        if changed and self.board is not None:
            self.board.publish(self._blob())
        now = self.clock()
        due = min(
            [self._probe_due(p, now) for p in self.pods.values() if p.url in self.watched]
            + [self._load_due(p, active) for p in self.pods.values() if p.url in targets],
            default=math.inf,
        )
        return min(max(due - now, 0.0), self.idle_interval)

    def _sync(self) -> set[str]:
        """The pods to read: the registry's replicas (their control URLs from discovery) and
        the watched static backends; departed ones are forgotten."""
        targets = set(self.source.engine_targets())
        for url in targets:
            pod = self.pods.setdefault(url, Pod(url))
            control = self.source.control_url(url)
            if control is not None:
                pod.control = control
        for url in [u for u in self.pods if u not in targets and u not in self.watched]:
            del self.pods[url]
        return targets

    def _probe_due(self, pod: Pod, now: float) -> float:
        watch = self.watched[pod.url]
        urgent = pod.ready is not True and any(
            self.activity.active(slot_of(ep), now) for ep in watch.endpoints
        )
        return pod.last_probe + (self.probe_interval if urgent else self.idle_interval)

    def _load_due(self, pod: Pod, active: set[str]) -> float:
        if self.load_interval <= 0 or pod.url not in active:
            return math.inf
        return pod.last_load + self.load_interval

    async def _read(self, pod: Pod, *, probe: bool, load: bool) -> bool:
        """One pod's due reads; True when what the followers know changed."""
        async with self._limit:
            changed = False
            if probe:
                changed |= await self._probe(pod)
            if load and (pod.ready is not False or pod.url not in self.watched):
                changed |= await self._load(pod)
            return changed

    async def _probe(self, pod: Pod) -> bool:
        pod.last_probe = now = self.clock()
        status, headers, _ = await self._get(pod, "/ready?strict=1", MAX_PROBE_BYTES)
        if self._control_refused(pod, status, now):
            status, headers, _ = await self._get(pod, "/ready?strict=1", MAX_PROBE_BYTES)
        learned = self._learn_control(pod, headers)
        ready = status == 200
        # A probe that timed out counts against readiness at the second in a row (the
        # operator's readinessProbe failureThreshold); an answer or a refusal at once.
        pod.timeouts = pod.timeouts + 1 if pod.timed_out else 0
        if pod.timed_out and pod.ready and pod.timeouts < PROBE_TIMEOUTS:
            ready = True
        if ready == pod.ready:
            return learned
        logger.info(
            "backend %s is %s%s", pod.url, "ready" if ready else "not ready",
            f" (control port {pod.control})" if pod.control else "",
        )  # fmt: skip
        pod.ready = ready
        for on_ready in self.watched[pod.url].on_ready:
            on_ready(pod.url, ready)
        return True

    def _learn_control(self, pod: Pod, headers: dict[bytes, bytes]) -> bool:
        """A static backend names its control port: read there from now on."""
        value = headers.get(CONTROL_PORT_HEADER)
        if value is None or pod.control is not None:
            return False
        try:
            port = int(value)
        except ValueError:
            return False
        if not 0 < port < 65536:
            return False
        parts = urlsplit(pod.url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        pod.control = f"{parts.scheme}://{host}:{port}"
        logger.info("backend %s: probes and engine load on its control port %d", pod.url, port)
        return True

    def _control_refused(self, pod: Pod, status: int | None, asked_at: float) -> bool:
        """The control port could not be reached (not merely slow: a pod too busy to answer
        there answers no better on its main port): the main port for a while."""
        if status is not None or pod.timed_out or pod.base(asked_at) != pod.control:
            return False
        pod.control_retry_at = self.clock() + CONTROL_RETRY_SECONDS
        logger.warning(
            "backend %s: its control port %s does not answer; its main port for %.0f s",
            pod.url, pod.control, CONTROL_RETRY_SECONDS,
        )  # fmt: skip
        return True

    async def _load(self, pod: Pod) -> bool:
        pod.last_load = now = self.clock()
        status, headers, body = await self._get(pod, "/metrics", MAX_BODY_BYTES)
        if self._control_refused(pod, status, now):
            status, headers, body = await self._get(pod, "/metrics", MAX_BODY_BYTES)
        try:
            if status != 200:
                raise EngineMetricsError(pod.error if status is None else f"HTTP {status}")
            age = _age_seconds(headers)
            load = parse_engine_metrics(body.decode("utf-8", "replace"), self.clock() - age)
        except EngineMetricsError as exc:
            pod.failures += 1
            pod.error = str(exc) or type(exc).__name__
            if pod.failures == 1 or pod.failures % 60 == 0:
                logger.info("engine load of %s not read: %s", pod.url, pod.error)
            return False
        self._sampled(pod, load)
        return True

    def _sampled(self, pod: Pod, load: EngineLoad) -> None:
        previous, pod.load, pod.error, pod.failures = pod.load, load, None, 0
        self.source.engine_sampled(pod.url, previous, load)

    async def _get(
        self, pod: Pod, path: str, limit: int
    ) -> tuple[int | None, dict[bytes, bytes], bytes]:
        """(status, headers, body); status None when the pod did not answer (pod.error)."""
        base = pod.base(self.clock())
        self.reads += 1
        pod.timed_out = False
        try:
            return await fetch(self._pool, base, path, self.timeout, limit)
        except (UpstreamError, TimeoutError) as exc:
            pod.timed_out = isinstance(exc, TimeoutError)
            pod.error = f"{base}{path}: {describe(exc)}"
            return None, {}, b""

    # -- the board --

    def _blob(self) -> bytes:
        return json.dumps(
            {
                url: {
                    "ready": pod.ready,
                    "control": pod.control,
                    "load": load_to_json(pod.load) if pod.load is not None else None,
                }
                for url, pod in self.pods.items()
            },
            separators=(",", ":"),
        ).encode()

    def follow_once(self) -> float:
        """Take what the reader published; the seconds until the next look."""
        assert self.board is not None
        seq, blob = self.board.read(self._board_seq)
        if blob is not None:
            self._board_seq = seq
            self._apply(json.loads(blob))
        now = self.clock()
        held = self.activity.locally_active(now)
        return self.probe_interval if held else self.idle_interval

    def _apply(self, published: dict) -> None:
        for url, seen in published.items():
            pod = self.pods.setdefault(url, Pod(url))
            pod.control = seen.get("control") or pod.control
            load = seen.get("load")
            if load is not None and (pod.load is None or pod.load.taken_at != load["taken_at"]):
                self._sampled(pod, load_from_json(load))
            ready = seen.get("ready")
            if ready is not None and ready != pod.ready and url in self.watched:
                pod.ready = ready
                for on_ready in self.watched[url].on_ready:
                    on_ready(url, ready)

    def _watch_fd(self) -> None:
        """The reader wakes when any worker's endpoint turns busy (the pod's eventfd)."""
        if self._watching_fd:
            return
        loop = asyncio.get_running_loop()

        def woken() -> None:
            self.activity.drain_wake()
            self._wake.set()

        loop.add_reader(self.activity.wake_fd, woken)
        self._watching_fd = True

    def _unwatch_fd(self) -> None:
        if self._watching_fd:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.activity.wake_fd)
            self._watching_fd = False


def _age_seconds(headers: dict[bytes, bytes]) -> float:
    """How old the control port says its answer is (0 on the main port: rendered now)."""
    try:
        return max(0.0, float(headers.get(ANSWER_AGE_HEADER, b"0")) / 1000)
    except ValueError:
        return 0.0


async def fetch(
    pool: UpstreamPool, base: str, path: str, timeout: float, limit: int
) -> tuple[int, dict[bytes, bytes], bytes]:
    """GET ``base + path`` on the pool's keep-alive connections (the control port closes each
    one after its answer): (status, headers, body). UpstreamError or TimeoutError when it
    fails, the body exceeds ``limit`` or takes longer than ``timeout``."""
    _, _, host = pool.address(base)
    request = (
        b"GET " + path.encode("latin-1") + b" HTTP/1.1\r\nhost: " + host
        + b"\r\nuser-agent: " + USER_AGENT.encode() + b"\r\n\r\n"
    )  # fmt: skip
    async with asyncio.timeout(timeout):
        for attempt in range(2):
            conn = await pool.connect(base)
            try:
                conn.send(request)
                try:
                    await conn.head()
                except UpstreamError as exc:
                    if exc.stale and attempt == 0:
                        continue  # a kept connection the pod had closed: once more, fresh
                    raise
                return conn.status, dict(conn.headers), await _body(conn, limit)
            finally:
                conn.finish()
    raise AssertionError("unreachable")


async def _body(conn, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    done = asyncio.get_running_loop().create_future()

    def sink(chunk: bytes) -> None:
        nonlocal size
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)

    def end() -> None:
        if not done.done():
            done.set_result(None)

    conn.attach(sink, end)
    if not (conn.complete or conn.error):
        await done
    if conn.error is not None:
        raise conn.error
    if size > limit:
        raise UpstreamError(f"answer larger than {limit} bytes")
    return b"".join(chunks)

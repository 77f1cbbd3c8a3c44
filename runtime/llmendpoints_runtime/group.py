"""A group's liveness channel: the leader knows at once when a worker is gone, and a worker
when its leader is.

vLLM's multi-node launch does not notice a lost node (seen with vLLM 0.32's mp executor, gloo
over loopback: with the worker's processes SIGKILLed, the leader kept answering 200 and a
completion hung). Its own signals are no help here: the mp executor's worker monitor watches
only the local workers' process sentinels, the remote ones answer through a message queue that
simply stays silent, and torch.distributed's collective timeouts (gloo's default is 30 minutes)
are far beyond what a load balancer waits. So the runtime keeps a channel of its own: every
worker holds a TCP connection to its leader (``LLMEP_MULTINODE_PORT`` + 2) and both ends send
a beat every ``interval`` seconds.

- A process that dies closes its connection (the kernel does it, even after SIGKILL or an OOM
  kill): the other end reads EOF and knows within milliseconds.
- A node that vanishes (power, network) sends nothing: the other end gives up after
  ``timeout`` seconds without a line (LLMEP_GROUP_TIMEOUT_SECONDS, default 20).

The leader counts a worker in once it has said ``HELLO <rank>``; from then on its loss is the
group's loss (LeaderWorkerSet's RecreateGroupOnPodRestart then recreates the group whole). The leader's beats carry its engine's state, so a worker's readiness follows the
group's. A leader that gives up says why (``STOP <reason>``) before it closes.

Lines, ASCII: ``HELLO <rank>``, ``BEAT <state>``, ``STOP <reason>``. Both ends run in a
thread of their own with its own event loop, off the API process's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("llmendpoints.group")

MAX_LINE = 512
CONNECT_RETRY_SECONDS = 1.0
WAITING_LOG_EVERY = 10.0

# Called once, from the channel's thread, with what was lost.
OnLost = Callable[[str], None]


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def beat_interval(timeout: float) -> float:
    """Beats often enough that ``timeout`` spans several of them."""
    return max(0.2, min(2.0, timeout / 5))


def encode(kind: str, text: str = "") -> bytes:
    line = f"{kind} {text}".strip().replace("\n", " ").replace("\r", " ")
    return (line[: MAX_LINE - 1] + "\n").encode("ascii", "replace")


def decode(line: bytes) -> tuple[str, str]:
    """(kind, rest) of a line; ("", "") for an empty or unreadable one (pure)."""
    text = line.decode("ascii", "replace").strip()
    kind, _, rest = text.partition(" ")
    return kind.upper(), rest


@dataclass
class Members:
    """The leader's view of its workers (pure: the caller gives the time)."""

    nodes: int
    joined: dict[int, float] = field(default_factory=dict)  # rank -> last heard
    lost: str | None = None

    def hello(self, rank: int, now: float) -> str | None:
        """A worker said HELLO: None when it joins, else why it is turned away. A rank that
        joined already is not taken twice: if its first connection's process died, that
        connection's end is the loss; if it did not, the second is not ours."""
        if not 0 < rank < self.nodes:
            return f"worker index {rank} is outside this group of {self.nodes}"
        if rank in self.joined:
            return f"worker {rank} joined already"
        self.joined[rank] = now
        return None

    def heard(self, rank: int, now: float) -> None:
        if rank in self.joined:
            self.joined[rank] = now

    def silent(self, now: float, timeout: float) -> str | None:
        """The first worker not heard from for ``timeout`` seconds, as a loss."""
        for rank, seen in sorted(self.joined.items()):
            if now - seen > timeout:
                return f"worker {rank} sent nothing for {now - seen:.0f} s (node lost?)"
        return None

    @property
    def complete(self) -> bool:
        return len(self.joined) == self.nodes - 1


class _Channel:
    """The thread and loop both ends run in, and the single call of ``on_lost``."""

    def __init__(self, name: str, timeout: float, on_lost: OnLost) -> None:
        self.timeout = timeout
        self.interval = beat_interval(timeout)
        self._on_lost = on_lost
        self._lost: str | None = None
        self._goodbye: str | None = None
        self._lost_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def lost(self) -> str | None:
        return self._lost

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)

    def stop(self, reason: str | None = None) -> None:
        """Close the channel, telling the other end ``reason``. From any thread."""
        self._goodbye = reason
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stopped.set)
        self._thread.join(5)

    def _declare(self, what: str) -> None:
        with self._lost_lock:
            if self._lost is not None:
                return
            self._lost = what
        logger.error("group: %s", what)
        try:
            self._on_lost(what)
        except Exception:
            logger.exception("group: handling the loss failed")

    async def _line(self, reader: asyncio.StreamReader, peer: str) -> bytes | None:
        """The peer's next line; None, the loss declared, when there is none in time or its
        connection ended."""
        try:
            line = await asyncio.wait_for(reader.readline(), self.timeout)
        except TimeoutError:
            self._declare(f"{peer} sent nothing for {self.timeout:.0f} s (node lost?)")
            return None
        except OSError as exc:
            self._declare(f"{peer} is gone (its connection broke: {_why(exc)})")
            return None
        if not line:
            self._declare(f"{peer} is gone (its connection closed)")
            return None
        return line

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        try:
            await self._serve()
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        raise NotImplementedError


class LeaderChannel(_Channel):
    """The leader's end: listens for its ``nodes - 1`` workers on host:port.

    ``state()`` is put in every beat (the engine's state: initializing, ready, failed).
    ``on_lost`` is called once, in this channel's thread, when a worker is gone."""

    def __init__(
        self,
        host: str,
        port: int,
        nodes: int,
        *,
        timeout: float,
        on_lost: OnLost,
        state: Callable[[], str] = lambda: "initializing",
    ) -> None:
        super().__init__("llmep-group-leader", timeout, on_lost)
        self.host, self.port = host, port
        self.members = Members(nodes)
        self.state = state
        self._writers: list[asyncio.StreamWriter] = []
        self.listen_error: OSError | None = None

    def start(self) -> None:
        """Listening when it returns; OSError when the port cannot be had."""
        super().start()
        if self.listen_error is not None:
            raise self.listen_error

    async def _serve(self) -> None:
        try:
            server = await asyncio.start_server(self._member, self.host, self.port)
        except OSError as exc:
            self.listen_error = exc
            return
        self._ready.set()
        logger.info(
            "group: waiting for %d worker(s) on %s:%d", self.members.nodes - 1, self.host, self.port
        )
        assert self._stopped is not None
        async with server:
            watch = asyncio.create_task(self._watch())
            await self._stopped.wait()
            watch.cancel()
            for writer in self._writers:
                with contextlib.suppress(Exception):
                    writer.write(encode("STOP", self._goodbye or self.lost or "the leader stopped"))
                    writer.close()

    async def _watch(self) -> None:
        """Beats to every worker; a worker silent for ``timeout`` is lost."""
        while True:
            await asyncio.sleep(self.interval)
            if (silent := self.members.silent(time.monotonic(), self.timeout)) is not None:
                self._declare(silent)
            line = encode("BEAT", self.state())
            for writer in list(self._writers):
                with contextlib.suppress(Exception):
                    writer.write(line)

    async def _member(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank = await self._greeted(reader)
        if rank is None:
            writer.close()
            return
        if (refused := self.members.hello(rank, time.monotonic())) is not None:
            logger.warning("group: a connection saying HELLO %d turned away: %s", rank, refused)
            writer.close()
            return
        logger.info(
            "group: worker %d joined (%d of %d)",
            rank,
            len(self.members.joined),
            self.members.nodes - 1,
        )
        self._writers.append(writer)
        writer.write(encode("BEAT", self.state()))
        await self._follow(rank, reader)
        self._writers.remove(writer)
        writer.close()

    async def _greeted(self, reader: asyncio.StreamReader) -> int | None:
        with contextlib.suppress(TimeoutError, OSError, ValueError):
            kind, rest = decode(await asyncio.wait_for(reader.readline(), self.timeout))
            if kind == "HELLO":
                return int(rest.split()[0])
        return None  # not one of ours (a port scan, a probe): ignored

    async def _follow(self, rank: int, reader: asyncio.StreamReader) -> None:
        while True:
            line = await self._line(reader, f"worker {rank}")
            if line is None:
                return
            kind, rest = decode(line)
            self.members.heard(rank, time.monotonic())
            if kind == "STOP":
                self._declare(f"worker {rank} stopped: {rest}")
                return


class WorkerChannel(_Channel):
    """A worker's end: connects to the leader (retrying until it answers), says HELLO, and
    beats. ``on_lost`` is called once when the leader is gone; ``leader_state`` is what its
    last beat said (None before the first)."""

    def __init__(
        self, leader: str, port: int, rank: int, *, timeout: float, on_lost: OnLost
    ) -> None:
        super().__init__("llmep-group-worker", timeout, on_lost)
        self.leader, self.port, self.rank = leader, port, rank
        self.leader_state: str | None = None
        self.connected = False

    async def _serve(self) -> None:
        self._ready.set()
        assert self._stopped is not None
        connection = await self._connect()
        if connection is None:
            return  # stopped before the leader answered
        reader, writer = connection
        self.connected = True
        logger.info(
            "group: joined the leader at %s:%d as worker %d", self.leader, self.port, self.rank
        )
        tasks = [
            asyncio.create_task(self._beat(writer)),
            asyncio.create_task(self._follow(reader)),
            asyncio.create_task(self._stopped.wait()),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            if self.lost is None:
                writer.write(encode("STOP", self._goodbye or "the worker stopped"))
            writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        assert self._stopped is not None
        began = last_log = time.monotonic()
        while not self._stopped.is_set():
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.leader, self.port), self.timeout
                )
                writer.write(encode("HELLO", str(self.rank)))
                return reader, writer
            except (OSError, TimeoutError) as exc:
                now = time.monotonic()
                if now - last_log >= WAITING_LOG_EVERY:
                    last_log = now
                    logger.info(
                        "group: waiting for the leader at %s:%d (%.0f s: %s)",
                        self.leader,
                        self.port,
                        now - began,
                        exc,
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), CONNECT_RETRY_SECONDS)
        return None

    async def _beat(self, writer: asyncio.StreamWriter) -> None:
        while True:
            await asyncio.sleep(self.interval)
            writer.write(encode("BEAT", "ok"))
            await writer.drain()

    async def _follow(self, reader: asyncio.StreamReader) -> None:
        while True:
            line = await self._line(reader, "the leader")
            if line is None:
                return
            kind, rest = decode(line)
            if kind == "STOP":
                self._declare(f"the leader stopped the group: {rest}")
                return
            if kind == "BEAT":
                self.leader_state = rest or None

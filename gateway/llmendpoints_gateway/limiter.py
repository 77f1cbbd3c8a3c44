"""Per-key limits enforced across every gateway replica, on the shared NATS (JOBS_QUEUE_URL).

Each key name (tenant) with limits has one value in the key-value bucket ``LLMEP_QUOTAS``
(quotas.QuotaState: the minute window's request and token counts, the concurrency leases). It
changes only by compare-and-set: a write carries the revision it was computed from
(``Nats-Expected-Last-Subject-Sequence``), so two replicas never both take the last slot --
there is no overshoot of requestsPerMinute or maxConcurrent; tokensPerMinute overshoots by what
requests already admitted report (quotas.py).

Cost on the request path:

- a key without limits: nothing (no NATS, no lock);
- any key with limits while the limits are this replica's own (no JOBS_QUEUE_URL, or NATS
  away): admitted and settled on the spot, no future or task per request (measured,
  bench/key_path.py: a task per ended request was most of a keyed request's extra cost);
- a key with requestsPerMinute / tokensPerMinute only: usually none. A replica that writes an
  admission also takes an allowance (quotas.admit_shared): a share of what is left of the
  minute's requests (quotas.reservation: 1/8 of it, at most 32) and, when the request reserves
  tokens, of its tokens (quotas.token_block: 1/8, at most 32 such reservations); none near the
  limit. It admits the next requests from that allowance without a round trip, and settles
  them there when they end (quotas.settle_locally: unused tokens back, an excess taken; only
  what the allowance cannot cover is written). The allowance counts in the shared state when
  taken; a replica that dies loses what it held, until that minute ends;
- a key with maxConcurrent, or whose allowance is used up: one publish round trip in the usual
  case. Every replica follows the bucket (an ordered consumer delivering each change), so its
  cached revision is the latest and the write wins the first time; a write that loses re-reads
  and retries. Admissions of one key on one replica are group-committed: those arriving while a
  write is in flight go in the next write together, so a burst costs a few round trips, not one
  per request;
- a request refused for requestsPerMinute / tokensPerMinute: decided on the cached value (a
  window's counts only grow, so a stale cache never refuses wrongly); maxConcurrent re-reads
  once before refusing (a slot may have been freed elsewhere).

Ending a request (its lease released, its tokens charged) happens after the answer is sent, in
the background. Leases are renewed every LEASE_RENEW_SECONDS while their request runs, so a
replica that dies frees its slots within LEASE_TTL_SECONDS.

When NATS is unreachable the replica enforces the limits on its own state (each replica then
admits up to the limit: the fleet up to N times it) rather than refusing every request; it
logs that it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmendpoints_common.errors import RateLimitError
from llmendpoints_common.queue import names
from llmendpoints_edge.asgi import Message, Send
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from llmendpoints_gateway.keys import Key
from llmendpoints_gateway.queue import SharedQueue
from llmendpoints_gateway.quotas import (
    LEASE_RENEW_SECONDS,
    Allowance,
    Denied,
    Limits,
    QuotaState,
    admit_locally,
    admit_shared,
    denial_message,
    finish,
    own_view,
    rate_headers,
    renew,
    reserved_tokens,
    settle_locally,
    too_large,
)
from llmendpoints_gateway.request import RequestLog

logger = logging.getLogger("llmendpoints.gateway.limiter")

_WRONG_LAST_SEQUENCE = 10071
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
# One write to the bucket may take this long before the replica decides on its own state.
WRITE_TIMEOUT_SECONDS = 2.0
MAX_CACHED_NAMES = 10_000  # key names whose bucket token is kept (cleared beyond)

# op(state, now) -> (new state, result, changed)
Op = Callable[[QuotaState, float], tuple[QuotaState, Any, bool]]


@dataclass
class Ticket:
    """An admitted request of a key with limits."""

    name: str
    limits: Limits
    lease: str | None
    headers: list[tuple[bytes, bytes]]
    finished: bool = False
    reserved: int = 0  # tokens reserved at admission (settled when it ends)
    window: int | None = None  # the minute it was admitted in
    local: bool = False  # its tokens came from this replica's allowance (settled there)


class _Pending:
    def __init__(self) -> None:
        self.ops: list[tuple[Op, asyncio.Future]] = []
        self.running = False


class Limiter:
    def __init__(
        self,
        gateway_id: str,
        queue: SharedQueue | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ):
        self.gateway_id = gateway_id
        self.queue = queue
        self.clock = clock
        # Lease ids are unique across replicas and restarts (two replicas may share a name).
        self._lease_prefix = f"{gateway_id}.{os.urandom(4).hex()}"
        self._lease_ids = itertools.count(1)
        self._local: dict[str, QuotaState] = {}
        self._cache: dict[str, tuple[QuotaState, int]] = {}
        self._pending: dict[str, _Pending] = {}
        self._held: dict[str, set[str]] = {}  # tenant token -> leases this replica holds
        self._names: dict[str, str] = {}  # tenant token -> key name (for renewals)
        self._js: Any = None  # the bucket's JetStream context, once the queue is connected
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._watch = None
        self._fallback_logged = False
        self.round_trips = 0  # bucket writes and reads made (bench, tests)
        self.local_admissions = 0  # admitted from a reservation, no round trip
        self.local_settlements = 0  # ended requests settled in the allowance, no round trip
        # tenant token -> what this replica holds of the key's minute and has not used yet
        self._allowance: dict[str, Allowance] = {}
        self._taking: dict[str, Allowance] = {}  # taken by the ops of the write being computed
        self._tokens: dict[str, str] = {}  # key name -> its token (quota_key: a sha256)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.queue is not None:
            self._tasks.append(asyncio.create_task(self._follow(self.queue)))
        self._tasks.append(asyncio.create_task(self._renew_forever()))

    async def stop(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await self._watch.unsubscribe()

    @property
    def pending(self) -> int:
        return len(self._background)

    @property
    def shared(self) -> bool:
        """True when the limits are enforced with the other replicas (NATS reachable)."""
        return self._js is not None and self.queue is not None and self.queue.connected

    async def _follow(self, queue: SharedQueue) -> None:
        """Follow the bucket once the queue is connected (an ordered consumer: every change
        of every key's state, so the cached revisions are the latest)."""
        connection = await queue.wait()
        js = connection.nc.jetstream(timeout=WRITE_TIMEOUT_SECONDS)
        while True:
            try:
                self._watch = await js.subscribe(
                    names.kv_subject(names.QUOTAS_BUCKET, ">"),
                    ordered_consumer=True,
                    deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                    cb=self._on_change,
                )
            except Exception as exc:
                logger.warning("cannot follow the limits bucket (%s); retrying", exc)
                await asyncio.sleep(2.0)
                continue
            self._js = js
            logger.info("per-key limits shared through the bucket %s", names.QUOTAS_BUCKET)
            return

    async def _on_change(self, msg) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        seq = msg.metadata.sequence.stream
        have = self._cache.get(token)
        if have is not None and have[1] >= seq:
            return
        operation = (msg.headers or {}).get("KV-Operation")
        state = QuotaState() if operation in ("DEL", "PURGE") else QuotaState.decode(msg.data)
        self._cache[token] = (state, seq)

    # ------------------------------------------------------------------ the request path

    async def admit(
        self,
        key: Key,
        *,
        hold: bool = True,
        tokens: int = 0,
        asked: int = 0,
        asked_field: str | None = None,
    ) -> Ticket | None:
        """Count one request of ``key`` (and hold a concurrency lease while it runs when
        ``hold``; reserve ``tokens`` of tokensPerMinute, settled by ``finish``); None for a key
        without limits. Over a limit: RateLimitError (429) naming the limit and the key's name,
        with Retry-After and the x-ratelimit-* headers. A request whose ``asked_field`` asks
        for more completion tokens (``asked``) than the key's whole tokensPerMinute: 429 at
        once, counting nothing, telling clients not to retry (``x-should-retry``, which the
        openai SDKs honour)."""
        limits = key.limits
        if not limits.any:
            return None
        refusal = too_large(key.name, limits, asked, asked_field)
        if refusal is not None:
            raise RateLimitError(
                refusal,
                param=asked_field,
                code="rate_limit_exceeded",
                headers={"x-should-retry": "false"},
            )
        token = self._token(key.name)
        self._names[token] = key.name
        lease = (
            f"{self._lease_prefix}.{next(self._lease_ids)}"
            if hold and limits.max_concurrent is not None
            else None
        )
        reserved = reserved_tokens(limits, tokens)
        # Without a lease, an admission is taken from this replica's allowance (requests and
        # tokens already counted in the shared state) when it covers it: no round trip.
        reserve = lease is None and self.shared
        if reserve and (ticket := self._admit_locally(key.name, token, limits, reserved)):
            return ticket

        def op(state: QuotaState, now: float) -> tuple[QuotaState, Any, bool]:
            # The allowance with what earlier ops of the same write took: a burst committed
            # in one write takes one allowance, not one per request.
            held = self._allowance.get(token)
            taking = self._taking.get(token)
            if taking is not None:
                held = held.add(taking) if held is not None else taking
            after, denied, extra, view = admit_shared(
                state, limits, now, lease, reserved, held, reserve
            )
            if extra.requests or extra.tokens:
                self._taking[token] = taking.add(extra) if taking is not None else extra
            return after, (denied, rate_headers(view, limits, now), extra), (denied is None)

        if self._decided_here(token):
            denied, headers, extra = self._apply_local(token, [op])[0]
        else:
            denied, headers, extra = await self._submit(token, op)
        if denied is not None:
            raise _rate_limited(key.name, limits, denied, headers)
        if extra.requests or extra.tokens:
            held = self._allowance.get(token)
            self._allowance[token] = held.add(extra) if held is not None else extra
        if lease is not None:
            self._held.setdefault(token, set()).add(lease)
        return Ticket(key.name, limits, lease, headers, reserved=reserved, window=extra.window)

    def _token(self, name: str) -> str:
        """The key name's token in the bucket (a hash: computed once per name)."""
        token = self._tokens.get(name)
        if token is None:
            if len(self._tokens) >= MAX_CACHED_NAMES:
                self._tokens.clear()
            token = self._tokens[name] = names.quota_key(name)
        return token

    def _admit_locally(self, name: str, token: str, limits: Limits, reserved: int) -> Ticket | None:
        """Admit with no round trip when this replica's copy of the state (it follows the
        bucket) and its allowance allow it (quotas.admit_locally). None: decide by a write."""
        cached = self._cache.get(token)
        if cached is None:
            return None
        now = self.clock()
        state = cached[0].current(now)
        held = self._allowance.get(token)
        after = admit_locally(state, held, limits, reserved)
        if after is None:
            return None
        self._allowance[token] = after
        if limits.requests_per_minute is not None or reserved:
            self.local_admissions += 1
        headers = rate_headers(own_view(state, after), limits, now)
        return Ticket(
            name, limits, None, headers, reserved=reserved, window=state.window, local=reserved > 0
        )

    def peek(self, key: Key) -> list[tuple[bytes, bytes]]:
        """The x-ratelimit-* headers as this replica sees the key now, counting nothing."""
        token = self._token(key.name)
        cached = self._cache.get(token) if self.shared else None
        state = cached[0] if cached is not None else self._local.get(token, QuotaState())
        now = self.clock()
        state = state.current(now)
        held = self._allowance.get(token) if cached is not None else None
        return rate_headers(own_view(state, held) if held else state, key.limits, now)

    def reporting(self, key: Key, send: Send, state: RequestLog) -> Send:
        """``send`` that puts x-ratelimit-* on every answer to ``key``: the admission's view
        (``state.ticket``), or -- answers that count nothing: /status, /v1/models, errors --
        this replica's current one."""

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = message["headers"]
                if not any(name.startswith(b"x-ratelimit-") for name, _ in headers):
                    ticket = state.ticket
                    extra = ticket.headers if ticket is not None else self.peek(key)
                    message = {**message, "headers": [*headers, *extra]}
            await send(message)

        state.send = send_with_headers
        return send_with_headers

    def finish(self, ticket: Ticket | None, tokens: int = 0) -> None:
        """The request ended (answered, failed or abandoned): release its lease and charge its
        tokens, in the background. Called once per ticket; later calls do nothing."""
        if ticket is None or ticket.finished:
            return
        ticket.finished = True
        token = self._token(ticket.name)
        if ticket.lease is not None:
            held = self._held.get(token)
            if held is not None:
                held.discard(ticket.lease)
        if ticket.lease is None and tokens <= 0 and not ticket.reserved:
            return
        if ticket.limits.tokens_per_minute is None and ticket.lease is None:
            return
        reserved, window = ticket.reserved, ticket.window
        if ticket.local:
            # Its reservation came from the allowance: settled there, a write only for what it
            # used beyond the reservation and the allowance.
            held, tokens = settle_locally(
                self._allowance.get(token), self.clock(), window, reserved, tokens
            )
            if held is not None:
                self._allowance[token] = held
            self.local_settlements += 1
            if tokens <= 0:
                return
            reserved, window = 0, None

        def op(state: QuotaState, now: float) -> tuple[QuotaState, Any, bool]:
            charged = tokens if ticket.limits.tokens_per_minute is not None else 0
            after = finish(state, now, ticket.lease, charged, reserved, window)
            return after, None, True

        if self._decided_here(token):
            self._apply_local(token, [op])
            return
        task = asyncio.get_running_loop().create_task(self._submit(token, op))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def charge(self, key: Key, tokens: int) -> None:
        """Tokens of work admitted earlier (a job's, known when it ends)."""
        if key.limits.tokens_per_minute is not None and tokens > 0:
            self.finish(Ticket(key.name, key.limits, None, []), tokens)

    def _decided_here(self, token: str) -> bool:
        """This replica's own state decides (no NATS, and no shared write of the key under way):
        applied at once, with no write to wait for -- no future, no task per request."""
        return not self.shared and token not in self._pending

    # ------------------------------------------------------------------ group commit

    async def _submit(self, token: str, op: Op) -> Any:
        pending = self._pending.get(token)
        if pending is None:
            pending = self._pending[token] = _Pending()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        pending.ops.append((op, future))
        if not pending.running:
            pending.running = True
            try:
                while pending.ops:
                    batch, pending.ops = pending.ops, []
                    try:
                        results = await self._apply(token, [o for o, _ in batch])
                    except Exception as exc:  # a bug in an op: fail the batch, keep going
                        for _, fut in batch:
                            if not fut.done():
                                fut.set_exception(exc)
                        continue
                    for (_, fut), result in zip(batch, results, strict=True):
                        if not fut.done():
                            fut.set_result(result)
            finally:
                pending.running = False
                if not pending.ops:
                    self._pending.pop(token, None)
        return await future

    def _run_ops(
        self, token: str, state: QuotaState, ops: list[Op], now: float
    ) -> tuple[QuotaState, list, bool]:
        self._taking.pop(token, None)  # a write computed again (it lost) takes again
        results = []
        changed = False
        for op in ops:
            state, result, did = op(state, now)
            results.append(result)
            changed = changed or did
        return state, results, changed

    async def _apply(self, token: str, ops: list[Op]) -> list[Any]:
        if not self.shared:
            return self._apply_local(token, ops)
        try:
            return await self._apply_shared(token, ops)
        except Exception as exc:
            if not self._fallback_logged:
                logger.warning(
                    "the limits bucket is unreachable (%s); this replica enforces limits on "
                    "its own until it is back",
                    type(exc).__name__,
                )
                self._fallback_logged = True
            return self._apply_local(token, ops)

    def _apply_local(self, token: str, ops: list[Op]) -> list[Any]:
        state = self._local.get(token) or QuotaState()
        state, results, _ = self._run_ops(token, state, ops, self.clock())
        self._local[token] = state
        return results

    async def _apply_shared(self, token: str, ops: list[Op]) -> list[Any]:
        js = self._js
        subject = names.kv_subject(names.QUOTAS_BUCKET, token)
        fresh = False
        while True:
            cached = self._cache.get(token)
            if cached is None:
                cached = await self._read(token)
                fresh = True
            state, seq = cached
            now = self.clock()
            after, results, changed = self._run_ops(token, state.current(now), ops, now)
            if not changed:
                # Nothing admitted and nothing to release: refusals. A concurrency refusal is
                # checked against the stored value once (a slot may have been freed).
                if fresh or not any(_concurrency_denial(r) for r in results):
                    return results
                self._cache.pop(token, None)
                continue
            try:
                self.round_trips += 1
                ack = await js.publish(
                    subject,
                    after.encode(),
                    headers={_EXPECTED_LAST: str(seq)},
                    msg_ttl=max(1, round(after.ttl(now))),
                    timeout=WRITE_TIMEOUT_SECONDS,
                )
            except Exception as exc:
                if getattr(exc, "err_code", None) == _WRONG_LAST_SEQUENCE:
                    self._cache.pop(token, None)  # another replica wrote first: read, redo
                    continue
                raise
            self._fallback_logged = False
            have = self._cache.get(token)
            if have is None or have[1] < ack.seq:
                self._cache[token] = (after, ack.seq)
            return results

    async def _read(self, token: str) -> tuple[QuotaState, int]:
        self.round_trips += 1
        try:
            raw = await self._js.get_msg(
                names.kv_stream(names.QUOTAS_BUCKET),
                subject=names.kv_subject(names.QUOTAS_BUCKET, token),
                direct=True,
            )
        except NotFoundError:
            return QuotaState(), 0
        operation = (raw.headers or {}).get("KV-Operation")
        state = QuotaState() if operation in ("DEL", "PURGE") else QuotaState.decode(raw.data)
        self._cache[token] = (state, raw.seq)
        return state, raw.seq

    # ------------------------------------------------------------------ leases

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(LEASE_RENEW_SECONDS)
            for token, leases in list(self._held.items()):
                if not leases:
                    self._held.pop(token, None)
                    continue
                held = set(leases)

                def op(state: QuotaState, now: float, held=held):
                    return renew(state, now, held), None, True

                try:
                    await self._submit(token, op)
                except Exception as exc:
                    logger.warning("renewing concurrency leases failed: %s", exc)


def _concurrency_denial(result: Any) -> bool:
    if not isinstance(result, tuple) or not result:
        return False
    denied = result[0]
    return isinstance(denied, Denied) and denied.limit == "maxConcurrent"


def _rate_limited(
    name: str, limits: Limits, denied: Denied, headers: list[tuple[bytes, bytes]]
) -> RateLimitError:
    extra = {k.decode(): v.decode() for k, v in headers}
    extra["retry-after"] = str(denied.retry_after)
    return RateLimitError(
        denial_message(name, limits, denied), code="rate_limit_exceeded", headers=extra
    )

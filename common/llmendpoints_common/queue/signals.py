"""Scaling signals that live outside any pod: requests a gateway holds, and nudges.

An endpoint scaled to zero has no pod to scrape, yet work can be waiting for it: the gateway
holds OpenAI requests until a replica is ready, and jobs wait in the shared queue. The gateway
publishes how many requests it holds here; the operator's autoscaler reads the sum over every
live gateway replica and adds it to the endpoint's queue.

- ``publish_held`` writes ``held.<ns>.<name>.<gateway id>`` in the key-value bucket
  ``LLMEP_SIGNALS``. Entries expire ``HELD_TTL_SECONDS`` after their last write, so a gateway
  replica that dies stops counting on its own; a live one re-publishes its count at least every
  ``HELD_REFRESH_SECONDS`` (also when it is 0, which the reader treats like no entry).
- ``nudge`` publishes on core NATS ``llmep.nudge.<ns>.<name>``: "work arrived for an endpoint with
  no ready replica". Core NATS has no delivery guarantee, which is fine: the nudge only makes
  the autoscaler act before its next tick, and the tick reads the held count anyway.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from llmendpoints_common.batch.signal import BatchSignal
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue.connect import settle
from llmendpoints_common.queue.names import (
    NUDGE_WILDCARD,
    SIGNALS_BUCKET,
    batch_signal_filter,
    batch_signal_key,
    endpoint_of_nudge,
    held_filter,
    held_key,
    nudge_subject,
)
from llmendpoints_common.queue.topology import HELD_TTL_SECONDS, signals_config

# How often a live gateway re-publishes its counts (well inside the TTL).
HELD_REFRESH_SECONDS = 10.0

_GATEWAY_ID_FORBIDDEN = set(".*> \t\r\n")

NudgeCallback = Callable[[EndpointRef], Awaitable[None] | None]
__all__ = [
    "HELD_REFRESH_SECONDS",
    "HELD_TTL_SECONDS",
    "endpoint_of_nudge",
    "nudge",
    "publish_held",
    "read_held",
    "signals_bucket",
    "subscribe_nudges",
]


async def signals_bucket(js: JetStreamContext) -> KeyValue:
    """The ``LLMEP_SIGNALS`` bucket, created on first use when it is missing (the operator
    creates it with the other streams; creating it again with the same configuration is a
    no-op on the server)."""
    try:
        return await js.key_value(SIGNALS_BUCKET)
    except (BucketNotFoundError, NotFoundError):
        try:
            await js.add_stream(signals_config())
        except BadRequestError as exc:
            if exc.err_code != 10058:  # created meanwhile by someone else
                raise
        return await js.key_value(SIGNALS_BUCKET)


def _check_gateway_id(gateway_id: str) -> str:
    if not gateway_id or _GATEWAY_ID_FORBIDDEN & set(gateway_id):
        raise ValueError(
            f"gateway id {gateway_id!r} must be one non-empty key token "
            "(no '.', '*', '>' or whitespace)"
        )
    return gateway_id


async def publish_held(
    js: JetStreamContext, endpoint: EndpointRef | str, gateway_id: str, count: int
) -> None:
    """Record that gateway ``gateway_id`` holds ``count`` requests for ``endpoint`` now."""
    if count < 0:
        raise ValueError(f"held count must be >= 0, got {count}")
    kv = await signals_bucket(js)
    await kv.put(held_key(endpoint, _check_gateway_id(gateway_id)), str(count).encode())


async def read_held(js: JetStreamContext, endpoint: EndpointRef | str) -> int:
    """Requests held for ``endpoint`` by all live gateway replicas (expired entries are gone)."""
    kv = await signals_bucket(js)
    # A watcher on the wildcard delivers each key's current value, then a None marker.
    # (KeyValue.keys(filters=...) matches substrings, which would mix "a" with "a-b".)
    watcher = await kv.watch(held_filter(endpoint), ignore_deletes=True)
    total = 0
    try:
        async for entry in watcher:
            if entry is None:
                break
            total += _parse_count(entry.value)
    finally:
        await watcher.stop()
    return total


async def publish_batch(
    js: JetStreamContext, endpoint: EndpointRef | str, signal: BatchSignal
) -> None:
    """A batch's remaining work and deadline for the autoscaler (expires with the bucket's TTL
    unless refreshed: a driver that stops stops counting)."""
    kv = await signals_bucket(js)
    await kv.put(batch_signal_key(endpoint, signal.batch), signal.encode())


async def drop_batch(js: JetStreamContext, endpoint: EndpointRef | str, batch_id: str) -> None:
    """The batch ended: it no longer sizes its endpoint (a delete marker, which the bucket's
    age limit removes in turn)."""
    kv = await signals_bucket(js)
    await kv.delete(batch_signal_key(endpoint, batch_id))


async def read_batches(js: JetStreamContext, endpoint: EndpointRef | str) -> list[BatchSignal]:
    """The batches running for ``endpoint`` whose drivers are alive."""
    kv = await signals_bucket(js)
    watcher = await kv.watch(batch_signal_filter(endpoint), ignore_deletes=True)
    found: list[BatchSignal] = []
    try:
        async for entry in watcher:
            if entry is None:
                break
            signal = BatchSignal.decode(entry.value or b"")
            if signal is not None and signal.remaining > 0:
                found.append(signal)
    finally:
        await watcher.stop()
    return found


def _parse_count(raw: bytes | None) -> int:
    # A malformed entry (a gateway of another version, a hand edit) must not break scaling.
    try:
        return max(0, int((raw or b"0").decode()))
    except (UnicodeDecodeError, ValueError):
        return 0


async def nudge(nc: NATS, endpoint: EndpointRef | str) -> None:
    """Tell the autoscaler work arrived for ``endpoint`` (best effort, no reply)."""
    await nc.publish(nudge_subject(endpoint), b"")


async def subscribe_nudges(nc: NATS, callback: NudgeCallback) -> Subscription:
    """Call ``callback(endpoint)`` (an EndpointRef) for every nudge (a coroutine function or a
    plain one) published from the moment this returns: the server holds the subscription by
    then (queue/connect.py, ``settle``).
    Returns the subscription; ``await sub.unsubscribe()`` stops it."""

    async def on_message(msg) -> None:
        try:
            endpoint = endpoint_of_nudge(msg.subject)
        except ValueError:
            return
        result = callback(endpoint)
        if inspect.isawaitable(result):
            await result

    subscription = await nc.subscribe(NUDGE_WILDCARD, cb=on_message)
    try:
        await settle(nc)
    except BaseException:
        # Not known to be registered: the caller subscribes again later, and twice would
        # deliver each nudge twice.
        with contextlib.suppress(Exception):
            await subscription.unsubscribe()
        raise
    return subscription

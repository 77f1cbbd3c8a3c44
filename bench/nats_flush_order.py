"""Why a nudge was lost between two connections of one account (issue 29): nats-py's
``flush()`` is not the barrier it is documented to be, and ``queue.connect.settle`` is.

    .venv/bin/python bench/nats_flush_order.py [--rounds 500]

Two parts, printed as Markdown for bench/RESULTS.md:

1. The wire order (deterministic, no server timing involved): what a nats-py client writes to
   its socket for ``subscribe(); flush()`` and for ``subscribe(); settle()``.
2. The race it opens, on real nats-servers (the plain configuration and the chart's JWT one,
   with the operator's and the gateway's credentials): each round the "operator" connection
   subscribes to ``llmep.nudge.*.*`` and waits with the barrier under test, the "gateway"
   connection publishes one nudge, and the round counts the nudge as lost when it has not
   arrived within 2 s (core NATS stores nothing: a message the server routes before the
   subscription exists is gone, never late). Rounds alternate the two barriers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "queue")]

from integration.nats_kit import record_wire, running_nats  # noqa: E402
from llmendpoints_common.queue.connect import connect, settle  # noqa: E402
from llmendpoints_common.queue.names import NUDGE_WILDCARD  # noqa: E402
from nats_auth_kit import auth_nats  # noqa: E402

Barrier = Callable[[object], Awaitable[None]]


async def _flush(nc) -> None:
    await nc.flush()


BARRIERS: dict[str, Barrier] = {"flush()": _flush, "settle()": settle}


async def wire_order(url: str) -> dict[str, list[str]]:
    orders = {}
    for name, barrier in BARRIERS.items():
        nc, _ = await connect(url, name="wire", reconnect=False)
        written = record_wire(nc)
        await nc.subscribe("llmep.nudge.*.*")
        await barrier(nc)
        orders[name] = [line.split(b" ")[0].decode() for line in written]
        await nc.close()
    return orders


async def race(url: str, rounds: int, creds: Callable[[str], str | None]) -> dict[str, int]:
    operator, _ = await connect(url, name="operator", creds=creds("operator"), reconnect=False)
    gateway, _ = await connect(url, name="gateway", creds=creds("gateway"), reconnect=False)
    lost = dict.fromkeys(BARRIERS, 0)
    try:
        for i in range(rounds):
            name = list(BARRIERS)[i % len(BARRIERS)]
            got = asyncio.Event()

            async def arrived(_msg, got=got) -> None:
                got.set()

            sub = await operator.subscribe(NUDGE_WILDCARD, cb=arrived)
            await BARRIERS[name](operator)
            await gateway.publish(f"llmep.nudge.ns.e{i}", b"")
            try:
                await asyncio.wait_for(got.wait(), 2)
            except TimeoutError:
                lost[name] += 1
            await sub.unsubscribe()
    finally:
        await operator.close()
        await gateway.close()
    return lost


async def run(rounds: int) -> None:
    started = time.strftime("%H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="llmep-flush-") as tmp:
        root = Path(tmp)
        with running_nats(root / "plain") as plain:
            orders = await wire_order(plain.url)
            plain_lost = await race(plain.url, rounds, lambda _role: None)
        (root / "jwt").mkdir()
        with auth_nats(root / "jwt") as jwt:
            jwt_lost = await race(jwt.url, rounds, jwt.creds)
    load_after = os.getloadavg()
    print(f"### nats-py flush() vs settle() ({started}, load average {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f})\n")  # fmt: skip
    print("Verbs written to the socket, in order, for `subscribe(); <barrier>`:\n")
    for name, verbs in orders.items():
        print(f"- `{name}`: {' '.join(verbs)}")
    print(f"\nNudges lost of {rounds // 2} rounds each (2 s wait per round):\n")
    print("| barrier | plain nats-server | JWT (chart's trust, operator + gateway creds) |")
    print("| --- | --- | --- |")
    for name in BARRIERS:
        share = rounds // len(BARRIERS)
        print(f"| `{name}` | {plain_lost[name]} / {share} | {jwt_lost[name]} / {share} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500, help="rounds per server (both barriers)")
    args = parser.parse_args()
    asyncio.run(run(args.rounds))


if __name__ == "__main__":
    main()

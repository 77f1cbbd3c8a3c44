"""A minimal OpenAI router over the gateway's new routing core, for bench/prefix_routing.py until
the gateway itself wires it in (the lead's integration, issue 23): every request goes through
prefix_index (blocks, longest match, record), scoring.choose (bounded load, engine load) and an
EngineLoadFeed scraping the replicas' /metrics -- the same calls the gateway will make -- and is
streamed to the chosen replica with aiohttp. Nothing else of the gateway (no keys, no holding,
no metering), so its TTFT is not the gateway's: compare hit rates, and TTFT with that in mind.

    python bench/_scored_router.py --port 9000 --replica http://127.0.0.1:8001 --replica ...

GET /stats: routing reasons so far, per-replica requests, typical uncached blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import time

import aiohttp
from aiohttp import web
from llmendpoints_gateway.engine_load import EngineLoad, EngineLoadFeed
from llmendpoints_gateway.prefix_index import CHUNK_CHARS, PrefixIndex, request_blocks
from llmendpoints_gateway.routing import DEFAULT_LOAD_FACTOR
from llmendpoints_gateway.scoring import DEFAULT_WEIGHTS, Candidate, Weights, choose

logger = logging.getLogger("scored_router")


class ScoredRouter:
    def __init__(
        self,
        replicas: list[str],
        chunk_chars: int,
        chars_per_token: float,
        load_factor: float,
        weights: Weights = DEFAULT_WEIGHTS,
    ) -> None:
        self.replicas = replicas
        self.weights = weights
        self.load_factor = load_factor
        self.chunk_chars = chunk_chars
        self.index = PrefixIndex(chunk_chars=chunk_chars, chars_per_token=chars_per_token)
        self.in_flight = dict.fromkeys(replicas, 0)
        self.sent_since = dict.fromkeys(replicas, 0)
        self.typical = 1.0  # moving average of the uncached blocks of a routed request
        self.reasons: collections.Counter[str] = collections.Counter()
        self.routed: collections.Counter[str] = collections.Counter()
        self.feed = EngineLoadFeed(targets=lambda: self.replicas, on_sample=self._sample)

    def _sample(self, replica: str, _: EngineLoad | None, new: EngineLoad) -> None:
        self.sent_since[replica] = 0  # the engine's numbers now include what we sent
        self.index.set_kv_tokens(replica, new.kv_tokens)

    def pick(self, path: str, body: dict) -> str:
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        blocks = request_blocks(model, path, body, self.chunk_chars)
        now = time.monotonic()
        candidates = [
            Candidate(
                r,
                self.in_flight[r],
                self.feed.get(r).state(now) if self.feed.get(r) else None,
                self.sent_since[r],
            )
            for r in self.replicas
        ]
        choice = choose(
            candidates,
            len(blocks),
            self.index.longest_match(blocks),
            typical_blocks=self.typical,
            load_factor=self.load_factor,
            weights=self.weights,
        )
        assert choice is not None
        chosen = next(s for s in choice.scores if s.replica == choice.replica)
        self.typical += 0.1 * (max(chosen.uncached, 1) - self.typical)
        self.index.record(choice.replica, blocks)
        self.reasons[choice.reason] += 1
        self.routed[choice.replica] += 1
        logger.debug("%s", choice.log_line())
        return choice.replica

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        replica = self.pick(request.path, body)
        self.in_flight[replica] += 1
        self.sent_since[replica] += 1
        try:
            async with request.app["session"].post(
                replica + request.path, data=raw, headers={"content-type": "application/json"}
            ) as upstream:
                response = web.StreamResponse(status=upstream.status)
                response.content_type = upstream.content_type
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            self.in_flight[replica] -= 1

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "reasons": dict(self.reasons),
                "routed": dict(self.routed),
                "typical_uncached_blocks": round(self.typical, 2),
                "engine_load_errors": self.feed.errors(),
                "index_blocks": {r: self.index.size(r) for r in self.replicas},
                "index_capacity": {r: self.index.capacity(r) for r in self.replicas},
            }
        )


def build_app(router: ScoredRouter) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def lifespan(app: web.Application):
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=900)
        )
        feed = asyncio.create_task(router.feed.run())
        yield
        feed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feed
        await app["session"].close()

    app.cleanup_ctx.append(lifespan)
    app.router.add_post("/v1/{tail:.*}", router.proxy)
    app.router.add_get("/stats", router.stats)
    app.router.add_get("/ready", lambda _: web.Response(text="ok"))  # the bench waits for it
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica", action="append", required=True)
    parser.add_argument("--chunk-chars", type=int, default=CHUNK_CHARS)
    parser.add_argument("--chars-per-token", type=float, default=4.0)
    parser.add_argument("--load-factor", type=float, default=DEFAULT_LOAD_FACTOR)
    parser.add_argument(
        "--running-blocks", type=float, default=DEFAULT_WEIGHTS.running_blocks,
        help="scoring.Weights.running_blocks",
    )  # fmt: skip
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING)
    router = ScoredRouter(
        [r.rstrip("/") for r in args.replica],
        args.chunk_chars,
        args.chars_per_token,
        args.load_factor,
        Weights(running_blocks=args.running_blocks),
    )
    web.run_app(build_app(router), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()

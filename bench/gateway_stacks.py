"""Two minimal streaming proxies doing the same work per request as the gateway's hot path (read
the body, parse the JSON, pick a backend, forward with aiohttp's client pool, relay every chunk
as it arrives), one per candidate HTTP stack, so bench/gateway_streams.py can compare the stacks
themselves:

- ``asgi``: a bare ASGI callable on uvicorn with httptools and uvloop (what the gateway uses);
- ``aiohttp``: aiohttp's own web server (on uvloop too).

    python bench/gateway_stacks.py asgi --port 9000 --backends http://127.0.0.1:9001,...
"""

from __future__ import annotations

import argparse
import itertools
import json

import aiohttp


def asgi_app(backends: list[str]):
    turn = itertools.cycle(backends)
    state: dict = {}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["session"] = aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=0)
                    )
                else:
                    await state["session"].close()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        json.loads(body)
        async with state["session"].post(
            next(turn) + scope["path"], data=body, headers={"content-type": "application/json"}
        ) as upstream:
            await send(
                {
                    "type": "http.response.start",
                    "status": upstream.status,
                    "headers": [(b"content-type", upstream.content_type.encode())],
                }
            )
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def aiohttp_app(backends: list[str]):
    from aiohttp import web

    turn = itertools.cycle(backends)

    async def on_startup(app):
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def on_cleanup(app):
        await app["session"].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        json.loads(body)
        async with request.app["session"].post(
            next(turn) + request.path, data=body, headers={"content-type": "application/json"}
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status, headers={"content-type": upstream.content_type}
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/{tail:.*}", proxy)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stack", choices=["asgi", "aiohttp"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backends", required=True)
    args = parser.parse_args()
    backends = args.backends.split(",")
    if args.stack == "asgi":
        import uvicorn

        uvicorn.run(
            asgi_app(backends),
            host="127.0.0.1",
            port=args.port,
            http="httptools",
            loop="uvloop",
            log_level="warning",
            access_log=False,
            backlog=4096,
        )
    else:
        import uvloop
        from aiohttp import web

        uvloop.install()
        web.run_app(
            aiohttp_app(backends),
            host="127.0.0.1",
            port=args.port,
            backlog=4096,
            access_log=None,
            print=None,
        )


if __name__ == "__main__":
    main()

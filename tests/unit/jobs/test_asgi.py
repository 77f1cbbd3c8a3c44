import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from llmendpoints_runtime.jobs.asgi import call_app


async def test_streamed_body_arrives_piece_by_piece_and_closing_cancels_the_app() -> None:
    app = FastAPI()
    produced: list[int] = []
    finished = asyncio.Event()

    @app.post("/tick")
    async def tick(request: Request):
        assert await request.json() == {"n": 1}

        async def ticks():
            try:
                for i in range(1000):
                    produced.append(i)
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                finished.set()

        return StreamingResponse(ticks(), media_type="text/event-stream")

    response = await call_app(app, "POST", "/tick", {"n": 1})
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    pieces = []
    async for piece in response.body:
        pieces.append(piece)
        if len(pieces) == 3:
            break
    await response.body.aclose()
    assert pieces == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    await asyncio.wait_for(finished.wait(), 2)
    assert len(produced) < 1000  # the producer stopped when the reader went away


async def test_json_and_errors_come_back_with_their_status() -> None:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    ok = await call_app(app, "GET", "/v1/models")
    assert ok.status == 200 and await ok.read() == b'{"data":[]}'
    missing = await call_app(app, "GET", "/nowhere")
    assert missing.status == 404

"""events.py: the Event objects the operator posts, and the poster's order and failure handling."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping
from typing import Any

from llmendpoints_operator import events, kube

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
ENDPOINT = {
    "apiVersion": "llmendpoints.dev/v1alpha1",
    "kind": "LLMEndpoint",
    "metadata": {"name": "chat", "namespace": "team", "uid": "u-1"},
}


def test_an_event_names_its_object_and_the_operator() -> None:
    event = events.event_object(ENDPOINT, "Warning", "InvalidSpec", "x" * 2000, NOW)
    assert event["metadata"] == {"generateName": "chat.", "namespace": "team"}
    assert event["involvedObject"] == {
        "apiVersion": "llmendpoints.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "name": "chat",
        "namespace": "team",
        "uid": "u-1",
    }
    assert (event["type"], event["reason"]) == ("Warning", "InvalidSpec")
    assert len(event["message"]) == events.MAX_MESSAGE_LENGTH and event["message"].endswith("...")
    assert event["source"] == {"component": "llmendpoints-operator"}
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2026-01-02T03:04:05Z"


async def test_the_poster_posts_in_order_and_survives_a_refusal() -> None:
    posted: list[str] = []

    class Api:
        async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
            if obj["reason"] == "Refused":
                raise kube.ApiError(403, "Forbidden", "cannot create events")
            posted.append(obj["reason"])
            return dict(obj)

    poster = events.EventPoster(Api, clock=lambda: NOW)
    task = asyncio.create_task(poster.run())
    for reason in ("Created", "Refused", "Ready"):
        poster.post(ENDPOINT, "Normal", reason, "")
    await poster.flush(timeout=5)
    task.cancel()
    assert posted == ["Created", "Ready"]

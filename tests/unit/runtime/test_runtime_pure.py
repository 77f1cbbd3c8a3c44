"""Pure pieces of the runtime: admission queue, keys, body checks, probes, errors, download plan."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest
from llmendpoints_common.errors import (
    RateLimitError,
    describe_validation_errors,
    error_object,
    error_type,
    job_error_body,
)
from llmendpoints_edge.body import json_body_problem
from llmendpoints_edge.keys import key_from_headers
from llmendpoints_edge.keys import parse_key_list as parse_keys_file
from llmendpoints_runtime.admission import AdmissionQueue, default_max_concurrency
from llmendpoints_runtime.auth import KeyStore, key_matches
from llmendpoints_runtime.download import select_files
from llmendpoints_runtime.health import EngineState, liveness, readiness

# -- admission ---------------------------------------------------------------------------------


async def test_admission_runs_up_to_the_limit_then_queues_in_order():
    queue = AdmissionQueue(limit=2, max_waiting=2)
    await queue.acquire()
    await queue.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await queue.acquire()
        order.append(name)

    first = asyncio.create_task(wait("first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    assert (queue.running, queue.waiting) == (2, 2)
    with pytest.raises(RateLimitError) as refused:
        await queue.acquire()
    assert refused.value.status_code == 429 and refused.value.headers == {"retry-after": "1"}
    assert "2 sequences running and 2 queued" in refused.value.message
    queue.release()
    await first
    queue.release()
    await second
    assert order == ["first", "second"]
    assert (queue.running, queue.waiting) == (2, 0)


async def test_a_cancelled_waiter_leaves_the_queue_and_loses_no_slot():
    queue = AdmissionQueue(limit=1, max_waiting=5)
    await queue.acquire()
    waiter = asyncio.create_task(queue.acquire())
    await asyncio.sleep(0)
    assert queue.waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert queue.waiting == 0
    queue.release()
    assert queue.running == 0
    await asyncio.wait_for(queue.acquire(), 1)


async def test_raising_the_limit_admits_waiters():
    queue = AdmissionQueue(limit=1, max_waiting=5)
    await queue.acquire()
    waiter = asyncio.create_task(queue.acquire())
    await asyncio.sleep(0)
    queue.set_limit(2)
    await asyncio.wait_for(waiter, 1)
    assert queue.running == 2


def test_default_concurrency_never_throttles_the_engine_batch():
    assert default_max_concurrency(None) == 300
    assert default_max_concurrency(256) == 300
    assert default_max_concurrency(1024) == 1024


# -- API keys ----------------------------------------------------------------------------------


def test_keys_file_format():
    assert parse_keys_file("# team a\nk1\n\n k2 \nk3,k4\nk1\n") == ("k1", "k2", "k3", "k4")


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ([(b"authorization", b"Bearer abc")], "abc"),
        ([(b"authorization", b"bearer  abc ")], "abc"),
        ([(b"x-api-key", b"xyz")], "xyz"),
        ([(b"authorization", b"Basic abc")], None),
        ([(b"authorization", b"Bearer ")], None),
        ([], None),
    ],
)
def test_key_from_headers(headers, key):
    assert key_from_headers(headers) == key


def test_key_matching():
    assert key_matches("b", ("a", "b"))
    assert not key_matches("c", ("a", "b"))
    assert not key_matches("", ("a",))
    assert not key_matches("a", ())


def test_keys_file_is_reread_when_it_changes(tmp_path):
    path = tmp_path / "keys"
    path.write_text("old\n")
    store = KeyStore(("static",), str(path), check_interval=0)
    assert store.keys() == ("static", "old")
    path.write_text("new\n")
    later = time.time() + 5
    os.utime(path, (later, later))
    assert store.keys() == ("static", "new")


def test_unreadable_keys_file_fails_closed(tmp_path):
    store = KeyStore((), str(tmp_path / "missing"), check_interval=0)
    assert store.enabled
    assert store.keys() == ()


# -- request bodies ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'{"a": 1}', None),
        (b"{bad", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got an array"),
        (b'"text"', "got a string"),
        (b"null", "got null"),
        (b'{"prompt": "\xff"}', "not valid UTF-8"),
    ],
)
def test_json_body_problem(body, problem):
    found = json_body_problem(body)
    if problem is None:
        assert found is None
    else:
        assert problem in found


# -- probes ------------------------------------------------------------------------------------


def test_readiness_answers():
    init = EngineState.INITIALIZING
    assert readiness(init, phase="load", reason=None, draining=False, strict=False).status == 204
    assert readiness(init, phase="load", reason=None, draining=False, strict=True).status == 503
    assert (
        readiness(EngineState.READY, phase=None, reason=None, draining=False, strict=False).status
        == 200
    )
    failed = readiness(EngineState.FAILED, phase=None, reason="OOM", draining=False, strict=False)
    assert (failed.status, failed.body["reason"]) == (503, "OOM")
    assert (
        readiness(EngineState.READY, phase=None, reason=None, draining=True, strict=False).status
        == 503
    )


def test_a_failed_engine_keeps_its_cause_on_readiness_while_the_process_drains_to_exit():
    probe = readiness(EngineState.FAILED, phase=None, reason="OOM", draining=True, strict=True)
    assert (probe.status, probe.body) == (503, {"status": "failed", "reason": "OOM"})


def test_liveness_answers():
    assert liveness(EngineState.INITIALIZING, reason=None).status == 200
    assert liveness(EngineState.READY, reason=None).status == 200
    assert liveness(EngineState.FAILED, reason="dead").status == 503


# -- errors ------------------------------------------------------------------------------------


def test_error_shape_and_types():
    assert error_object(404, "no such model", param="model") == {
        "message": "no such model",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    # The OpenAI SDK's names, on every route and every Python version.
    assert error_type(400) == "BadRequestError"
    assert error_type(401) == "AuthenticationError"
    assert error_type(413) == "ContentTooLargeError"
    assert error_type(429) == "RateLimitError"
    assert error_type(503) == "ServiceUnavailableError"


def test_the_job_envelope_is_the_error_object_with_the_named_job():
    refused = RateLimitError("the job queue is full")
    assert job_error_body(refused) == {"error": refused.to_error()}
    assert job_error_body(refused, job_id="j1") == {"id": "j1", "error": refused.to_error()}
    assert set(refused.to_error()) == {"message", "type", "param", "code"}


def test_validation_errors_name_the_field():
    message, param = describe_validation_errors(
        [
            {
                "loc": ("body", "sampling_params", "max_tokens"),
                "msg": "Input should be a valid integer",
                "type": "int_type",
            },
            {"loc": ("body", "messages", 1, "role"), "msg": "Field required", "type": "missing"},
            {"loc": ("body", "sampling_param"), "msg": "Extra inputs", "type": "extra_forbidden"},
        ]
    )
    assert param == "sampling_params.max_tokens"
    assert message == (
        "sampling_params.max_tokens: Input should be a valid integer; "
        "messages[1].role: required field is missing; sampling_param: unknown field"
    )
    assert describe_validation_errors(
        [
            {
                "loc": ("body", 3),
                "msg": "JSON decode error",
                "type": "json_invalid",
                "ctx": {"error": "Expecting value"},
            }
        ]
    ) == ("request body is not valid JSON: Expecting value", None)


# -- download plan -----------------------------------------------------------------------------


def test_download_prefers_safetensors_and_skips_other_formats():
    files = [
        ("config.json", 1),
        ("model-00001-of-00002.safetensors", 10),
        ("model.safetensors.index.json", 1),
        ("pytorch_model.bin", 10),
        ("tokenizer.json", 1),
        ("tokenizer_config.json", 1),
        ("onnx/model.onnx", 10),
        ("original/consolidated.00.pth", 10),
        ("modeling_custom.py", 1),
        ("README.md", 1),
    ]
    assert select_files(files, trust_remote_code=False) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert "modeling_custom.py" in select_files(files, trust_remote_code=True)
    assert "pytorch_model.bin" in select_files(
        [("config.json", 1), ("pytorch_model.bin", 1)], trust_remote_code=False
    )


# -- demo model --------------------------------------------------------------------------------


def test_demo_model_is_deterministic_and_complete(tmp_path):
    from llmendpoints_runtime.demo import write_demo_model

    def digest(path):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}

    first = digest(write_demo_model(tmp_path / "a"))
    second = digest(write_demo_model(tmp_path / "b"))
    assert first == second
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        first
    )


# -- the OpenAI fast path ----------------------------------------------------------------------


def test_no_router_of_ours_may_claim_vllms_openai_paths():
    """/v1/... goes straight to vLLM's app; a router of ours there would be silently bypassed."""
    from fastapi import APIRouter
    from llmendpoints_runtime.app import create_app
    from llmendpoints_runtime.compose import build_runtime
    from llmendpoints_runtime.config import load_config

    router = APIRouter()

    @router.get("/v1/shadow")
    async def shadow() -> dict:
        return {}

    runtime = build_runtime(load_config({"MODEL_NAME": "org/m"}))
    with pytest.raises(RuntimeError, match="/v1/shadow"):
        create_app(runtime, [router], start_engine=False)


def test_shutdown_drains_the_features_before_the_engine_stops():
    from fastapi.testclient import TestClient
    from llmendpoints_runtime.compose import build_runtime, create_app
    from llmendpoints_runtime.config import load_config

    runtime = build_runtime(load_config({"MODEL_NAME": "org/m", "DRAIN_TIMEOUT_SECONDS": "7"}))
    app = create_app(runtime, start_engine=False)
    assert len(runtime.drainers) == 2  # the job API's, the batches'

    seen: list[tuple[float, EngineState]] = []

    async def feature_drain(timeout: float) -> None:
        seen.append((timeout, runtime.health.state))

    runtime.drainers.append(feature_drain)
    with TestClient(app):
        assert seen == []
    # Ran at shutdown, with the drain's time, while the engine had not been stopped yet.
    assert len(seen) == 1 and 6 < seen[0][0] <= 7
    assert seen[0][1] is EngineState.INITIALIZING
    assert runtime.health.state is EngineState.STOPPED


def test_one_openapi_schema_with_vllms_operations_and_ours():
    from llmendpoints_runtime.openapi import merge_openapi

    ours = {
        "openapi": "3.1.0",
        "info": {"title": "LLM Endpoints runtime", "version": "1"},
        "paths": {
            "/invocations": {"post": {"responses": {"200": {}, "400": {}, "422": {}}}},
            "/run": {
                "post": {
                    "responses": {"200": {}, "429": {}},
                    "requestBody": {
                        "content": {
                            "application/json": {
                                "schema": {
                                    "$ref": "#/components/schemas/JobRequest0",
                                    "$defs": {"JobInput": {"type": "object"}},
                                }
                            }
                        }
                    },
                }
            },
        },
        "components": {"schemas": {"ErrorBody": {"type": "object"}}},
    }
    theirs = {
        "openapi": "3.1.0",
        "info": {"title": "vLLM", "version": "0.32"},
        "paths": {
            "/v1/chat/completions": {"post": {"responses": {"200": {}}}},
            "/invocations": {"post": {"summary": "vLLM's own"}},
            "/health": {"get": {"summary": "vLLM's health"}},
        },
        "components": {"schemas": {"ChatCompletionRequest": {"type": "object"}}},
    }
    merged = merge_openapi(ours, theirs, shadowed=["/health"])
    assert sorted(merged["paths"]) == ["/invocations", "/run", "/v1/chat/completions"]
    assert merged["paths"]["/invocations"]["post"]["responses"] == {"200": {}, "400": {}}
    assert merged["info"]["title"] == "LLM Endpoints runtime"
    body = merged["paths"]["/run"]["post"]["requestBody"]["content"]["application/json"]
    assert "$defs" not in body["schema"]
    assert set(merged["components"]["schemas"]) == {
        "ErrorBody",
        "ChatCompletionRequest",
        "JobInput",
    }
    # Before the engine is up there is no vLLM schema: ours alone.
    assert sorted(merge_openapi(ours, None)["paths"]) == ["/invocations", "/run"]


@pytest.mark.parametrize(
    "model, refused",
    [
        ("/models/missing", True),
        ("./missing", True),
        ("~/missing", True),
        ("org/name", False),  # a hub repo id: downloaded, not looked for on disk
        ("gpt2", False),
    ],
)
def test_a_model_path_with_no_directory_is_named_before_any_load(model, refused):
    from llmendpoints_runtime.download import missing_local_model

    problem = missing_local_model(model)
    assert (problem is not None) == refused
    if refused:
        assert "MODEL_NAME" in problem and model in problem


def test_an_existing_model_directory_is_not_refused(tmp_path):
    from llmendpoints_runtime.download import missing_local_model

    assert missing_local_model(str(tmp_path)) is None

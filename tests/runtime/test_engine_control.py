"""vLLM's engine-control routes against the real engine: an ordinary key gets 403 in OpenAI's
shape on every one of them; the admin key (ADMIN_API_KEYS_FILE, as the operator mounts it)
reaches them and serves inference too. VLLM_SERVER_DEV_MODE puts vLLM's development routes
(sleep, caches, RPC, pause...) into its app, so the guard is tested where the routes exist."""

from __future__ import annotations

import httpx
import pytest
from llmendpoints_runtime.control_routes import CONTROL_ROUTES
from runtime_process import running_runtime

pytestmark = pytest.mark.engine

ADMIN = {"Authorization": "Bearer admin-secret"}
USER = {"Authorization": "Bearer user-key"}
COMPLETION = {"model": "demo", "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(demo_model, runtime_logs, tmp_path_factory):
    admin_file = tmp_path_factory.mktemp("admin-key") / "admin-api-key"
    admin_file.write_text("admin-secret\n")
    with running_runtime(
        demo_model,
        runtime_logs,
        API_KEYS="user-key",
        ADMIN_API_KEYS_FILE=str(admin_file),
        VLLM_SERVER_DEV_MODE="1",
    ) as running:
        yield running


def _path(template: str) -> str:
    return template.replace("{adapter_name}", "sql")


@pytest.mark.parametrize("template", sorted(CONTROL_ROUTES))
def test_an_ordinary_key_gets_403_on_every_control_route(server, template):
    path = _path(template)
    for method in ("GET", "POST"):
        response = httpx.request(method, server.url + path, headers=USER, json={}, timeout=60)
        assert response.status_code == 403, (method, path, response.text)
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("PermissionDeniedError", 403)
        assert path in error["message"] and "admin key" in error["message"]
    # Without a key it is the usual 401: the key is checked before anything else.
    assert httpx.post(server.url + path, json={}, timeout=60).status_code == 401


def test_the_admin_key_reaches_control_routes(server):
    with server.client(headers=ADMIN) as http:
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/reset_prefix_cache").status_code == 200
        assert http.get("/is_paused").status_code == 200
        # Absent from vLLM's app without VLLM_ALLOW_RUNTIME_LORA_UPDATING: vLLM's own answer.
        lora = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert lora.status_code not in (401, 403), lora.text
    # The alias under /v2/{endpoint_id}/openai/v1/ is guarded the same way.
    alias = "/v2/ep/openai/v1/load_lora_adapter"
    assert httpx.post(server.url + alias, json={}, headers=USER).status_code == 403


def test_admin_and_ordinary_keys_both_serve_inference(server):
    for headers in (ADMIN, USER):
        with server.client(headers=headers) as http:
            response = http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200, response.text
            assert http.get("/v1/models").status_code == 200

"""Images end to end, on the real engine: the vision demo model behind every contract.

One runtime serves the Idefics3 demo model (`demo-model --vision`) for the whole module. Where
Linux namespaces are available it runs in a network namespace of its own (tests/runtime/netns.py),
so the SSRF tests can aim it at the cloud metadata address -- a listener there counts
connections -- without any packet ever leaving loopback. The image host the runtime fetches
from is a local HTTP server inside the same namespace.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from llmendpoints_runtime.demo_vision import IMAGE_TOKENS_PER_IMAGE
from netns import (
    METADATA_ADDRESS,
    ConnectionCounter,
    Forwarder,
    Namespace,
    namespaced_command,
    unavailable_reason,
)
from PIL import Image
from runtime_process import (
    RUNTIME_BIN,
    RuntimeServer,
    free_port,
    launch_runtime,
    runtime_env,
)

pytestmark = pytest.mark.engine

MODEL = "demo-vision"
IMAGE_PROMPT_TOKENS = IMAGE_TOKENS_PER_IMAGE + 3  # <fake><global-img> <image>x4 <fake>
MAX_IMAGES = 2  # LIMIT_MM_PER_PROMPT
MAX_PIXELS = 100_000  # VLLM_MAX_IMAGE_PIXELS
METADATA_NAME = "metadata.test"  # resolves to the metadata address inside the namespace


def png(width: int = 40, height: int = 30, color: str = "red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def user_message(*image_urls: str, text: str = "What is in this image?") -> list[dict]:
    content: list[dict] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    return [{"role": "user", "content": content}]


# ---------------------------------------------------------------------------------------------
# the image host
# ---------------------------------------------------------------------------------------------


@dataclass
class ImageHost:
    server: ThreadingHTTPServer
    requests: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def image_host(listener: socket.socket) -> ImageHost:
    """An HTTP server on an already-bound socket (bound inside the namespace, if there is one)."""
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {
        "/red.png": (200, {"Content-Type": "image/png"}, png()),
        "/to-red": (302, {"Location": "/red.png"}, b""),
        "/to-metadata": (302, {"Location": f"http://{METADATA_ADDRESS}/latest/meta-data/"}, b""),
        "/to-metadata-name": (302, {"Location": f"http://{METADATA_NAME}/latest/"}, b""),
        "/large.bin": (200, {"Content-Type": "image/png"}, b"\0" * (2 * 1024 * 1024)),
    }
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            status, headers, body = routes.get(self.path, (404, {}, b"not found"))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(listener.getsockname(), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = listener
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return ImageHost(server, seen)


# ---------------------------------------------------------------------------------------------
# the one runtime of this module
# ---------------------------------------------------------------------------------------------


@dataclass
class VisionRuntime:
    server: RuntimeServer
    images: ImageHost
    metadata: ConnectionCounter | None  # None: no private namespace, SSRF tests skip
    namespace: Namespace | None


VISION_SETTINGS = {
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE": MODEL,
    "MAX_MODEL_LEN": "1024",
    "LIMIT_MM_PER_PROMPT": json.dumps({"image": MAX_IMAGES}),
    "VLLM_MAX_IMAGE_PIXELS": str(MAX_PIXELS),
    "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": "1",
    "DEFAULT_MAX_TOKENS": "8",
}


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vision-model")
    subprocess.run([str(RUNTIME_BIN), "demo-model", "--vision", str(out)], check=True)
    return out


@pytest.fixture(scope="module")
def vision(vision_model, runtime_logs, tmp_path_factory) -> Iterator[VisionRuntime]:
    reason = unavailable_reason()
    if reason is not None:
        # Still every contract; only the tests that need the private namespace skip.
        images = image_host(socket.create_server(("127.0.0.1", 0)))
        server = launch_runtime(vision_model, runtime_logs, **VISION_SETTINGS)
        runtime = VisionRuntime(server, images, None, None)
        print(f"SSRF tests will skip: {reason}")
        yield from _serve(runtime)
        return

    hosts = tmp_path_factory.mktemp("etc") / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{METADATA_ADDRESS} {METADATA_NAME}\n")
    inner_port = free_port()
    env = runtime_env(vision_model, inner_port, **VISION_SETTINGS)
    log_path = runtime_logs / f"vision-{inner_port}.log"
    process = subprocess.Popen(
        namespaced_command([str(RUNTIME_BIN), "serve"], hosts),
        env=env,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )
    with contextlib.ExitStack() as cleanup:
        # Registered first, so it runs last -- and runs even when the set-up below fails.
        cleanup.callback(RuntimeServer(process, 0, log_path, env).stop)
        namespace = Namespace(process.pid)
        cleanup.callback(namespace.close)
        forwarder = Forwarder(namespace, inner_port)
        cleanup.callback(forwarder.close)
        server = RuntimeServer(process=process, port=forwarder.port, log_path=log_path, env=env)
        metadata = ConnectionCounter(namespace.run(_bind_metadata_listener))
        cleanup.callback(metadata.close)
        listener = namespace.run(lambda: socket.create_server(("127.0.0.1", 0)))
        runtime = VisionRuntime(server, image_host(listener), metadata, namespace)
        yield from _serve(runtime)


def _bind_metadata_listener() -> socket.socket:
    """Bind 169.254.169.254:80 from the namespace thread. Binding needs the address to be local,
    and it is local only inside the namespace: success proves the thread is inside, so the test
    that connects to it from there never reaches the real address."""
    deadline = time.monotonic() + 20
    while True:  # the namespace's setup script adds the address right after start
        try:
            return socket.create_server((METADATA_ADDRESS, 80))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _serve(runtime: VisionRuntime) -> Iterator[VisionRuntime]:
    try:
        runtime.server.wait_listening()
        runtime.server.wait_ready()
        yield runtime
    finally:
        runtime.server.stop()
        runtime.images.server.shutdown()


@pytest.fixture(scope="module")
def client(vision) -> openai.OpenAI:
    return openai.OpenAI(base_url=vision.server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(vision) -> Iterator[httpx.Client]:
    with vision.server.client() as c:
        yield c


@pytest.fixture
def metadata(vision) -> ConnectionCounter:
    if vision.metadata is None:
        pytest.skip(f"needs a private network namespace: {unavailable_reason()}")
    return vision.metadata


def chat(client: openai.OpenAI, messages: list[dict], *, stream: bool = False):
    """(text, usage) of a chat completion of exactly 4 tokens, streamed or not."""
    params = {"model": MODEL, "messages": messages, "max_tokens": 4}
    params["extra_body"] = {"ignore_eos": True}  # random weights may pick EOS at once
    if not stream:
        reply = client.chat.completions.create(**params)
        return reply.choices[0].message.content, reply.usage
    chunks = list(
        client.chat.completions.create(
            **params, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


def assert_still_serving(client: openai.OpenAI, vision: VisionRuntime) -> None:
    text, usage = chat(client, user_message(data_url(png(color="blue"))))
    assert isinstance(text, str) and usage.completion_tokens == 4


# ---------------------------------------------------------------------------------------------
# OpenAI
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("source", ["base64", "http"])
def test_chat_with_an_image(client, vision, source, stream) -> None:
    url = data_url(png()) if source == "base64" else vision.images.base + "/red.png"
    fetched_before = vision.images.requests.count("/red.png")

    text, with_image = chat(client, user_message(url), stream=stream)
    _, text_only = chat(client, user_message(), stream=stream)

    assert isinstance(text, str) and with_image.completion_tokens == 4
    # The image reached the model: its placeholder tokens are in the prompt.
    assert with_image.prompt_tokens - text_only.prompt_tokens == IMAGE_PROMPT_TOKENS
    if source == "http":
        assert vision.images.requests.count("/red.png") == fetched_before + 1


def test_two_images_in_one_message(client, vision) -> None:
    _, usage = chat(client, user_message(data_url(png()), vision.images.base + "/red.png"))
    _, text_only = chat(client, user_message())
    assert usage.prompt_tokens - text_only.prompt_tokens == 2 * IMAGE_PROMPT_TOKENS


def test_a_redirect_to_an_allowed_host_is_followed(client, vision) -> None:
    before = len(vision.images.requests)
    _, usage = chat(client, user_message(vision.images.base + "/to-red"))
    _, text_only = chat(client, user_message())
    assert usage.prompt_tokens - text_only.prompt_tokens == IMAGE_PROMPT_TOKENS
    assert vision.images.requests[before:] == ["/to-red", "/red.png"]


BAD_IMAGES = {
    "too many images": (
        lambda base: [data_url(png())] * (MAX_IMAGES + 1),
        f"At most {MAX_IMAGES} image(s)",
    ),
    "a data URL that is no image": (
        lambda base: [data_url(b"this is plain text, not a picture")],
        "Failed to load image",
    ),
    "invalid base64": (lambda base: ["data:image/png;base64,@@not*base64@@"], "base64"),
    "a data URL that is not base64": (lambda base: ["data:image/png,rawbytes"], "base64"),
    "a URL that 404s": (lambda base: [base + "/missing.png"], "HTTP 404"),
    "an image over VLLM_MAX_IMAGE_PIXELS": (
        lambda base: [data_url(png(400, 400))],
        "VLLM_MAX_IMAGE_PIXELS",
    ),
    "a download over VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": (
        lambda base: [base + "/large.bin"],
        "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB",
    ),
    "a file: URL": (lambda base: ["file:///etc/passwd"], "ALLOWED_LOCAL_MEDIA_PATH"),
    "an ftp: URL": (lambda base: ["ftp://127.0.0.1/x.png"], "URL"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_images_are_400_in_openais_shape_and_the_server_keeps_serving(
    client, vision, http, case
) -> None:
    urls, fragment = BAD_IMAGES[case]
    body = {"model": MODEL, "messages": user_message(*urls(vision.images.base)), "max_tokens": 2}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert fragment in error["message"], error

    with pytest.raises(openai.BadRequestError):  # the SDK sees the same 400
        client.chat.completions.create(**body)
    assert_still_serving(client, vision)


# ---------------------------------------------------------------------------------------------
# RunPod jobs
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def endpoint(vision):
    os.environ["RUNPOD_ENDPOINT_BASE_URL"] = f"{vision.server.url}/v2"
    import runpod

    runpod.endpoint_url_base = os.environ["RUNPOD_ENDPOINT_BASE_URL"]
    runpod.api_key = "unused"
    return runpod.Endpoint("vision")


def test_runsync_job_with_images(endpoint, vision) -> None:
    def job(*urls: str) -> dict:
        messages = user_message(*urls)
        output = endpoint.run_sync(
            {
                "input": {
                    "messages": messages,
                    "sampling_params": {"max_tokens": 3, "ignore_eos": True},
                }
            },
            timeout=120,
        )
        return output[0]

    with_images = job(data_url(png()), vision.images.base + "/red.png")
    text_only = job()
    assert with_images["usage"]["input"] - text_only["usage"]["input"] == 2 * IMAGE_PROMPT_TOKENS
    assert with_images["usage"]["output"] == 3


def test_run_job_with_an_openai_route_and_an_image(endpoint, vision) -> None:
    request = {
        "openai_route": "/v1/chat/completions",
        "openai_input": {
            "model": MODEL,
            "messages": user_message(vision.images.base + "/red.png"),
            "max_tokens": 3,
            "ignore_eos": True,
        },
    }
    job = endpoint.run({"input": request})
    output = job.output(timeout=120)
    assert job.status() == "COMPLETED"
    assert output["choices"][0]["message"]["role"] == "assistant"
    assert output["usage"]["completion_tokens"] == 3


def test_a_job_with_a_bad_image_fails_with_a_json_error(http) -> None:
    messages = user_message("data:image/png;base64,@@not*base64@@")
    body = http.post("/runsync", json={"input": {"messages": messages}}).json()
    assert body["status"] == "FAILED"
    assert body["error"]["type"] == "BadRequestError" and "base64" in body["error"]["message"]


# ---------------------------------------------------------------------------------------------
# SageMaker (shared/seeds/sagemaker-input-format.md, "Image + Text Inference")
# ---------------------------------------------------------------------------------------------


def seed_payload(image_url: str) -> dict:
    """The seed's example, with max_tokens lowered from 2048 to keep the test quick."""
    return {
        "model": "/opt/ml/model",
        "messages": [
            {"role": "system", "content": "You are a helpful medical assistant."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What does this medical image show?"},
                    {"type": "image_url", "image_url": {"url": image_url}},
                ],
            },
        ],
        "max_tokens": 4,
        "temperature": 0.15,
        "ignore_eos": True,  # not in the seed: random weights may pick EOS at once
    }


@pytest.mark.parametrize("example", ["online", "offline"])
def test_sagemaker_image_examples(http, vision, example) -> None:
    url = vision.images.base + "/red.png" if example == "online" else data_url(png(), "image/png")
    response = http.post("/invocations", json=seed_payload(url))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["usage"]["completion_tokens"] == 4


def test_sagemaker_bad_image_is_a_400(http) -> None:
    response = http.post("/invocations", json=seed_payload("data:image/png;base64,@@"))
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"


# ---------------------------------------------------------------------------------------------
# media fetching cannot be turned against the cluster (private namespace only)
# ---------------------------------------------------------------------------------------------


def test_the_metadata_listener_counts_connections(vision, metadata) -> None:
    """The counter the SSRF tests rely on does see a connection (made from inside)."""
    before = metadata.count
    vision.namespace.run(lambda: socket.create_connection((METADATA_ADDRESS, 80), 5).close())
    deadline = time.monotonic() + 5
    while metadata.count == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert metadata.count == before + 1
    metadata.count = 0


SSRF_URLS = {
    "the metadata address": lambda base: f"http://{METADATA_ADDRESS}/latest/meta-data/",
    "a name that resolves to it": lambda base: f"http://{METADATA_NAME}/latest/meta-data/",
    "a loopback URL that redirects to it": lambda base: base + "/to-metadata",
    "a loopback URL that redirects to a name for it": lambda base: base + "/to-metadata-name",
}


@pytest.mark.parametrize("case", list(SSRF_URLS))
def test_media_urls_never_reach_the_metadata_address(client, vision, http, metadata, case) -> None:
    url = SSRF_URLS[case](vision.images.base)

    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": user_message(url), "max_tokens": 2},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "image_url"
    assert "refused" in error["message"]

    job = http.post("/runsync", json={"input": {"messages": user_message(url)}}).json()
    assert job["status"] == "FAILED" and "refused" in job["error"]["message"]

    sagemaker = http.post("/invocations", json=seed_payload(url))
    assert sagemaker.status_code == 400

    assert metadata.count == 0
    assert_still_serving(client, vision)

"""A minimal stand-in for the Hugging Face Hub's HTTP API, serving one local directory as a repo.

Enough of the protocol for `huggingface_hub.snapshot_download` and vLLM's start-up checks:
repo info, the file tree, and HEAD/GET on `resolve/` URLs. Large files are sent slowly
(`bytes_per_second`) so download progress can be observed.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, root: Path, repo: str, *, bytes_per_second: int = 1 << 20):
        self.root = root
        self.repo = repo
        self.bytes_per_second = bytes_per_second
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                hub.requests.append(f"{self.command} {self.path}")

            def do_GET(self) -> None:
                hub.answer(self, send_body=True)

            def do_HEAD(self) -> None:
                hub.answer(self, send_body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()

    def _files(self) -> list[Path]:
        return sorted(p for p in self.root.iterdir() if p.is_file())

    def answer(self, handler: BaseHTTPRequestHandler, *, send_body: bool) -> None:
        path = handler.path.split("?")[0]
        if path.startswith(f"/api/models/{self.repo}/tree/"):
            items = [
                {
                    "type": "file",
                    "path": p.name,
                    "size": p.stat().st_size,
                    "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                }
                for p in self._files()
            ]
            self._json(handler, items, send_body)
        elif path.startswith(f"/api/models/{self.repo}"):
            siblings = [{"rfilename": p.name, "size": p.stat().st_size} for p in self._files()]
            self._json(
                handler,
                {"id": self.repo, "modelId": self.repo, "sha": COMMIT, "siblings": siblings},
                send_body,
            )
        elif path.startswith(f"/{self.repo}/resolve/"):
            name = path.split("/resolve/", 1)[1].split("/", 1)[1]
            target = self.root / name
            if not target.is_file():
                self._missing(handler)
                return
            data = target.read_bytes()
            handler.send_response(200)
            handler.send_header("X-Repo-Commit", COMMIT)
            handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            if send_body:
                step = max(1, self.bytes_per_second // 20)
                for start in range(0, len(data), step):
                    handler.wfile.write(data[start : start + step])
                    if len(data) > step:
                        time.sleep(0.05)
        else:
            self._missing(handler)

    @staticmethod
    def _json(handler: BaseHTTPRequestHandler, payload: object, send_body: bool) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if send_body:
            handler.wfile.write(data)

    @staticmethod
    def _missing(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(404)
        handler.send_header("X-Error-Code", "EntryNotFound")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

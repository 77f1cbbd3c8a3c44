"""Stand-ins for the Hugging Face Hub's HTTP API.

`FakeHub` serves one local directory as a repo: enough of the protocol for
`huggingface_hub.snapshot_download` and vLLM's start-up checks (repo info, the file tree, HEAD/GET
on `resolve/` URLs). Large files are sent slowly (`bytes_per_second`) so download progress can be
observed.

`HeaderHub` serves models that have no weights at all (config.json, the safetensors index and
each shard's header by byte range) and records what was asked: the operator's fit check reads
those and must never ask for a weight byte.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass
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
    def _missing(handler: BaseHTTPRequestHandler, code: str = "EntryNotFound") -> None:
        handler.send_response(404)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Length", "0")
        handler.end_headers()


@dataclass
class VirtualRepo:
    """A model on the HeaderHub: its files' contents where they exist (config.json, the index),
    and for each safetensors shard only its header and its full size: the weights do not exist."""

    config: dict
    headers: dict[str, bytes]  # shard file -> its first 8 + N bytes
    index: dict | None = None
    token: str | None = None  # required as "Authorization: Bearer <token>" (a private model)
    delay: float = 0.0  # seconds before config.json is answered (a slow hub)
    commit: str = COMMIT


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    authorization: str | None


class HeaderHub:
    """A stand-in for the Hugging Face Hub's HTTP API serving config.json, the safetensors index
    and shard headers, and no weight bytes: what the operator's fit check may read.

    As the Hub does, `/{repo}/resolve/{revision}/{file}` answers small files itself, with
    `X-Repo-Commit`, and redirects weight files to a CDN path, which serves byte ranges (206,
    Content-Range). A weight file requested without a Range, or a range reaching past the header
    into the weights, is refused and recorded in `violations`: the tests assert there are none.
    """

    def __init__(self, port: int = 0) -> None:
        self.repos: dict[str, VirtualRepo] = {}
        self.seen: list[Seen] = []
        self.violations: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub.seen.append(
                    Seen(
                        "GET",
                        self.path,
                        self.headers.get("Range"),
                        self.headers.get("Authorization"),
                    )
                )
                hub.answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HeaderHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def shard_requests(self, repo: str) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith(f"/cdn/{repo}/")]

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?")[0]
        if path.startswith("/cdn/"):
            self._range(handler, path.removeprefix("/cdn/"))
            return
        repo_name, _, rest = path.lstrip("/").partition("/resolve/")
        repo = self.repos.get(repo_name)
        if repo is None or not rest:
            FakeHub._missing(handler, "RepoNotFound")
            return
        revision, _, file = rest.partition("/")
        if repo.token and handler.headers.get("Authorization") != f"Bearer {repo.token}":
            handler.send_response(401)
            handler.send_header("X-Error-Code", "GatedRepo")
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        if revision not in ("main", repo.commit):
            FakeHub._missing(handler, "RevisionNotFound")
            return
        self._file(handler, repo_name, repo, file)

    def _file(self, handler: BaseHTTPRequestHandler, name: str, repo: VirtualRepo, file: str):
        if file in repo.headers:  # a weight file: the Hub sends it to its CDN
            handler.send_response(302)
            handler.send_header("Location", f"/cdn/{name}/{file}")
            handler.send_header("X-Repo-Commit", repo.commit)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        documents = {"config.json": repo.config, "model.safetensors.index.json": repo.index}
        if documents.get(file) is None:
            FakeHub._missing(handler, "EntryNotFound")
            return
        if file == "config.json" and repo.delay:
            time.sleep(repo.delay)
        data = json.dumps(documents[file]).encode()
        handler.send_response(200)
        handler.send_header("X-Repo-Commit", repo.commit)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _range(self, handler: BaseHTTPRequestHandler, rest: str) -> None:
        name, _, file = rest.rpartition("/")
        header = self.repos[name].headers.get(file) if name in self.repos else None
        asked = handler.headers.get("Range", "")
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", asked)
        if header is None or match is None or int(match.group(2)) >= len(header):
            self.violations.append(f"{file}: {asked or 'no Range'}")
            handler.send_response(403)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        start, end = int(match.group(1)), int(match.group(2))
        data = header[start : end + 1]
        handler.send_response(206)
        handler.send_header("Content-Range", f"bytes {start}-{end}/*")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

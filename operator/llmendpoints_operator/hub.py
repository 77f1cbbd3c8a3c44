"""The operator's client of a model hub (the Hugging Face Hub's HTTP API, or any hub speaking it:
HF_ENDPOINT): a model's config.json and the headers of its safetensors shards. Never its weights.

One of the operator's three network modules (kube.py for the Kubernetes API, autoscaling/scrape.py
for the pods' metrics, this one for hubs; pyproject.toml's import-linter contract names them).

For a model at a revision (a branch, tag or commit; `main` when unset):

1. `GET {hub}/{repo}/resolve/{revision}/config.json`: the architecture and sizes. The response's
   `X-Repo-Commit` pins the commit every later request reads, so one check sees one snapshot;
2. `GET .../model.safetensors.index.json`: the shards (its weight_map's files); a 404 means one
   file, `model.safetensors`;
3. per shard (a few at a time), `Range: bytes=0-7` (the header's length N) then
   `Range: bytes=8-{8+N-1}` (the header): tensor names, dtypes, shapes and byte offsets.
   Redirects (the Hub sends weight files to its CDN) keep the Range header; aiohttp drops the
   Authorization header when a redirect leaves the hub's origin. A server that ignores Range and
   starts sending the whole file is cut off after the bytes asked for.

Every request has the client's timeout; the fit checker bounds the whole read too. Errors are
HubError with a kind the checker turns into an Unknown condition.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

import aiohttp

from llmendpoints_operator.bodies import read_at_most
from llmendpoints_operator.fit.safetensors import (
    LENGTH_BYTES,
    HeaderError,
    Tensor,
    header_length,
    parse_header,
)

logger = logging.getLogger(__name__)

DEFAULT_HUB = "https://huggingface.co"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARDS = 4096
MAX_HEADER = 64 << 20  # far above any real header (a few MiB for the largest MoE shards)
MAX_JSON = 16 << 20  # config.json, the index

Kind = Literal["unauthorized", "not_found", "unavailable", "invalid"]


class HubError(Exception):
    def __init__(self, kind: Kind, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ModelFiles:
    config: dict[str, Any]
    tensors: tuple[Tensor, ...]
    commit: str | None  # the commit the files were read at, when the hub says it
    url: str  # the model's page on the hub


class HubClient:
    """One aiohttp session for every hub the operator's endpoints name."""

    def __init__(self, *, timeout: float = 10.0, concurrency: int = 8) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, headers={"User-Agent": "llmendpoints-operator fit-check"}
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def model(
        self, hub: str, repo: str, revision: str | None, token: str | None
    ) -> ModelFiles:
        """config.json and every shard's header of `repo` at `revision`."""
        reader = _Reader(self._open(), hub.rstrip("/"), repo, revision or "main", token)
        config = await reader.json("config.json", required=True)
        index = await reader.json(INDEX, required=False)
        files = _shards(index)
        semaphore = asyncio.Semaphore(self._concurrency)

        async def one(file: str) -> list[Tensor]:
            async with semaphore:
                return await reader.header(file)

        headers = await asyncio.gather(*(one(f) for f in files))
        tensors = tuple(t for header in headers for t in header)
        return ModelFiles(config, tensors, reader.commit, f"{reader.hub}/{repo}")


def _shards(index: dict[str, Any] | None) -> list[str]:
    if index is None:
        return [SINGLE]
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HubError("invalid", f"{INDEX} has no weight_map")
    files = sorted({str(f) for f in weight_map.values()})
    if len(files) > MAX_SHARDS:
        raise HubError("invalid", f"{INDEX} names {len(files)} files")
    return files


class _Reader:
    """The requests of one model read, pinned to one commit once the hub names it."""

    def __init__(
        self, session: aiohttp.ClientSession, hub: str, repo: str, revision: str, token: str | None
    ):
        self.session, self.hub, self.repo, self.revision = session, hub, repo, revision
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.commit: str | None = None

    def url(self, file: str) -> str:
        revision = self.commit or self.revision
        return f"{self.hub}/{self.repo}/resolve/{quote(revision, safe='')}/{quote(file)}"

    async def json(self, file: str, *, required: bool) -> dict[str, Any] | None:
        data = await self._get(file, None, MAX_JSON, missing_ok=not required)
        if data is None:
            return None
        try:
            value = json.loads(data)
        except ValueError as exc:
            raise HubError("invalid", f"{file} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise HubError("invalid", f"{file} is not a JSON object")
        return value

    async def header(self, file: str) -> list[Tensor]:
        prefix = await self._get(file, (0, LENGTH_BYTES - 1), LENGTH_BYTES)
        try:
            length = header_length(prefix or b"", file)
            if length > MAX_HEADER:
                raise HeaderError(f"{file}: a {length}-byte header")
            data = await self._get(file, (LENGTH_BYTES, LENGTH_BYTES + length - 1), length)
            return parse_header(data or b"", file)
        except HeaderError as exc:
            raise HubError("invalid", str(exc)) from None

    async def _get(
        self, file: str, span: tuple[int, int] | None, limit: int, *, missing_ok: bool = False
    ) -> bytes | None:
        headers = dict(self.headers)
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[1]}"
        url = self.url(file)
        try:
            async with self.session.get(url, headers=headers) as response:
                if response.status in (401, 403):
                    raise HubError(
                        "unauthorized", f"{self.hub} answered {response.status} for {file}"
                    )
                if response.status == 404:
                    if missing_ok:
                        return None
                    raise HubError(
                        "not_found", _not_found(response, self.repo, self.revision, file)
                    )
                if response.status >= 400:
                    raise HubError(
                        "unavailable", f"{self.hub} answered {response.status} for {file}"
                    )
                self.commit = self.commit or response.headers.get("X-Repo-Commit")
                return await _body(response, span, limit, file)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise HubError("unavailable", f"{url}: {exc or type(exc).__name__}") from None


async def _body(
    response: aiohttp.ClientResponse, span: tuple[int, int] | None, limit: int, file: str
) -> bytes:
    """The bytes asked for, and not one more: a 200 to a Range request is cut off."""
    if span is None:
        data = await read_at_most(response.content, limit + 1)
        if len(data) > limit:
            raise HubError("invalid", f"{file} is larger than {limit} bytes")
        return data
    if response.status == 206 and not response.headers.get("Content-Range", "bytes ").startswith(
        f"bytes {span[0]}-"
    ):
        raise HubError("invalid", f"{file}: the hub sent another range than bytes {span[0]}-")
    skip = span[0] if response.status == 200 else 0
    try:
        if skip:
            await response.content.readexactly(skip)
        data = await response.content.readexactly(span[1] - span[0] + 1)
    except asyncio.IncompleteReadError:
        raise HubError("invalid", f"{file} ends inside its safetensors header") from None
    if response.status == 200:
        response.close()  # the server ignored Range: drop the connection, not the weights
    return data


def _not_found(response: aiohttp.ClientResponse, repo: str, revision: str, file: str) -> str:
    code = response.headers.get("X-Error-Code", "")
    if code == "RepoNotFound":
        return f"no model {repo} on the hub (or it is private and the request had no token)"
    if code == "RevisionNotFound":
        return f"{repo} has no revision {revision}"
    if file == SINGLE:
        return f"{repo} has no safetensors weights ({SINGLE} or {INDEX}); the check reads those"
    return f"{repo} at {revision} has no {file}"

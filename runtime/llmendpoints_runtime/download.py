"""Fetch a model from the Hugging Face Hub into the cache under BASE_PATH, with progress.

vLLM would download the weights itself on first load, silently and without progress. Doing it
first, ourselves, gives the start-up a visible `download` phase (bytes done / total, logged at an
interval) and lets `llmendpoints-runtime download` bake a model into an image at build time.
Only what vLLM loads is fetched: safetensors weights when the repo has them (else .bin/.pt), plus
configuration, tokenizer and chat-template files.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("llmendpoints.download")

_ALWAYS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*", "*.py")
_SAFETENSORS = ("*.safetensors",)
_PICKLE = ("*.bin", "*.pt", "*.pth")


class DownloadError(Exception):
    """The model cannot be had: not on the Hub (or no access), or not in an offline cache."""


def is_local_model(model: str) -> bool:
    return Path(model).expanduser().is_dir()


def looks_like_path(model: str) -> bool:
    """A Hub repo id is `name` or `org/name`; anything starting like a path is meant as one."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..")


def model_path_problem(model: str) -> str | None:
    """PURE but for one stat: a model given as a path to no model directory (None: fine, or a
    Hub repo id). Without this, a typo'd path is looked up on the Hub, or, offline, accepted."""
    if model and looks_like_path(model) and not is_local_model(model):
        return (
            f"{model!r} is a path, and there is no model directory there "
            "(a Hugging Face repo id has the form org/name)"
        )
    return None


def missing_local_model(model: str) -> str | None:
    """Why MODEL_NAME cannot be loaded, when it is a path to no directory (the engine's check)."""
    problem = model_path_problem(model)
    return f"MODEL_NAME {problem}" if problem else None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def select_files(files: Iterable[tuple[str, int | None]], *, trust_remote_code: bool) -> list[str]:
    """Which repository files vLLM needs (pure)."""
    names = [name for name, _ in files]
    weights = (
        _SAFETENSORS if any(fnmatch.fnmatch(n, p) for n in names for p in _SAFETENSORS) else _PICKLE
    )
    patterns = [*weights, *(p for p in _ALWAYS if trust_remote_code or p != "*.py")]
    chosen = []
    for name in names:
        if "/" in name and not name.startswith(("tokenizer", "chat_template")):
            # Sub-folders hold other formats (onnx/, original/, gguf/): never what vLLM loads.
            continue
        if any(fnmatch.fnmatch(name, p) for p in patterns):
            chosen.append(name)
    return sorted(chosen)


@dataclass
class Progress:
    total_bytes: int
    done_bytes: int = 0

    def line(self, repo: str, elapsed: float) -> str:
        gib = 1024**3
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        rate = self.done_bytes / elapsed / 1024**2 if elapsed > 0 else 0.0
        return (
            f"downloading {repo}: {self.done_bytes / gib:.2f}/{self.total_bytes / gib:.2f} GiB "
            f"({pct:.0f}%, {rate:.0f} MiB/s)"
        )


def _blob_bytes(cache_dir: Path) -> int:
    total = 0
    if cache_dir.is_dir():
        for entry in os.scandir(cache_dir):
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


@dataclass(frozen=True)
class Downloaded:
    """What a download left in the cache: the model's bytes there, and how many of them this
    download fetched (0: all were cached already)."""

    bytes: int = 0
    fetched_bytes: int = 0

    def __add__(self, other: Downloaded) -> Downloaded:
        return Downloaded(self.bytes + other.bytes, self.fetched_bytes + other.fetched_bytes)


def _download_repo(
    repo: str, revision: str | None, *, trust_remote_code: bool, log_interval: float
) -> Downloaded:
    from huggingface_hub import HfApi, constants, snapshot_download

    info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    files = [(s.rfilename, s.size) for s in info.siblings or []]
    wanted = select_files(files, trust_remote_code=trust_remote_code)
    sizes = dict(files)
    progress = Progress(total_bytes=sum(sizes.get(n) or 0 for n in wanted))
    blobs = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "blobs"
    already = _blob_bytes(blobs)
    logger.info(
        "downloading %s@%s: %d files, %.2f GiB to %s",
        repo,
        revision or "main",
        len(wanted),
        progress.total_bytes / 1024**3,
        constants.HF_HUB_CACHE,
    )
    stop = threading.Event()
    begin = time.monotonic()

    def report() -> None:
        while not stop.wait(log_interval):
            progress.done_bytes = min(progress.total_bytes, _blob_bytes(blobs) - already)
            logger.info(progress.line(repo, time.monotonic() - begin))

    reporter = threading.Thread(target=report, name="download-progress", daemon=True)
    reporter.start()
    try:
        snapshot_download(repo, revision=revision, allow_patterns=wanted)
    finally:
        stop.set()
        reporter.join()
    progress.done_bytes = progress.total_bytes
    logger.info(progress.line(repo, time.monotonic() - begin))
    fetched = max(0, min(progress.total_bytes, _blob_bytes(blobs) - already))
    return Downloaded(progress.total_bytes, fetched)


def download_model(
    model: str,
    *,
    revision: str | None = None,
    tokenizer: str | None = None,
    tokenizer_revision: str | None = None,
    trust_remote_code: bool = False,
    log_interval: float = 10.0,
) -> Downloaded:
    """Make sure the model (and a separate tokenizer) are in the local Hugging Face cache;
    what the Hub repos' wanted files weigh and what was fetched of it (local directories and
    an offline cache count nothing).

    Raises DownloadError saying why it cannot (naming the variable), never a traceback."""
    total = Downloaded()
    wanted = [("MODEL_NAME", model, revision)]
    if tokenizer and tokenizer != model:
        wanted.append(("TOKENIZER_NAME", tokenizer, tokenizer_revision))
    for variable, repo, rev in wanted:
        if is_local_model(repo):
            continue
        if offline():
            _require_cached(variable, repo, rev)
            logger.info("HF_HUB_OFFLINE is set: using %s from the local cache", repo)
            continue
        try:
            total += _download_repo(
                repo, rev, trust_remote_code=trust_remote_code, log_interval=log_interval
            )
        except DownloadError:
            raise
        except Exception as exc:  # the Hub's errors (not found, gated, network) name the cause
            raise DownloadError(f"{variable} {repo!r}: {_hub_reason(exc)}") from None
    return total


def _require_cached(variable: str, repo: str, revision: str | None) -> None:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo, revision=revision, local_files_only=True)
    except Exception as exc:
        raise DownloadError(
            f"{variable} {repo!r} is not in the local cache and HF_HUB_OFFLINE forbids "
            f"downloading it ({_hub_reason(exc)})"
        ) from None


def _hub_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__

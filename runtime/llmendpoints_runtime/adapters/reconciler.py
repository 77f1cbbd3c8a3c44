"""Keeps the engine's loaded LoRA adapters equal to the declared list, without a restart.

Every ``LLMEP_ADAPTERS_POLL_SECONDS`` the mounted file (LLMEP_ADAPTERS_FILE) is read. An adapter
that appears is fetched into the model cache once (a Hugging Face repo, with the pod's HF_TOKEN;
or a local path, used where it is) and loaded into the running engine; one whose source or
revision changes is fetched and loaded again in place; one that disappears is unloaded. Each
adapter is brought up in its own task, so a slow download holds up nobody else.

A failure (download, files, rank, ...) is logged, kept as the adapter's ``error`` and exported on
/metrics; the adapter is retried with a growing delay (5 s doubling up to 5 min) and the base
model keeps serving. /metrics per declared adapter:
``llmendpoints_adapter_ready{adapter}`` (1 loaded, 0 not yet), ``llmendpoints_adapter_load_failures_total{adapter}``
and ``llmendpoints_adapter_error_info{adapter,message}`` (1 while the last attempt failed) -- the
operator reads them from every ready pod into the endpoint's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from llmendpoints_runtime.adapters.declared import (
    AdapterFileError,
    DeclaredAdapter,
    parse_adapters,
    retry_delay,
)

logger = logging.getLogger("llmendpoints.adapters")

State = Literal["downloading", "loading", "ready", "failed"]
# The files vLLM reads from a PEFT adapter repository: nothing else is downloaded.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_MAX_ERROR_LABEL = 300


class AdapterEngine(Protocol):
    """What the reconciler needs from the engine (engine.EngineAdapters implements it)."""

    async def load(self, name: str, path: str, *, replace: bool) -> None: ...

    async def unload(self, name: str) -> None: ...

    def loaded(self) -> frozenset[str]: ...


@dataclass
class AdapterStatus:
    adapter: DeclaredAdapter
    state: State = "downloading"
    error: str | None = None
    failures: int = 0
    retry_at: float = 0.0


def fetch_adapter(adapter: DeclaredAdapter) -> str:
    """A local directory holding the adapter (downloaded into the HF cache if a repo)."""
    if adapter.is_local:
        path = Path(adapter.source)
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{adapter.source}: no adapter_config.json there")
        return str(path)
    from huggingface_hub import snapshot_download

    # Idempotent: files already in the cache (the model-cache volume) are not fetched again.
    return snapshot_download(
        adapter.source, revision=adapter.revision, allow_patterns=ADAPTER_FILES
    )


class AdapterReconciler:
    def __init__(
        self,
        engine: AdapterEngine,
        registry: CollectorRegistry,
        *,
        adapters_file: str | None,
        poll_seconds: float = 2.0,
        base_names: tuple[str, ...] = (),
    ) -> None:
        self.engine = engine
        self.adapters_file = adapters_file
        self.poll_seconds = poll_seconds
        self.base_names = base_names
        self.statuses: dict[str, AdapterStatus] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None
        self._file_text: str | None = None
        self._file_problem: str | None = None
        self._refused: set[str] = set()
        self.ready_gauge = Gauge(
            "llmendpoints_adapter_ready",
            "1 when the declared LoRA adapter is loaded and serving on this pod, 0 until then.",
            ["adapter"],
            registry=registry,
        )
        self.failures = Counter(
            "llmendpoints_adapter_load_failures",
            "Failed attempts to download or load a declared LoRA adapter.",
            ["adapter"],
            registry=registry,
        )
        self.error_info = Gauge(
            "llmendpoints_adapter_error_info",
            "1 while the adapter's last download or load failed; `message` says why.",
            ["adapter", "message"],
            registry=registry,
        )

    # -- what requests see -------------------------------------------------------------------

    @property
    def has_pending(self) -> bool:
        """Some declared adapter is not serving yet (the only time requests need a look)."""
        return any(s.state != "ready" for s in self.statuses.values())

    def pending(self, model: str) -> AdapterStatus | None:
        """The status of ``model`` if it is a declared adapter that does not serve yet."""
        status = self.statuses.get(model)
        return status if status is not None and status.state != "ready" else None

    def retry_after(self, status: AdapterStatus) -> int:
        if status.state == "failed":
            return max(1, round(status.retry_at - time.monotonic()))
        return max(1, round(self.poll_seconds))

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.adapters_file and self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="adapter-reconciler")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._loop_task = None
        self._tasks.clear()

    async def _run(self) -> None:
        while True:
            try:
                declared = self._read_file()
                if declared is not None:
                    await self.sync(declared)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad round end the loop
                logger.exception("adapter reconcile failed; trying again")
            await asyncio.sleep(self.poll_seconds)

    def _read_file(self) -> tuple[DeclaredAdapter, ...] | None:
        """The declared list, or None to keep the current one (unreadable or malformed)."""
        assert self.adapters_file is not None
        try:
            text = Path(self.adapters_file).read_text()
        except FileNotFoundError:
            text = ""  # no file (yet): nothing declared
        except OSError as exc:
            return self._bad_file(f"cannot read {self.adapters_file}: {exc}")
        try:
            declared = parse_adapters(text)
        except AdapterFileError as exc:
            return self._bad_file(f"{self.adapters_file}: {exc}")
        if text != self._file_text:
            self._file_text, self._file_problem = text, None
            logger.info("adapters declared: %s", ", ".join(a.name for a in declared) or "(none)")
        return declared

    def _bad_file(self, problem: str) -> None:
        if problem != self._file_problem:  # once per distinct problem, not every poll
            logger.error("LoRA adapters file unusable, keeping the last good list: %s", problem)
            self._file_problem = problem
        return None

    # -- reconcile -----------------------------------------------------------------------------

    async def sync(self, declared: tuple[DeclaredAdapter, ...]) -> None:
        """Bring the engine's adapters towards ``declared`` (starts tasks; does not wait)."""
        wanted = {a.name: a for a in declared}
        for name in [n for n in self.statuses if n not in wanted]:
            await self._remove(name)
        now = time.monotonic()
        for name, adapter in wanted.items():
            if name in self.base_names:
                # The CRD refuses this; a hand-written file may not. The base model wins.
                if name not in self._refused:
                    logger.error("adapter %s ignored: it is the base model's served name", name)
                    self._refused.add(name)
                continue
            status = self.statuses.get(name)
            if status is None or status.adapter != adapter:
                self._cancel_task(name)
                status = AdapterStatus(adapter=adapter)
                self.statuses[name] = status
                self.ready_gauge.labels(adapter=name).set(0)
                self._start(status)
            elif status.state == "failed" and now >= status.retry_at and name not in self._tasks:
                self._start(status)

    def _start(self, status: AdapterStatus) -> None:
        name = status.adapter.name
        self._tasks[name] = asyncio.create_task(self._bring_up(status), name=f"adapter-{name}")

    async def _bring_up(self, status: AdapterStatus) -> None:
        adapter = status.adapter
        name = adapter.name
        try:
            status.state, status.error = "downloading", None
            began = time.monotonic()
            path = await asyncio.to_thread(fetch_adapter, adapter)
            status.state = "loading"
            # In place when the engine holds this name already (an earlier version, or a load
            # that completed just as its task was cancelled).
            await self.engine.load(name, path, replace=name in self.engine.loaded())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._record_failure(status, _describe(exc))
        else:
            status.state, status.failures = "ready", 0
            self.ready_gauge.labels(adapter=name).set(1)
            self._clear_error(name)
            logger.info(
                "adapter %s ready (%s) after %.1f s",
                name,
                adapter.describe(),
                time.monotonic() - began,
            )
        finally:
            if self._tasks.get(name) is asyncio.current_task():
                del self._tasks[name]

    def _record_failure(self, status: AdapterStatus, message: str) -> None:
        name = status.adapter.name
        status.failures += 1
        delay = retry_delay(status.failures)
        status.state, status.error = "failed", message
        status.retry_at = time.monotonic() + delay
        self.failures.labels(adapter=name).inc()
        self.ready_gauge.labels(adapter=name).set(0)
        self._clear_error(name)
        self.error_info.labels(adapter=name, message=message[:_MAX_ERROR_LABEL]).set(1)
        logger.error(
            "adapter %s (%s) failed (attempt %d, next in %.0f s); the base model keeps serving: %s",
            name,
            status.adapter.describe(),
            status.failures,
            delay,
            message,
        )

    async def _remove(self, name: str) -> None:
        self._cancel_task(name)
        self.statuses.pop(name)
        if name in self.engine.loaded():  # also when a cancelled load got through
            await self.engine.unload(name)
            logger.info("adapter %s unloaded (no longer declared)", name)
        for series in (self.ready_gauge, self.failures):
            with contextlib.suppress(KeyError):
                series.remove(name)
        self._clear_error(name)

    def _cancel_task(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    def _clear_error(self, name: str) -> None:
        for labels in [lbl for lbl in _label_sets(self.error_info) if lbl[0] == name]:
            with contextlib.suppress(KeyError):
                self.error_info.remove(*labels)


def _label_sets(gauge: Gauge) -> list[tuple[str, ...]]:
    return [
        tuple(sample.labels[k] for k in ("adapter", "message"))
        for metric in gauge.collect()
        for sample in metric.samples
    ]


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if type(exc).__name__ == "AdapterLoadError" else f"{type(exc).__name__}: {text}"

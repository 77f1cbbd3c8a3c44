"""The operator's side of the shared job queue: its NATS connection, the queue's streams, each
endpoint's worker consumers, and each endpoint's own credential.

- Credentials: with ``LLMEP_OPERATOR_JOBS_QUEUE_KEYS_DIR`` the operator holds the queue
  account's signing key. It mints its own credential (role ``operator``, in memory) and one per
  endpoint (role ``runtime``: that endpoint's subjects, records and consumers only;
  llmendpoints_common.queue.roles), which the reconcile writes into the endpoint's Secret.
  Without it the URL's password is everyone's (a NATS you bring; weaker).
- Streams and consumers: created here, not by the runtime pods, whose credential may not. The
  shared streams at connect; an endpoint's own two streams, its worker consumers and the
  gateway's usage consumer when it is reconciled (and again at an autoscaler read, should NATS
  have been down then). Existing ones keep their configuration but for their bounds
  (``max_bytes``, message size, the per-owner cap: this operator's settings), which are set on
  them, so an installation from before a bound existed gets it on upgrade.
- A deleted endpoint's two streams are deleted with it (its jobs go, and the storage JetStream
  reserved for it is freed). The first layout's shared job streams (``names.LEGACY_STREAMS``)
  are left for an admin to remove; the operator says so when it finds them.

One connection per operator process; nats-py reconnects on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time

from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue import names
from llmendpoints_common.queue.client import QueueConnection
from llmendpoints_common.queue.topology import (
    QueueLayout,
    delete_endpoint_streams,
    ensure_endpoint_queue,
    ensure_streams,
)
from llmendpoints_common.queue.trust import Signer, mint

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECONDS = 2.0


class JobsQueue:
    def __init__(self, url: str, *, layout: QueueLayout, signer: Signer | None = None) -> None:
        self.url = url
        self.layout = layout
        self.signer = signer
        self._connection: QueueConnection | None = None
        self._lock = asyncio.Lock()
        self._consumers_made: set[EndpointRef] = set()

    @classmethod
    def from_settings(cls, settings) -> JobsQueue | None:  # OperatorSettings
        if not settings.jobs_queue_url:
            return None
        signer = (
            Signer.from_dir(settings.jobs_queue_keys_dir) if settings.jobs_queue_keys_dir else None
        )
        default = QueueLayout()
        layout = QueueLayout(
            replicas=settings.jobs_queue_replicas or 1,
            files_max_bytes=settings.jobs_queue_files_max_bytes or default.files_max_bytes,
            usage_max_bytes=settings.jobs_queue_usage_max_bytes or default.usage_max_bytes,
            endpoint_max_bytes=settings.jobs_queue_endpoint_max_bytes,
            max_queued_per_owner=settings.jobs_max_queued_per_owner,
        )
        return cls(settings.jobs_queue_url, layout=layout, signer=signer)

    @property
    def per_endpoint_credentials(self) -> bool:
        return self.signer is not None

    def endpoint_creds(self, endpoint: EndpointRef) -> str:
        """A new creds file for the runtime pods of ``endpoint`` (and nothing else)."""
        assert self.signer is not None, "no keys: there are no per-endpoint credentials"
        return mint(self.signer, "runtime", endpoint, issued_at=int(time.time()))

    async def connection(self) -> QueueConnection:
        """The operator's connection, opened (and the streams created) on first use."""
        async with self._lock:
            if self._connection is None or self._connection.nc.is_closed:
                creds = (
                    mint(self.signer, "operator", issued_at=int(time.time()))
                    if self.signer is not None
                    else None
                )
                self._connection = await QueueConnection.connect(
                    self.url,
                    name="llmendpoints-operator",
                    creds=creds,
                    layout=self.layout,
                    connect_timeout=CONNECT_TIMEOUT_SECONDS,
                )
                # The bounds are this operator's settings, also on existing streams.
                await ensure_streams(self._connection.js, self.layout, reconcile=True)
                await self._warn_legacy(self._connection)
            return self._connection

    @staticmethod
    async def _warn_legacy(connection: QueueConnection) -> None:
        for stream in names.LEGACY_STREAMS:
            try:
                info = await connection.js.stream_info(stream)
            except Exception:
                continue
            logger.warning(
                "the queue stream %s (the first queue layout, %d messages) is no longer used: "
                "an admin removes it once its jobs are no longer wanted (docs/install.md)",
                stream,
                info.state.messages,
            )

    async def ensure_endpoint(self, endpoint: EndpointRef) -> None:
        """The endpoint's streams (with this operator's bounds) and consumers exist (checked
        once per process; idempotent)."""
        if endpoint in self._consumers_made:
            return
        connection = await self.connection()
        await ensure_endpoint_queue(connection.js, endpoint, self.layout, reconcile=True)
        self._consumers_made.add(endpoint)

    async def drop_endpoint(self, endpoint: EndpointRef) -> bool:
        """The endpoint was deleted: its streams go (a new one of the same name gets new
        ones). True when there was something to remove."""
        self._consumers_made.discard(endpoint)
        connection = await self.connection()
        return await delete_endpoint_streams(connection.js, endpoint)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
        self._connection = None

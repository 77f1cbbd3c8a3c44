"""The operator's side of the shared job queue: its NATS connection, the queue's streams, each
endpoint's worker consumers, and each endpoint's own credential.

- Credentials: with ``LLMEP_OPERATOR_JOBS_QUEUE_KEYS_DIR`` the operator holds the queue
  account's signing key. It mints its own credential (role ``operator``, in memory) and one per
  endpoint (role ``runtime``: that endpoint's subjects, records and consumers only;
  llmendpoints_common.queue.roles), which the reconcile writes into the endpoint's Secret.
  Without it the URL's password is everyone's (a NATS you bring; weaker).
- Streams and consumers: created here, not by the runtime pods, whose credential may not. The
  streams at connect; an endpoint's two worker consumers when it is reconciled (and again at an
  autoscaler read, should NATS have been down then). Existing ones are left as they are, but
  for the per-owner cap (the jobs stream's per-subject limit, set to this operator's setting)
  and the worker consumers' filters (made to take jobs queued per owner).

One connection per operator process; nats-py reconnects on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time

from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue.client import QueueConnection
from llmendpoints_common.queue.topology import QueueLayout, ensure_consumers, ensure_streams
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
        layout = QueueLayout(
            replicas=settings.jobs_queue_replicas or 1,
            files_max_bytes=settings.jobs_queue_files_max_bytes or -1,
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
                # The per-owner cap is this operator's setting, also on an existing stream.
                await ensure_streams(self._connection.js, self.layout, reconcile=True)
            return self._connection

    async def ensure_endpoint(self, endpoint: EndpointRef) -> None:
        """The endpoint's worker consumers exist (created once per process; idempotent)."""
        if endpoint in self._consumers_made:
            return
        connection = await self.connection()
        await ensure_consumers(connection.js, endpoint, self.layout)
        self._consumers_made.add(endpoint)

    def forget(self, endpoint: EndpointRef) -> None:
        """The endpoint is gone: a new one of the same name gets its consumers checked again."""
        self._consumers_made.discard(endpoint)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
        self._connection = None

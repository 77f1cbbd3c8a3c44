"""Media fetching: vLLM's media connector, with every URL fetch through
``media_fetch.MediaFetcher`` (the destination guard)."""

from __future__ import annotations

import logging
import os

from llmendpoints_runtime.media_fetch import MediaFetchError, MediaFetchLimits

logger = logging.getLogger("llmendpoints.engine")


def install_media_fetcher(fetcher) -> None:
    """Make vLLM fetch media URLs (images in chat messages) only through `fetcher`.

    vLLM resolves its media connector by name from a registry on every request
    (``VLLM_MEDIA_CONNECTOR``, default ``http``); the class registered here under that default
    name keeps vLLM's own handling of data: and file: URLs, ALLOWED_MEDIA_DOMAINS and the
    media cache, and replaces the HTTP client with the guarded fetcher. Refusals become vLLM's
    validation error (a 400 naming ``image_url``); so do the cases vLLM itself answers with
    422 (a 4xx from the image host), 500 (file: without ALLOWED_LOCAL_MEDIA_PATH) or 501
    (a data: URL that is not base64).
    """
    from vllm import envs
    from vllm.connections import HTTPConnection
    from vllm.exceptions import VLLMValidationError
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

    def refused(message: str) -> VLLMValidationError:
        return VLLMValidationError(message, parameter="image_url")

    def limits(timeout, allow_redirects: bool, max_bytes: int | None) -> MediaFetchLimits:
        download_cap = envs.VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB * 1024 * 1024
        caps = [c for c in (max_bytes, download_cap if download_cap > 0 else None) if c]
        return MediaFetchLimits(
            timeout=timeout,
            attempts=max(1, envs.VLLM_MEDIA_FETCH_MAX_RETRIES),
            max_bytes=min(caps) if caps else None,
            follow_redirects=bool(allow_redirects),
        )

    class GuardedConnection(HTTPConnection):
        async def async_get_bytes(self, url, *, timeout=None, allow_redirects=True, max_bytes=None):
            try:
                return await fetcher.fetch(url, limits(timeout, allow_redirects, max_bytes))
            except MediaFetchError as exc:
                raise refused(str(exc)) from None

        def get_bytes(self, url, *, timeout=None, allow_redirects=True, max_bytes=None):
            try:
                return fetcher.fetch_blocking(url, limits(timeout, allow_redirects, max_bytes))
            except MediaFetchError as exc:
                raise refused(str(exc)) from None

        # Every other way of using this connection would bypass the guard.
        def get_response(self, url, **_):
            raise refused(f"media connector: unguarded fetch of {url!r} refused")

        async def get_async_response(self, url, **_):
            raise refused(f"media connector: unguarded fetch of {url!r} refused")

    class GuardedMediaConnector(MediaConnector):
        def __init__(self, *args, **kwargs):
            kwargs["connection"] = GuardedConnection()
            super().__init__(*args, **kwargs)

        def _load_data_url(self, url, media_io):
            spec, comma, _ = url[5:].partition(",")
            if not comma or spec.rpartition(";")[2] != "base64":
                raise refused("data: URLs must be base64 (data:<type>;base64,<data>)")
            return super()._load_data_url(url, media_io)

        def _load_file_url(self, url_spec, media_io):
            if self.allowed_local_media_path is None:
                raise refused(
                    "file: URLs are refused: this server reads no local files "
                    "(ALLOWED_LOCAL_MEDIA_PATH is not set)"
                )
            return super()._load_file_url(url_spec, media_io)

    MEDIA_CONNECTOR_REGISTRY.register("http")(GuardedMediaConnector)
    chosen = os.environ.get("VLLM_MEDIA_CONNECTOR", "http")
    if chosen != "http":
        logger.warning(
            "VLLM_MEDIA_CONNECTOR=%s: media URLs are fetched by that connector, outside the "
            "runtime's destination guard",
            chosen,
        )

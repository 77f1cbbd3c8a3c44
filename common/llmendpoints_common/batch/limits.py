"""What a batch, a file and a key may hold: one set of numbers for both front doors.

``BatchEnv`` is the settings mixin ``RuntimeSettings`` and ``GatewaySettings`` both extend (one
variable name, one default, one meaning in both); ``BatchLimits`` is the plain value the pure
code takes. Defaults follow OpenAI's documented limits where it has one (50,000 requests and
200 MB per input file, a 24 h window, batch files kept 30 days) and RunPod's for its batch
jobs (5,000 requests per batch, 10 active batches per endpoint).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmendpoints_common.errors import BadRequestError

DAY = 86_400
MiB = 1024 * 1024

# OpenAI's completion windows are "24h"; shorter or longer ones are spelled the same way.
_WINDOW = re.compile(r"(?P<n>[1-9][0-9]{0,6})(?P<unit>[smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": DAY}


@dataclass(frozen=True)
class BatchLimits:
    max_requests: int = 50_000
    max_file_bytes: int = 200 * 1000 * 1000
    # One request's bytes (a line of the input file): it travels as one queue message.
    max_line_bytes: int = 1_000_000
    # Every error of a file that fails validation is not worth a 50,000-entry list.
    max_errors: int = 100
    min_window_seconds: int = 3600
    max_window_seconds: int = 7 * DAY
    default_window: str = "24h"
    # Input files (purpose=batch) expire after this unless the upload says otherwise; output
    # and error files too (OpenAI: 30 days for both).
    file_ttl_seconds: int = 30 * DAY
    min_file_ttl_seconds: int = 3600
    max_file_ttl_seconds: int = 30 * DAY
    # Per key (tenant): stored files and their bytes, batches not ended, tokens they queue.
    max_files_per_key: int = 1_000
    max_bytes_per_key: int = 2 * 1000 * 1000 * 1000
    max_active_batches_per_key: int = 100
    max_enqueued_tokens_per_key: int = 20_000_000
    # RunPod's batch jobs: requests per batch, active (not ended) batches per endpoint and key.
    runpod_max_requests: int = 5_000
    runpod_max_active_batches: int = 10
    # Lines of one batch the driver keeps queued or running at once.
    window_lines: int = 256
    # Tokens a line without max_tokens is counted for (enqueued-token limit).
    default_max_tokens: int = 1024
    # An upload has this long to arrive (its room is held that long at most).
    upload_timeout_seconds: float = 600.0

    def window_seconds(self, window: object) -> int:
        """``"24h"`` -> 86400; 400 naming ``completion_window`` for anything else."""
        if not isinstance(window, str) or (match := _WINDOW.fullmatch(window)) is None:
            raise BadRequestError(
                f"completion_window: {window!r} is not a duration such as '24h' (a whole "
                "number followed by s, m, h or d)",
                param="completion_window",
            )
        seconds = int(match["n"]) * _UNIT_SECONDS[match["unit"]]
        if not self.min_window_seconds <= seconds <= self.max_window_seconds:
            raise BadRequestError(
                f"completion_window: {window} is outside what this server runs "
                f"({self.min_window_seconds} to {self.max_window_seconds} s; "
                "LLMEP_BATCH_MIN_WINDOW_SECONDS, LLMEP_BATCH_MAX_WINDOW_SECONDS)",
                param="completion_window",
            )
        return seconds


class BatchEnv(BaseSettings):
    """The batch settings both front doors read (a mixin of their settings classes)."""

    model_config = SettingsConfigDict(populate_by_name=False, extra="ignore", frozen=True)

    batch_enabled: bool = Field(
        True,
        validation_alias="LLMEP_BATCH_ENABLED",
        description="Serve the batch APIs (OpenAI `/v1/files` + `/v1/batches`, RunPod "
        "`/v2/{endpoint}/batch`). The runtime then also runs vLLM with "
        "`--scheduling-policy priority` so batch requests yield to interactive ones.",
    )
    batch_max_file_bytes: int = Field(
        200 * 1000 * 1000,
        ge=1024,
        validation_alias="LLMEP_BATCH_MAX_FILE_BYTES",
        description="Largest file `/v1/files` takes (413 beyond; OpenAI: 200 MB).",
    )
    batch_max_requests: int = Field(
        50_000,
        ge=1,
        validation_alias="LLMEP_BATCH_MAX_REQUESTS",
        description="Most requests (lines) in one OpenAI batch (OpenAI: 50,000).",
    )
    batch_max_line_bytes: int = Field(
        1_000_000,
        ge=1024,
        validation_alias="LLMEP_BATCH_MAX_LINE_BYTES",
        description="Largest request (one line of an input file, one RunPod batch request): "
        "each is one job in the queue.",
    )
    batch_upload_timeout_seconds: float = Field(
        600.0,
        gt=0,
        validation_alias="LLMEP_BATCH_UPLOAD_TIMEOUT_SECONDS",
        description="A `/v1/files` upload not complete this long after its headers gets 408.",
    )
    batch_min_window_seconds: int = Field(
        3600,
        ge=1,
        validation_alias="LLMEP_BATCH_MIN_WINDOW_SECONDS",
        description="Shortest `completion_window` a batch may ask for (OpenAI's is `24h`).",
    )
    batch_max_window_seconds: int = Field(
        7 * DAY,
        ge=1,
        validation_alias="LLMEP_BATCH_MAX_WINDOW_SECONDS",
        description="Longest `completion_window` a batch may ask for.",
    )
    batch_file_ttl_seconds: int = Field(
        30 * DAY,
        ge=60,
        validation_alias="LLMEP_BATCH_FILE_TTL_SECONDS",
        description="How long input, output and error files are kept unless `expires_after` / "
        "`output_expires_after` say otherwise (OpenAI: 30 days); a batch's record goes with "
        "its output files.",
    )
    batch_max_files_per_key: int = Field(
        1000,
        ge=1,
        validation_alias="LLMEP_BATCH_MAX_FILES_PER_KEY",
        description="Files one API key may keep stored (outputs included); 429 beyond.",
    )
    batch_max_bytes_per_key: int = Field(
        2 * 1000 * 1000 * 1000,
        ge=1024,
        validation_alias="LLMEP_BATCH_MAX_BYTES_PER_KEY",
        description="Bytes of files one API key may keep stored; 429 beyond.",
    )
    batch_max_active_per_key: int = Field(
        100,
        ge=1,
        validation_alias="LLMEP_BATCH_MAX_ACTIVE_PER_KEY",
        description="Batches of one API key not ended yet; 429 beyond.",
    )
    batch_max_enqueued_tokens: int = Field(
        20_000_000,
        ge=1,
        validation_alias="LLMEP_BATCH_MAX_ENQUEUED_TOKENS",
        description="Tokens one API key may have queued in batches not ended (prompt estimate "
        '+ max_tokens per request; OpenAI\'s "batch queue limit"); a batch beyond gets 429.',
    )
    batch_window_lines: int = Field(
        256,
        ge=1,
        validation_alias="LLMEP_BATCH_WINDOW_LINES",
        description="Requests of one batch queued or running at once (the rest wait in the "
        "batch's stored input).",
    )

    def batch_limits(self) -> BatchLimits:
        return BatchLimits(
            max_requests=self.batch_max_requests,
            max_file_bytes=self.batch_max_file_bytes,
            max_line_bytes=self.batch_max_line_bytes,
            min_window_seconds=self.batch_min_window_seconds,
            max_window_seconds=max(self.batch_max_window_seconds, self.batch_min_window_seconds),
            file_ttl_seconds=self.batch_file_ttl_seconds,
            max_file_ttl_seconds=max(30 * DAY, self.batch_file_ttl_seconds),
            min_file_ttl_seconds=min(3600, self.batch_file_ttl_seconds),
            max_files_per_key=self.batch_max_files_per_key,
            max_bytes_per_key=self.batch_max_bytes_per_key,
            max_active_batches_per_key=self.batch_max_active_per_key,
            max_enqueued_tokens_per_key=self.batch_max_enqueued_tokens,
            window_lines=self.batch_window_lines,
            upload_timeout_seconds=self.batch_upload_timeout_seconds,
        )

"""Service configuration, read once from `FTC_*` environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything the API and the workers need to find Redis, the object store and the teams.

    One class so that a deployment is described by its environment alone (see docs/service.md).
    """

    model_config = SettingsConfigDict(env_prefix="FTC_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_seconds: float = Field(2.0, gt=0, description="Socket timeout; an outage answers 503 fast.")
    key_prefix: str = Field("ftc", pattern=r"^[A-Za-z0-9_.-]+$", description="Namespace of every Redis key.")

    store_url: str = Field("./ftc-store", description="A local folder path or s3://bucket/prefix.")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, ...); None = AWS.")
    s3_region: str = "us-east-1"
    s3_presign_endpoint_url: str | None = Field(
        None, description="Endpoint put in download links, when clients reach S3 by another name."
    )
    store_retries: int = Field(5, ge=1, description="Attempts per object-store call before giving up.")
    store_backoff_seconds: float = Field(0.2, ge=0, description="First retry delay; doubles each attempt.")
    store_backoff_max_seconds: float = Field(10.0, ge=0, description="Longest delay between two store tries.")
    presign_seconds: int = Field(3600, ge=60, le=7 * 24 * 3600)

    api_keys: str = Field("", description="`key:team,...` or the path of a file with one `key:team` a line.")

    lease_seconds: int = Field(120, ge=5, description="A worker that stops heartbeating loses its job.")
    max_attempts: int = Field(3, ge=1, description="Deliveries of one job before it fails for good.")
    redis_retry_seconds: float = Field(
        0.2, gt=0, description="First wait of a worker after Redis did not answer; doubles each failure."
    )
    redis_retry_max_seconds: float = Field(5.0, gt=0, description="Longest wait between two tries to reach Redis.")
    janitor_interval_seconds: float = Field(15.0, ge=0, description="0 turns the in-API janitor off.")
    idempotency_ttl_seconds: int = Field(24 * 3600, ge=60)
    max_upload_bytes: int = Field(512 * 1024 * 1024, ge=1)
    max_body_bytes: int = Field(
        1024 * 1024, ge=1024, description="Largest request body other than an upload; 413 beyond, read no further."
    )
    max_calib_tokens: int = Field(
        1024 * 1024,
        ge=16,
        description="Largest calibration.samples x calibration.seq_len a job may ask for: the calibration "
        "stream is tokens x hidden float32 values per copy (16 GiB at this default for hidden 4096).",
    )
    max_streams_per_team: int = Field(
        1000, ge=1, description="Open event streams one team may hold over all API processes; 429 beyond."
    )
    teams: str = Field(
        "",
        description="Per-team weights, quotas and the right to priority high: a JSON object or the path of a "
        "JSON file (service/teams.py).",
    )
    quota_queued_jobs: int = Field(1000, ge=0, description="Queued jobs one team may have at once; 0: no limit.")
    quota_running_jobs: int = Field(
        0, ge=0, description="Jobs of one team workers run at once (the rest wait their turn); 0: no limit."
    )
    quota_submissions_per_minute: int = Field(
        600, ge=0, description="Job submissions one team may make a minute (bursts up to this many); 0: no limit."
    )
    quota_upload_bytes: int = Field(
        10 * 1024**3, ge=0, description="Total bytes of one team's calibration uploads; 0: no limit."
    )
    quota_sweeps: int = Field(
        50, ge=0, description="Sweeps one team may have live (scheduled, or with a run under way); 0: no limit."
    )
    quota_min_schedule_seconds: int = Field(
        3600, ge=0, description="Shortest gap between two runs of a sweep's schedule; 0: any."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="text: `time LEVEL logger: message` lines; json: one JSON object a line (service/logs.py)."
    )

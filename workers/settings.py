"""The worker's configuration: the service settings every process shares, plus what only workers need.

Workers read the same `FTC_*` environment as the API (Redis, object store, lease, attempts), so one
environment describes a deployment. The additions say where models and scratch space live on the
worker's machine and how much of it one worker may use.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from service.retention import parse_keep
from service.settings import Settings


class WorkerSettings(Settings):
    models_dir: str | None = Field(
        None,
        description="Folder of local models: a job's model `org/name` is read from `{models_dir}/org/name` "
        "(a Hugging Face folder) or `{models_dir}/org/name.gguf` when it is there, else from the Hugging Face "
        "cache (HF_HOME; downloaded unless HF_HUB_OFFLINE=1). Aliases such as smollm2-135m need nothing.",
    )
    work_dir: str = Field(
        str(Path(tempfile.gettempdir()) / "ftc-worker"),
        description="Local scratch space: per-attempt checkpoints and artifacts, and cached calibration uploads.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: one actor per GPU when the Ray cluster has GPUs, else CPU actors."
    )
    cpus_per_worker: int = Field(1, ge=1, description="CPU cores each worker actor reserves (and torch threads).")
    worker_metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the worker's Prometheus endpoint (/metrics), served by the `ftc worker` process for "
        "its actors on this node; 0 serves none.",
    )
    actor_resources: dict[str, float] = Field(
        default_factory=dict,
        description='Custom Ray resources each worker actor needs, as JSON (e.g. {"ftc_worker_node": 1}): the '
        "actors then run only on nodes started with them (`ray start --resources`), e.g. one node pool.",
    )
    keep_checkpoints: str = Field(
        "7d",
        description="How long a succeeded job's per-layer checkpoints stay in the object store: a duration "
        "(0, 3600, 90m, 12h, 7d; 0 deletes them when the job is published) or 'forever'. Deleted by the "
        "workers after each job and by `ftc scheduler` on every pass.",
    )

    @field_validator("keep_checkpoints")
    @classmethod
    def _a_duration(cls, value: str) -> str:
        parse_keep(value)
        return value

    @property
    def keep_checkpoints_seconds(self) -> float | None:
        """`keep_checkpoints` in seconds; None keeps them forever."""
        return parse_keep(self.keep_checkpoints)

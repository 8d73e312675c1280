"""Where things live in the object store, and which keys are acceptable.

{team}/jobs/{job_id}/manifest.json            written last: the job's artifacts are complete
{team}/jobs/{job_id}/model.safetensors
{team}/jobs/{job_id}/metrics.json
{team}/jobs/{job_id}/log.txt
{team}/jobs/{job_id}/dense/...                 the dense export, when the job asked for it
{team}/jobs/{job_id}/checkpoints/layer-XXX.safetensors   deleted FTC_KEEP_CHECKPOINTS after success
{team}/uploads/{upload_id}/{filename}         calibration files sent with POST /v1/uploads
{team}/plans/{key}.json                       layer plans of allocation 'sensitivity', shared by the workers
"""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
MODEL = "model.safetensors"
METRICS = "metrics.json"
LOG = "log.txt"
CHECKPOINTS = "checkpoints/"
"""Per-layer checkpoints an attempt resumes from, under the job's folder."""
DENSE = "dense/"
"""The dense export (a stock checkpoint), under the job's folder."""

_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
FILENAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$"
UPLOAD_SUFFIXES = (".txt", ".jsonl")


def check_key(key: str) -> str:
    """Accept only plain relative keys: no '..', no empty or hidden segments, nothing to escape a folder."""
    segments = key.split("/")
    if not key or len(key) > 1024 or not all(_SEGMENT.match(s) for s in segments):
        raise ValueError(f"invalid object key {key!r}: use letters, digits, '._-' and '/' between names")
    return key


def job_prefix(team: str, job_id: str) -> str:
    return f"{team}/jobs/{job_id}/"


def checkpoint_name(layer: int) -> str:
    return f"{CHECKPOINTS}layer-{layer:03d}.safetensors"


def uploads_prefix(team: str) -> str:
    return f"{team}/uploads/"


def upload_key(team: str, upload_id: str, filename: str) -> str:
    return f"{uploads_prefix(team)}{upload_id}/{filename}"


def plans_prefix(team: str) -> str:
    return f"{team}/plans/"


def plan_object(team: str, key: str) -> str:
    """Where the team's layer plan `key` (`ftc.compression.sensitivity.plan_key`) is kept."""
    return f"{plans_prefix(team)}{key}.json"

"""Health, readiness, metrics, the OpenAPI document, and what the API process imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from api.app import create_app
from tests.support.service import API_KEYS, Api


def test_healthz_and_readyz_answer_without_a_key(api: Api) -> None:
    client = api.client(team=None)
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "redis": "ok", "store": "ok"}


def test_readyz_checks_the_s3_store_too(api_factory) -> None:
    assert api_factory("s3").client(team=None).get("/readyz").json()["store"] == "ok"
    missing_bucket = api_factory("s3", store_url="s3://no-such-bucket/x")
    response = missing_bucket.client(team=None).get("/readyz")
    assert response.status_code == 503 and response.json()["store"].startswith("unreachable")


def test_metrics_report_queue_depth_jobs_by_status_and_latency(api: Api, job_request: dict) -> None:
    client = api.client()
    for seed in range(3):
        client.post("/v1/jobs", json={**job_request, "priority": "high", "calibration": {"seed": seed}})
    client.delete(f"/v1/jobs/{client.get('/v1/jobs').json()['jobs'][0]['id']}")
    text = client.get("/metrics").text
    assert 'ftc_queue_depth{priority="high"} 2.0' in text
    assert 'ftc_jobs{status="queued"} 2.0' in text and 'ftc_jobs{status="cancelled"} 1.0' in text
    assert "ftc_redis_up 1.0" in text
    assert 'ftc_api_request_seconds_bucket{le="0.1",method="POST",route="/v1/jobs",status="201"}' in text
    assert 'route="/v1/jobs/{job_id}"' in text  # templated routes keep the label set small


def test_the_openapi_document_describes_auth_and_every_route(api: Api) -> None:
    spec = api.client(team=None).get("/openapi.json").json()
    assert {
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/artifacts",
        "/v1/uploads",
        "/healthz",
        "/readyz",
        "/metrics",
    } <= set(spec["paths"])
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_the_api_process_never_imports_torch_or_ray(tmp_path) -> None:
    program = f"""
import json, sys
from api.app import create_app
from service.settings import Settings
from cli.main import build_parser
build_parser()
create_app(Settings(api_keys={API_KEYS!r}, store_url={str(tmp_path)!r}))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray", "ftc", "transformers"))))
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    # Only the light name registries: option names, hub-id syntax and the downstream task names.
    # The subpackages' __init__ files import nothing, so `ftc.models` and `ftc.evaluation` stay light.
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [
        "ftc", "ftc.evaluation", "ftc.evaluation.tasks", "ftc.models", "ftc.models.hub", "ftc.options",
    ]


def test_bad_settings_fail_when_the_app_is_made(service_settings) -> None:
    with pytest.raises(ValueError, match="FTC_API_KEYS is empty"):
        create_app(service_settings(api_keys=""))
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        create_app(service_settings(store_url="gs://bucket/x"))

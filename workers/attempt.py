"""One worker's attempt at one job: prepare, compress layer by layer, evaluate, publish.

It is the same pipeline as `ftc compress` followed by `ftc eval`, with three additions: the work
folder is restored from and mirrored to the object store (so another worker can resume), progress
goes to the job record after every layer, and between layers the job may be told to stop.
Everything here blocks; the worker runs it in a thread while its event loop keeps the lease.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis

from ftc.compression.compress import CompressOptions, compress
from ftc.evaluation.tasks import task_file
from ftc.models.registry import resolve_model
from ftc.models.weights import load_config
from service.keys import Keys
from service.logs import set_log_context
from service.plans import SharedPlans
from service.queue import Lease
from service.redis_client import connect_sync
from service.schemas import JobRecord, Progress
from service.store import ObjectStore
from service.store.layout import job_prefix
from workers.checkpoints import CheckpointSync
from workers.control import JobControl
from workers.evaluation import evaluate
from workers.inputs import compress_options, local_dataset, model_spec
from workers.joblog import JobLog
from workers.metrics import record_layer
from workers.plans import StorePlans
from workers.progress import ProgressClock
from workers.publish import finalise, upload_outputs
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Inputs:
    """What the request names, made local: the model spec, options, dataset files, and the layers."""

    model: str
    options: CompressOptions
    datasets: dict[str, str]
    layers: int
    restored: int
    """Layers finished by earlier attempts, restored from the object store."""


class Attempt:
    """Runs a claimed job in `folder` (fresh, private to this attempt); `run()` returns its metrics."""

    def __init__(
        self,
        record: JobRecord,
        lease: Lease,
        settings: WorkerSettings,
        store: ObjectStore,
        device: str,
        control: JobControl,
        job_log: JobLog,
        folder: Path,
    ) -> None:
        self.record = record
        self.lease = lease
        self.settings = settings
        self.store = store
        self.device = device
        self.control = control
        self.job_log = job_log
        self.folder = Path(folder)
        self.prefix = job_prefix(record.team, record.id)
        self.checkpoints = CheckpointSync(store, self.prefix, self.folder / "work")
        self.artifact = self.folder / "artifact"
        self.clock = ProgressClock()
        self.timings: dict[str, float] = {}
        self.plans: StorePlans | None = None

    def _report(self, progress: Progress) -> None:
        self.control.publish_from_thread(progress)

    def run(self) -> dict[str, Any]:
        self._report(self.clock.stage("preparing"))
        inputs = self._timed("prepare", self._prepare)
        self.control.check()
        self._report(self.clock.start_layers(inputs.layers, inputs.restored))
        manifest = self._timed("compress", lambda: self._compress(inputs))
        self._report(self.clock.stage("evaluating"))
        evaluated, dense = self._timed("evaluate", lambda: self._evaluate(inputs))
        self.control.check()
        self._report(self.clock.stage("uploading"))
        files = self._timed("upload", lambda: upload_outputs(self.store, self.prefix, self.artifact,
                                                             self.record.request.outputs))
        self.timings["total_seconds"] = round(self.clock.elapsed(), 3)
        metrics = self._metrics(manifest, inputs.layers, evaluated, dense)
        finalise(self.store, self.prefix, manifest, files, metrics)
        self.checkpoints.drop_streams()
        log.info("published %d files under %s", len(files) + 2, self.prefix)
        return metrics

    def _timed(self, stage: str, work: Callable[[], T]) -> T:
        started = time.monotonic()
        result = work()
        self.timings[f"{stage}_seconds"] = round(time.monotonic() - started, 3)
        return result

    def _prepare(self) -> Inputs:
        """Resolve what the request names and restore the checkpoints an earlier attempt left."""
        request = self.record.request
        model = model_spec(request.model, request.revision, self.settings.models_dir)
        cache = Path(self.settings.work_dir) / "inputs"
        team = self.record.team
        calibration = local_dataset(self.store, request.calibration.dataset, cache, team)
        datasets = {name: local_dataset(self.store, name, cache, team) for name in request.evaluation.datasets}
        for task in request.evaluation.tasks:  # a worker without the task files fails before compressing
            task_file(task)
        options = compress_options(request, model, calibration, self.device)
        layers = load_config(resolve_model(model)).get_text_config().num_hidden_layers  # a multimodal config nests it
        restored = self.checkpoints.restore()
        if restored:
            log.info("resuming at layer %d of %d (%d layers from checkpoints)", restored, layers, restored)
        else:
            log.info("starting at layer 0 of %d (no checkpoints)", layers)
        return Inputs(model, options, datasets, layers, restored)

    def _compress(self, inputs: Inputs) -> dict[str, Any]:
        set_log_context(layer=inputs.restored + 1)  # 1-based, as the progress lines count layers
        client = connect_sync(self.settings)  # connects on first use: only a job that plans does
        try:
            self.plans = self._plan_store(inputs, client)
            manifest = compress(inputs.options, self.artifact, work_dir=self.checkpoints.folder, progress=False,
                                on_layer=self._layer_done, plan_store=self.plans)
        finally:
            client.close()
        set_log_context(layer=None)
        log.info("compressed %d layers (%d resumed from checkpoints)", inputs.layers, manifest["resumed_from_layer"])
        return manifest

    def _plan_store(self, inputs: Inputs, client: redis.Redis) -> StorePlans:
        """The team's shared layer plans (service/plans.py), described by this job's request."""
        request, planning = self.record.request, {"stage": False}

        def stage(name: str) -> None:
            planning["stage"] = True
            self._report(self.clock.stage(name))

        def ready() -> None:  # the layers' clock starts after the plan, or its first ETA counts the plan
            if planning["stage"]:
                self._report(self.clock.start_layers(inputs.layers, inputs.restored))

        about = {"model": request.model, "revision": request.revision, "method": request.method,
                 "ablate": list(request.ablate), "scope": request.scope, "dtype": request.dtype,
                 "calibration": request.calibration.model_dump(), "job_id": self.record.id}
        shared = SharedPlans(self.store, client, Keys(self.settings.key_prefix), self.record.team, about,
                             lease_seconds=self.settings.lease_seconds, holder=f"{self.lease.worker}/{self.record.id}",
                             check=self.control.check, report=stage)
        return StorePlans(shared, ready)

    def _evaluate(self, inputs: Inputs) -> tuple[dict, dict | None]:
        """Perplexity (and task accuracy) of the artifact, and of the dense model when the request asks."""
        evaluation = self.record.request.evaluation
        if not inputs.datasets and not evaluation.tasks:
            return {}, None
        settings = (evaluation.seq_len, evaluation.max_windows, self.device, self.control.check, evaluation.tasks,
                    evaluation.limit)
        results = evaluate(self.artifact, inputs.datasets, *settings)
        dense = evaluate(inputs.model, inputs.datasets, *settings) if evaluation.dense_reference else None
        return results, dense

    def _layer_done(self, result) -> None:
        log.info("layer %d of %d done in %.2f s", result.index + 1, result.total, result.seconds)
        record_layer(result.seconds)
        set_log_context(layer=result.index + 2 if result.index + 1 < result.total else None)
        self.checkpoints.push()
        self.job_log.upload()
        self._report(self.clock.layer_done(result.index + 1))

    def _metrics(self, manifest: dict, layers: int, evaluated: dict, dense: dict | None) -> dict[str, Any]:
        request = self.record.request
        evaluation = request.evaluation
        metrics = {
            "job_id": self.record.id,
            "model": request.model,
            "revision": request.revision,
            "method": request.method,
            "ratio": request.ratio,
            "ablate": list(request.ablate),
            "allocation": manifest["allocation"]["kind"],
            "scope": request.scope,
            "dtype": request.dtype,
            "eval": {"seq_len": evaluation.seq_len, "max_windows": evaluation.max_windows,
                     **({"tasks": evaluation.tasks, "limit": evaluation.limit} if evaluation.tasks else {})},
            "perplexity": evaluated.get("perplexity", {}),
            "storage": manifest["storage"],
            "bytes_written": manifest.get("bytes_written"),
            "layers": layers,
            "resumed_from_layer": manifest["resumed_from_layer"],
            "attempt": self.lease.attempt,
            "worker": self.lease.worker,
            "device": manifest["device"],
            "timings": self.timings,
        }
        if self.plans is not None and self.plans.keys:
            metrics["plan_key"] = self.plans.keys[-1]
        if "downstream" in evaluated:
            metrics["downstream"] = evaluated["downstream"]
        if dense is not None:
            metrics["dense_perplexity"] = dense["perplexity"]
            if "downstream" in dense:
                metrics["dense_downstream"] = dense["downstream"]
        return metrics

"""Progress of one attempt at a job: which layer, which stage, how long so far and how long to go."""

from __future__ import annotations

import time
from collections.abc import Callable

from service.schemas import Progress


class ProgressClock:
    """Turns "layer i of L finished" into a `Progress` with an estimate of the time left.

    The estimate is the mean time per layer computed in this attempt times the layers left; layers
    restored from checkpoints took no time here, so they do not count toward the mean.
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self.started = now()
        self.layers = 0
        self.layer = 0
        self._first_layer = 0
        self._compress_started: float | None = None

    def elapsed(self) -> float:
        return self._now() - self.started

    def stage(self, stage: str) -> Progress:
        """Progress at the start of a stage that is not counted in layers."""
        return Progress(layer=self.layer, layers=self.layers, stage=stage, elapsed_seconds=round(self.elapsed(), 3))

    def start_layers(self, layers: int, first: int) -> Progress:
        """Compression begins at layer `first` of `layers` (the ones before come from checkpoints)."""
        self.layers, self.layer, self._first_layer = layers, first, first
        self._compress_started = self._now()
        return self.stage("compressing")

    def layer_done(self, finished: int) -> Progress:
        """`finished` layers are done (counting the restored ones)."""
        self.layer = finished
        computed = finished - self._first_layer
        eta = None
        if computed > 0 and self._compress_started is not None:
            per_layer = (self._now() - self._compress_started) / computed
            eta = round(per_layer * max(0, self.layers - finished), 3)
        return Progress(
            layer=finished,
            layers=self.layers,
            stage="compressing",
            eta_seconds=eta,
            elapsed_seconds=round(self.elapsed(), 3),
        )

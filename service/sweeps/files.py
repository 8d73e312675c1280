"""Where a sweep's result tables and plots live in the object store, and how they are listed.

{team}/sweeps/{sweep_id}/results.{csv,md,json}, plot.{png,svg}   the latest finished run
{team}/sweeps/{sweep_id}/runs/{run_id}/...                       every finished run, kept

The top-level files are copies of the latest run's, so a bucket browser (or a script) finds the
current table without knowing run ids. Files are served only through the API, with the API key.
"""

from __future__ import annotations

import mimetypes
from collections.abc import Callable

from service.store import ObjectStore
from service.sweeps.schemas import SweepFile

RESULTS_CSV = "results.csv"
RESULTS_MD = "results.md"
RESULTS_JSON = "results.json"
PLOT_PNG = "plot.png"
PLOT_SVG = "plot.svg"
REPORT_FILES = (RESULTS_CSV, RESULTS_MD, RESULTS_JSON, PLOT_PNG, PLOT_SVG)

_MEDIA_TYPES = {".md": "text/markdown; charset=utf-8", ".csv": "text/csv; charset=utf-8"}


def sweep_prefix(team: str, sweep_id: str) -> str:
    return f"{team}/sweeps/{sweep_id}/"


def run_folder(run_id: str) -> str:
    """A run's folder, relative to its sweep's."""
    return f"runs/{run_id}/"


def media_type(name: str) -> str:
    suffix = name[name.rfind(".") :] if "." in name else ""
    return _MEDIA_TYPES.get(suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"


def list_files(store: ObjectStore, team: str, sweep_id: str, url_for: Callable[[str], str]) -> list[SweepFile]:
    """Every file of the sweep, with the API path that streams it."""
    prefix = sweep_prefix(team, sweep_id)
    return [
        SweepFile(
            name=info.key[len(prefix) :], size=info.size, modified=info.modified, url=url_for(info.key[len(prefix) :])
        )
        for info in store.list(prefix)
    ]

"""Reports of finished sweep runs: result tables, plots, and what changed since the previous run.

`rows` reads each job's metrics.json, `tables` writes CSV and Markdown, `plots` draws PNG and
SVG, `compare` diffs two runs, and `publish` puts it all in the store. Written by the scheduler
(`service.scheduler`) once every cell of a run has ended.
"""

from __future__ import annotations

from service.reports.publish import write_report

__all__ = ["write_report"]

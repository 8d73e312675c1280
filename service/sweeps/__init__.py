"""Sweep campaigns: models x keep ratios x methods (x ablations), run once or on a cron schedule.

`schemas` says what goes over the wire, `expand` turns one run into job sets, `store` keeps
campaigns and runs in Redis, `cron` computes slots and `status` derives where a run stands. The
scheduler (`service.scheduler`) fires slots and has the reports (`service.reports`) written.
"""

from __future__ import annotations

from service.sweeps.schemas import SweepRecord, SweepRequest
from service.sweeps.store import SweepCancelled, SweepStore

__all__ = ["SweepCancelled", "SweepRecord", "SweepRequest", "SweepStore"]

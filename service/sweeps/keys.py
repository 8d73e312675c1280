"""The Redis keys of sweeps and of the scheduler, under the same prefix as the job keys.

Layout under a prefix (default `ftc`):

    {p}:sweep:{id}                   hash    the campaign: request, schedule, cancellation
    {p}:sweep:{id}:runs              list    its run ids, oldest first
    {p}:sweep:{id}:run:{run}         hash    one run: trigger, slot, planned cells, jobs:{set} ids, report
    {p}:sweep:{id}:slot:{epoch}      string  the run a cron slot fired (SET NX: a slot fires once)
    {p}:team:{team}:sweeps           zset    every sweep id of a team (score 0; ids sort by time)
    {p}:team:{team}:sweeps:live      set     the team's live sweeps: scheduled, or with a run open (quota)
    {p}:sweeps:scheduled             zset    scheduled sweep ids, scored by their next slot
    {p}:sweeps:open                  set     "{sweep}/{run}" of runs still being expanded or reported
    {p}:scheduler:lock               string  the active scheduler's token (expires unless renewed)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SweepKeys:
    prefix: str = "ftc"

    def sweep(self, sweep_id: str) -> str:
        return f"{self.prefix}:sweep:{sweep_id}"

    def runs(self, sweep_id: str) -> str:
        return f"{self.prefix}:sweep:{sweep_id}:runs"

    def run(self, sweep_id: str, run_id: str) -> str:
        return f"{self.prefix}:sweep:{sweep_id}:run:{run_id}"

    def slot(self, sweep_id: str, slot: float) -> str:
        return f"{self.prefix}:sweep:{sweep_id}:slot:{int(slot)}"

    def team_sweeps(self, team: str) -> str:
        return f"{self.prefix}:team:{team}:sweeps"

    def live_sweeps(self, team: str) -> str:
        return f"{self.prefix}:team:{team}:sweeps:live"

    def scheduled(self) -> str:
        return f"{self.prefix}:sweeps:scheduled"

    def open_runs(self) -> str:
        return f"{self.prefix}:sweeps:open"

    def scheduler_lock(self) -> str:
        return f"{self.prefix}:scheduler:lock"

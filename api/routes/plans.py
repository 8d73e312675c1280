"""The team's shared layer plans (allocation 'sensitivity', service/plans.py): list and delete.

A plan is measured by the first job that needs it and read by every later one of the team; deleting
one makes the next such job measure it again (after a library change to how plans are measured, say).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, status

from api.deps import Store, Team
from api.errors import documented
from service.plans import PLAN_KEY_PATTERN, PlanInfo, PlanList, delete_plan, list_plans

router = APIRouter(prefix="/v1/plans", tags=["plans"], responses=documented(401, 503))

PlanKey = Annotated[str, Path(pattern=PLAN_KEY_PATTERN, description="A plan's key, as GET /v1/plans lists it.")]


@router.get("", response_model=PlanList)
async def get_plans(team: Team, store: Store) -> PlanList:
    """The team's plans, newest first: what each was measured for (model, method, scope), when, by
    which job, and its size."""
    return PlanList(plans=await asyncio.to_thread(list_plans, store, team))


@router.delete("/{key}", response_model=PlanInfo, responses=documented(404))
async def remove_plan(key: PlanKey, team: Team, store: Store) -> PlanInfo:
    """Delete a plan (the answer is what it was); the next job that needs it measures it again."""
    deleted = await asyncio.to_thread(delete_plan, store, team, key)
    if deleted is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"plan {key} not found")
    return deleted

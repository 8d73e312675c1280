"""Request dependencies: the caller's team (from the bearer key) and the service objects.

Every dependency is `async def`: FastAPI runs plain `def` ones in a thread pool, a costly hop on
each request of the submission hot path.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.gate import unauthorized_detail
from service.auth import ApiKeys
from service.jobs import JobStore
from service.runtime import Services
from service.settings import Settings
from service.store import ObjectStore

_bearer = HTTPBearer(auto_error=False, description="An API key from FTC_API_KEYS; it selects the team.")


async def get_services(request: Request) -> Services:
    return request.app.state.services


async def current_team(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """The team of the presented key; 401 for a missing or unknown key.

    `api.gate.RequestGate` has already refused such requests under /v1 before their body was read;
    this is the check that stays with the route (and documents the scheme in OpenAPI).
    """
    api_keys: ApiKeys = request.app.state.api_keys
    token = credentials.credentials if credentials else None
    team = api_keys.team_for(token) if token else None
    if team is None:
        detail = unauthorized_detail(api_keys, token) or "unknown API key"
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"})
    return team


# Each reads app.state directly rather than through get_services: one dependency fewer to solve on
# every request of the submission hot path.
async def get_jobs(request: Request) -> JobStore:
    return request.app.state.services.jobs


async def get_store(request: Request) -> ObjectStore:
    return request.app.state.services.store


async def get_settings(request: Request) -> Settings:
    return request.app.state.services.settings


Team = Annotated[str, Depends(current_team)]
Jobs = Annotated[JobStore, Depends(get_jobs)]
Store = Annotated[ObjectStore, Depends(get_store)]
AppSettings = Annotated[Settings, Depends(get_settings)]
ServicesDep = Annotated[Services, Depends(get_services)]

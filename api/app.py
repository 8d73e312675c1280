"""The FastAPI application: routes, auth, errors and the lifetime of the service clients.

`create_app()` is the entry point (`uvicorn --factory api.app:create_app`). It imports nothing of
the compression library beyond `ftc.options`, so the API starts without torch or ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from api.docs import add_offline_docs
from api.errors import UnexpectedErrors, add_error_handlers
from api.gate import RequestGate
from api.metrics import RequestTimer
from api.routes import artifacts, dashboard, events, health, jobs, plans, sweeps, uploads
from api.sse import EventHub, StreamSlots
from service.auth import ApiKeys
from service.queue import run_janitor
from service.redis_client import REDIS_DOWN_ERRORS
from service.runtime import Services
from service.settings import Settings
from service.store import store_for
from service.teams import policies_for

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; fails at once on unusable settings (no API keys, a key listed for two teams,
    a bad store URL)."""
    settings = settings or Settings()
    api_keys = ApiKeys.parse(settings.api_keys)
    policies_for(settings).check_known(api_keys.teams)
    store = store_for(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.open(settings, store)
        app.state.services = services
        hub = app.state.event_hub = EventHub(services.redis, services.jobs, settings)
        hub.start()
        slots = app.state.stream_slots = StreamSlots(services.redis, services.jobs.keys)
        slots.start()
        try:
            await services.queue.ensure_group()
        except REDIS_DOWN_ERRORS as error:  # start anyway: /readyz says 503 until Redis is back
            log.warning("Redis unreachable at startup (%s); serving 503 until it is back", error)
        stop = asyncio.Event()
        janitor = None
        if settings.janitor_interval_seconds > 0:
            janitor = asyncio.create_task(run_janitor(services.queue, settings.janitor_interval_seconds, stop))
        try:
            yield
        finally:
            stop.set()
            if janitor is not None:
                await janitor
            await hub.close()
            await slots.close()
            await services.close()

    app = FastAPI(
        title="ftc-compress job service",
        version="1",
        description="Submit attention-compression jobs, follow their progress, fetch their artifacts.",
        lifespan=lifespan,
        docs_url=None,  # served by add_offline_docs, without a CDN
        redoc_url=None,
    )
    app.state.api_keys = api_keys
    # The last added runs first: time everything, answer any 500 without dropping the connection,
    # and check the key and the body size before a route reads the body.
    app.add_middleware(
        RequestGate,
        api_keys=api_keys,
        max_body_bytes=settings.max_body_bytes,
        max_upload_bytes=settings.max_upload_bytes,
    )
    app.add_middleware(UnexpectedErrors)
    app.add_middleware(RequestTimer)
    add_error_handlers(app)
    for module in (jobs, events, artifacts, uploads, sweeps, plans, health, dashboard):
        app.include_router(module.router)
    add_offline_docs(app)
    return app

"""The FastAPI application: routes, the front door (keys, browsers, body size), JSON
errors, engine lifecycle."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kiln.args import ServerArgs
from kiln.runtime.engine import Engine
from kiln.runtime.model_runner import freeze_startup_heap
from kiln.serve import native_api, openai_api, responses_api
from kiln.serve.context import ServingContext, Templates
from kiln.serve.metrics import CustomLabels
from kiln.serve.middleware import FrontDoor, error_body
from kiln.serve.streams import ApiError

log = logging.getLogger("kiln.serve")


def create_app(
    engine: Engine, args: ServerArgs, clean_start: bool = False, templates: Templates | None = None
) -> FastAPI:
    """`clean_start`: this process only imported kiln and opened the artefact (`kiln
    serve`), so its startup heap is frozen without a full collection first
    (model_runner.freeze_startup_heap). `templates`: the template flags' values, already
    read (else read here)."""
    ctx = ServingContext(engine, args, templates)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ctx.async_engine.start()
        if not args.skip_server_warmup:
            await _warmup(ctx)
        frozen = freeze_startup_heap(collect=not clean_start)
        log.debug("%d objects at startup, exempt from garbage collection", frozen)
        log.info("kiln serving %s on http://%s:%s", ctx.model_name, args.host, args.port)
        yield
        ctx.async_engine.stop()
        ctx.close()

    app = FastAPI(title="kiln", lifespan=lifespan)
    app.state.kiln = ctx
    app.include_router(openai_api.router)
    app.include_router(native_api.router)
    app.include_router(responses_api.router)
    if (args.enable_metrics or args.export_metrics_to_file) and ctx.metrics.custom:
        # inside the front door: a refused request's header is never read (the labels go
        # to /metrics and to --export-metrics-to-file's records)
        app.add_middleware(
            CustomLabels,
            header=args.tokenizer_metrics_custom_labels_header,
            allowed=ctx.metrics.custom,
        )
    app.add_middleware(
        FrontDoor,
        api_key=args.api_key,
        admin_key=args.admin_api_key,
        max_body=args.max_request_body_bytes,
        host=args.host,
        allowed_hosts=args.allowed_hosts or (),
    )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.kind), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        message = "; ".join(_problem(err) for err in e.errors()[:5])
        return JSONResponse(error_body(400, message, "BadRequestError"), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "NotFoundError" if e.status_code == 404 else "HTTPError"
        return JSONResponse(
            error_body(e.status_code, str(e.detail), kind), status_code=e.status_code
        )

    return app


def _problem(err: dict[str, Any]) -> str:
    """One validation error as `field.path: what is wrong`."""
    where = ".".join(str(x) for x in err["loc"] if x != "body") or "body"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown field (kiln refuses fields it does not know, not ignores them)"
    if err["type"] == "value_error":
        return f"{where}: {err['ctx']['error']}" if where != "body" else str(err["ctx"]["error"])
    return f"{where}: {err['msg']}"


async def _warmup(ctx: ServingContext) -> None:
    """One short generation before accepting traffic: first-call costs are paid here."""
    await ctx.probe(max_new_tokens=2)

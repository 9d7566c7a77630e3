"""The FastAPI application: routes, API-key checks, JSON errors, engine lifecycle."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kiln.args import ServerArgs
from kiln.runtime.engine import Engine
from kiln.serve import native_api, openai_api
from kiln.serve.context import ApiError, ServingContext

log = logging.getLogger("kiln.serve")

# Paths a load balancer or Prometheus reaches without a key.
PUBLIC_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
ADMIN_PATHS = frozenset({"/flush_cache"})


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """SGLang's error object, with OpenAI's `error` envelope so either client reads it."""
    err = {"message": message, "type": kind, "param": None, "code": status}
    return {"object": "error", **err, "error": err}


def create_app(engine: Engine, args: ServerArgs) -> FastAPI:
    ctx = ServingContext(engine, args)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ctx.async_engine.start()
        if not args.skip_server_warmup:
            await _warmup(ctx)
        log.info("kiln serving %s on http://%s:%s", ctx.model_name, args.host, args.port)
        yield
        ctx.async_engine.stop()

    app = FastAPI(title="kiln", lifespan=lifespan)
    app.state.kiln = ctx
    app.include_router(openai_api.router)
    app.include_router(native_api.router)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.kind), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'] if x != 'body') or 'body'}: {err['msg']}"
            for err in e.errors()
        )
        return JSONResponse(error_body(400, problems, "BadRequestError"), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "NotFoundError" if e.status_code == 404 else "HTTPError"
        return JSONResponse(
            error_body(e.status_code, str(e.detail), kind), status_code=e.status_code
        )

    @app.middleware("http")
    async def check_key(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        required = _required_key(request.url.path, args)
        if required is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {required}".encode()):
                return JSONResponse(
                    error_body(401, "invalid or missing API key", "AuthenticationError"),
                    status_code=401,
                )
        return await call_next(request)

    return app


def _required_key(path: str, args: ServerArgs) -> str | None:
    if path in PUBLIC_PATHS:
        return None
    if path in ADMIN_PATHS and args.admin_api_key:
        return str(args.admin_api_key)
    return str(args.api_key) if args.api_key else None


async def _warmup(ctx: ServingContext) -> None:
    """One short generation before accepting traffic: first-call costs are paid here."""
    await ctx.probe(max_new_tokens=2)

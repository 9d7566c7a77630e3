"""SGLang's native endpoints: /generate, health, model and server info, load, aborting,
the tool-call and reasoning parsers on their own, cache, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kiln.args import SECRET_ARGS
from kiln.runtime.engine import RequestError
from kiln.runtime.gc_watch import freeze
from kiln.runtime.request import Request as EngineRequest
from kiln.runtime.request import hidden_meta, logprob_meta
from kiln.serve.context import NATIVE_DEFAULTS, ServingContext
from kiln.serve.protocol import (
    AbortRequest,
    CloseSession,
    ConfigureLogging,
    EncodeRequest,
    GenerateRequest,
    LoadLoraAdapter,
    OpenSession,
    ParseFunctionCallRequest,
    PauseGeneration,
    ProfileRequest,
    SeparateReasoningRequest,
    UnloadLoraAdapter,
    UpdateWeightsFromDisk,
    UpdateWeightVersion,
)
from kiln.serve.reasoning import CONTENT, PARSERS, REASONING, splitter
from kiln.serve.sessions import SessionStore
from kiln.serve.streams import Accumulated, ApiError, events, merged, sse
from kiln.serve.tool_calls import FORMATS, ToolStream
from kiln.version import __version__

log = logging.getLogger("kiln.serve")

router = APIRouter()
ABORTED = {"type": "abort", "message": "aborted by /abort_request"}
PAUSED = {"type": "abort", "message": "aborted by /pause_generation"}
RELABELLED = {"type": "abort", "message": "aborted by /update_weight_version"}
REPLACED = {"type": "abort", "message": "aborted by a session request that replaced it"}


def _ctx(request: Request) -> ServingContext:
    return request.app.state.kiln


def _meta(
    req: EngineRequest,
    acc: Accumulated,
    body: GenerateRequest,
    text: Callable[[int], str | None] | None,
    weight_version: str,
) -> dict[str, Any]:
    """SGLang's meta_info so far; with return_logprob its logprob fields (runtime/request.py
    logprob_meta), the prompt's from logprob_start_len when that is 0 or more."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "weight_version": weight_version,
        "prompt_tokens": acc.prompt_tokens,
        "completion_tokens": acc.completion_tokens,
        "cached_tokens": acc.cached_tokens,
        "finish_reason": acc.finish_reason,
    }
    if acc.spec is not None:
        meta.update(acc.spec)
    if body.return_hidden_states and acc.hidden_states is not None:  # in the last output
        meta["hidden_states"] = hidden_meta(len(req.prompt_ids), acc.hidden_states)
    if body.return_logprob:
        meta |= logprob_meta(
            acc.logprobs,
            bool(req.logprob_ids),
            text,
            req.prompt_ids,
            acc.prompt_logprobs or [],
            body.logprob_start_len,
        )
    return meta


def _one_prompt(text: Any, input_ids: Any) -> bool:
    """A body's text or input_ids is one prompt, not a batch (answered as one item)."""
    return isinstance(text, str) or (input_ids is not None and isinstance(input_ids[0], int))


@router.post("/generate", response_model=None)
async def generate(body: GenerateRequest, request: Request) -> Any:
    ctx = _ctx(request)
    ctx.refuse_unsupported(body.unsupported())
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids")
    single = _one_prompt(body.text, body.input_ids)
    sp = body.sampling_params
    top = body.top_logprobs_num if body.return_logprob else None
    start = body.logprob_start_len if body.return_logprob else -1

    session = body.session_params if body.session_params and body.session_params.id else None
    given: list[list[int]] | None = None  # a session request's prompt, built from the session
    if session is not None:
        given, rid = await _session_prompt(ctx, body, single)
        turn = (str(session.id), rid)

    def build() -> list[Any]:
        if given is not None:
            prompts = given
        elif body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else body.text
            prompts = [ctx.prompt_ids(t)[0] for t in texts]
        else:
            ids: Any = body.input_ids
            prompts = [ids] if single else list(ids)
        if not prompts:
            raise ApiError(400, "the prompt is empty")
        short = min(len(p) for p in prompts)
        if start >= short:
            raise ApiError(
                400, f"logprob_start_len {start} must be below the prompt's length ({short})"
            )
        params = sp if isinstance(sp, list) else [sp or {}] * len(prompts)
        return ctx.make_requests(
            prompts,
            params,
            defaults="native",
            top_logprobs=top,
            priority=ctx.priority(body),
            rid=rid if session is not None else body.rid,
            prompt_top_logprobs=top if start >= 0 else None,
            logprob_ids=body.token_ids_logprob if body.return_logprob else None,
            cache_key=body.extra_key,
            lora=body.lora_path,
            hidden_states=body.return_hidden_states,
        )

    if session is None:
        reqs = await ctx.build(build)
    else:
        reqs = await _session_build(ctx, build, *turn)
    text = ctx.token_text if body.return_text_in_logprobs else None

    if body.stream:
        disjoint = ctx.args.stream_output

        async def chunks() -> AsyncIterator[str]:
            accs = [Accumulated() for _ in reqs]
            async for i, out in merged(ctx, reqs):
                accs[i].add(out)
                acc = accs[i]
                if disjoint:  # --stream-output: each chunk only what is new
                    acc = Accumulated()
                    acc.add(out)
                item: dict[str, Any] = {
                    "text": acc.text,
                    "output_ids": acc.token_ids,
                    "meta_info": _meta(reqs[i], acc, body, text, ctx.weight_version),
                }
                if len(reqs) > 1:
                    item["index"] = i
                yield sse(item)

        return StreamingResponse(events(chunks), media_type="text/event-stream")

    results = await ctx.collect(request, reqs)
    items = [
        {
            "text": acc.text,
            "output_ids": acc.token_ids,
            "meta_info": _meta(r, acc, body, text, ctx.weight_version),
        }
        for r, acc in zip(reqs, results, strict=True)
    ]
    return items[0] if single and len(items) == 1 else items


@router.post("/encode")
@router.post("/classify")
async def encode(body: EncodeRequest, request: Request) -> Any:
    """SGLang's native embedding route (a model compiled with --is-embedding): for one
    prompt {"embedding", "meta_info"}, for a batch a list of them. /classify, SGLang's
    reward-model route, is the same: a classifier's "embedding" is its labels' logits."""
    ctx = _ctx(request)
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids")
    single = _one_prompt(body.text, body.input_ids)

    given: Any = body.text if body.text is not None else body.input_ids
    reqs, results = await ctx.pooled(
        request,
        lambda: ctx.prompt_ids([given] if single else given),
        rid=body.rid,
        dimensions=body.dimensions,
    )
    items = [
        {
            "embedding": acc.embedding,
            "meta_info": {
                "id": r.rid,
                "prompt_tokens": acc.prompt_tokens,
                "cached_tokens": acc.cached_tokens,
            },
        }
        for r, acc in zip(reqs, results, strict=True)
    ]
    return items[0] if single else items


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine runs and the server takes requests; 503 while it shuts down,
    so a load balancer stops sending it work."""
    engine = _ctx(request).async_engine
    return Response(status_code=200 if engine.thread.alive and not engine.draining else 503)


@router.get("/ping")
async def ping(request: Request) -> Response:
    """SageMaker's health check, as SGLang answers it: /health's answer (public)."""
    return await health(request)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy only if the engine generates a token end to end. Public (as in SGLang), so
    its callers share one probe: see `ServingContext.health_probe`."""
    ok = await _ctx(request).health_probe()
    return Response(status_code=200 if ok else 503)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    compile_args = ctx.engine.art.manifest["compile_args"]
    return {
        "model_path": compile_args.get("model_path"),
        "tokenizer_path": compile_args.get("tokenizer_path") or compile_args.get("model_path"),
        "served_model_name": ctx.model_name,
        "is_generation": not ctx.engine.art.spec.is_embedding,
        "max_model_len": ctx.context_length,
        "weight_version": ctx.weight_version,
        "preferred_sampling_params": ctx.preferred,
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    args = {k: list(v) if isinstance(v, tuple) else v for k, v in ctx.args.to_dict().items()}
    for secret in SECRET_ARGS:
        if args.get(secret):
            args[secret] = "***"
    manifest = ctx.engine.art.manifest
    pool = ctx.engine.runner.pool
    return {
        **args,
        "version": __version__,
        "artefact": {"cache_key": manifest["cache_key"], "target": manifest["target"]},
        "max_total_tokens": pool.num_pages * pool.page_size,
        "threads": ctx.engine.threads,
        "kv_pages_total": pool.num_pages,
        "kv_pages_free": pool.free_pages,
        "kv_pages_cached": await ctx.async_engine.run(lambda e: e.scheduler.cached_pages),
        "num_running_reqs": ctx.async_engine.num_running,
        "num_queue_reqs": ctx.async_engine.num_waiting,
        # the prefix cache's disk tier (--hicache-storage-backend file), or None
        "hicache_storage": ctx.engine.kv_store.stats() if ctx.engine.kv_store else None,
    }


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, Any]]:
    """SGLang's load report (what its router's load-aware policies poll), one entry: the
    scheduler's requests, running and waiting, and their tokens, as the engine thread sees
    them between two steps (requests still on their way to it are not counted, as in
    SGLang)."""

    def load(engine: Any) -> dict[str, Any]:
        running, waiting = engine.scheduler.running, engine.scheduler.waiting
        return {
            "dp_rank": 0,
            "num_reqs": len(running) + len(waiting),
            "num_waiting_reqs": len(waiting),
            "num_tokens": sum(r.num_tokens for r in running) + sum(r.num_tokens for r in waiting),
        }

    return [await _ctx(request).async_engine.run(load)]


def _admin_only(ctx: ServingContext, route: str, why: str = "stops") -> None:
    """Refuse a route that stops (or logs, or changes) other clients' requests on a server
    without --admin-api-key: with the shared API key alone, one client could stop
    another's."""
    if not ctx.args.admin_api_key:
        raise ApiError(
            403,
            f"{route} needs --admin-api-key (it {why} other clients' requests)",
            "PermissionDeniedError",
        )


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapter, request: Request) -> dict[str, Any]:
    """SGLang's: serve one more LoRA adapter, read from a folder on the server (its files
    parsed as JSON and safetensors, checked as at start: runtime/lora.py). Only on a
    server with --admin-api-key, whose key it takes: it reads a path a request names."""
    ctx = _ctx(request)
    _admin_only(ctx, "/load_lora_adapter", "reads a server folder and changes")
    if not ctx.args.enable_lora:
        raise ApiError(400, "/load_lora_adapter: this server runs without --enable-lora")
    from kiln.runtime.lora import AdapterSource, LoraError, check_name, read_adapter

    try:
        check_name(body.lora_name, "lora_name: ")
        source = AdapterSource(body.lora_name, body.lora_path, body.pinned)
        adapter = await ctx.off_loop(lambda: read_adapter(source, ctx.args.max_lora_rank))
        await ctx.async_engine.run(lambda engine: engine.load_adapter(adapter))
    except (LoraError, RequestError) as e:
        raise ApiError(400, str(e)) from None
    return _adapters(ctx)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> dict[str, Any]:
    """SGLang's: stop serving an adapter; requests already running with it finish with it,
    new ones naming it get a 400. The admin key only, as /load_lora_adapter."""
    ctx = _ctx(request)
    _admin_only(ctx, "/unload_lora_adapter", "changes")
    try:
        await ctx.async_engine.run(lambda engine: engine.unload_adapter(body.lora_name))
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    return _adapters(ctx)


def _sessions(ctx: ServingContext) -> SessionStore:
    if ctx.sessions is None:
        raise ApiError(400, "sessions are off on this server (--max-session-tokens 0)")
    return ctx.sessions


async def _session_prompt(
    ctx: ServingContext, body: GenerateRequest, single: bool
) -> tuple[list[list[int]], str]:
    """A session request's prompt (serve/sessions.py), recorded in its session under its
    rid (the client's, else a new one); the requests a `replace` forgot are stopped."""
    store = _sessions(ctx)
    params = body.session_params
    assert params is not None and params.id is not None
    sp = body.sampling_params
    if not single or isinstance(sp, list) or isinstance(body.rid, list):
        raise ApiError(400, "session_params: one prompt (text or input_ids), not a batch")
    if sp is not None and sp.get("n", 1) != 1:
        raise ApiError(400, "session_params: n must be 1 (a session continues one request)")
    rid = body.rid if isinstance(body.rid, str) else uuid.uuid4().hex
    if body.text is not None:
        new_ids = (await ctx.off_loop(lambda: ctx.prompt_ids(str(body.text))))[0]
    else:
        new_ids = list(body.input_ids or [])
    # what the turn is charged until its request says (make_requests' defaults)
    max_new = {**NATIVE_DEFAULTS, **(ctx.preferred or {}), **(sp or {})}["max_new_tokens"]
    bound = max_new if isinstance(max_new, int) and max_new >= 0 else ctx.context_length
    prompt, stop = store.begin(
        params.id,
        params.model_dump(exclude={"id"}),
        rid,
        new_ids,
        bound,
        ctx.engine.art.spec.bos_token_id,
    )
    for req in stop:
        if not req.finished:
            ctx.async_engine.abort(req.rid, REPLACED)
    return [prompt], rid


async def _session_build(
    ctx: ServingContext, build: Callable[[], list[Any]], session_id: str, rid: str
) -> list[Any]:
    """build() for a session request: its turn forgotten if the request cannot be made,
    the request stopped if the turn was forgotten (replaced, closed) meanwhile."""
    store = _sessions(ctx)
    try:
        reqs = await ctx.build(build)
    except BaseException:
        store.discard(session_id, rid)
        raise
    if not store.attach(session_id, rid, reqs[0]):
        ctx.async_engine.abort(reqs[0].rid, REPLACED)
    return reqs


@router.api_route("/open_session", methods=["GET", "POST"])
async def open_session(body: OpenSession, request: Request) -> str:
    """SGLang's: open a session and answer its id (a JSON string): the one given, or a new
    random one."""
    return _sessions(_ctx(request)).open(body.session_id, body.capacity_of_str_len)


@router.api_route("/close_session", methods=["GET", "POST"])
async def close_session(body: CloseSession, request: Request) -> Response:
    """SGLang's: forget a session (its requests still running go on to their end). An
    unknown id is a 404 (SGLang answers 200 and logs a warning)."""
    store = _sessions(_ctx(request))
    store.get(body.session_id)  # a 404 naming it when it is not open
    store.close(body.session_id)
    return Response(status_code=200)


def _adapters(ctx: ServingContext) -> dict[str, Any]:
    return {"success": True, "error_message": "", "loaded_adapters": dict(ctx.engine.adapter_paths)}


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
    """SGLang's: stop the request with id `rid` (the id its client gave, or the server's
    `id`), or every request with abort_all; each ends with finish reason abort. Only on a
    server with --admin-api-key, whose key it takes."""
    ctx = _ctx(request)
    _admin_only(ctx, "/abort_request")
    if not body.abort_all and not body.rid:
        raise ApiError(400, "give the rid of the request to abort, or abort_all: true")
    aborted = ctx.async_engine.abort(None if body.abort_all else body.rid, ABORTED)
    return {"aborted": aborted}


@router.post("/pause_generation")
async def pause_generation(body: PauseGeneration, request: Request) -> dict[str, Any]:
    """SGLang's (for updating weights between rounds of reinforcement learning): no
    decode or prefill runs until /continue_generation; new requests wait. `mode`: abort
    (the default: every request in flight ends with finish reason abort), retract (running
    requests free their KV cache and are prefilled again after) or in_place (they keep
    it). Only on a server with --admin-api-key, whose key it takes."""
    ctx = _ctx(request)
    _admin_only(ctx, "/pause_generation")
    await ctx.async_engine.pause(body.mode, PAUSED)
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict[str, Any]:
    """SGLang's: undo /pause_generation; what waited runs."""
    ctx = _ctx(request)
    _admin_only(ctx, "/continue_generation")
    await ctx.async_engine.resume()
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.api_route("/configure_logging", methods=["GET", "POST"])
async def configure_logging(body: ConfigureLogging, request: Request) -> dict[str, Any]:
    """SGLang's: turn --log-requests on or off and set its level while serving; answers
    what is now set. Only on a server with --admin-api-key, whose key it takes: the log
    holds every client's texts."""
    ctx = _ctx(request)
    _admin_only(ctx, "/configure_logging", "logs")
    ctx.refuse_unsupported(body.unsupported())
    now = ctx.async_engine.request_log
    on = body.log_requests if body.log_requests is not None else now is not None
    level: int = ctx.args.log_requests_level if now is None else now.level
    if body.log_requests_level is not None:
        level = body.log_requests_level
    ctx.configure_logging(on, level)
    return {"log_requests": on, "log_requests_level": level}


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request, body: ProfileRequest | None = None) -> Response:
    """SGLang's: record the engine's next steps (each native call inside them too) into a
    Chrome trace, `{output_dir}/{profile_id}-TP-0.trace.json.gz` (runtime/profiler.py),
    written after `num_steps` steps or at /stop_profile. output_dir: an existing folder
    (default $SGLANG_TORCH_PROFILER_DIR, else /tmp); the file is a new one, never one
    that exists. Only on a server with --admin-api-key, whose key it takes."""
    ctx = _ctx(request)
    _admin_only(ctx, "/start_profile", "writes files of")
    body = body or ProfileRequest()
    ctx.refuse_unsupported(body.unsupported())
    folder = Path(body.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp")
    if not folder.is_dir():
        raise ApiError(400, f"output_dir: {folder} is not a folder on the server")
    name = f"{body.profile_prefix + '-' if body.profile_prefix else ''}{time.time()}-TP-0"
    path = folder / f"{name}.trace.json.gz"
    try:
        await ctx.async_engine.run(
            lambda e: e.start_profile(path, body.num_steps, body.start_step or 0)
        )
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    log.warning("profiling the next %s steps into %s", body.num_steps or "", path)
    return Response("Start profiling.\n")


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request) -> Response:
    """SGLang's: end the profile /start_profile began and write its trace."""
    ctx = _ctx(request)
    _admin_only(ctx, "/stop_profile", "writes files of")
    path = await ctx.async_engine.run(lambda e: e.stop_profile())
    if path is None:
        raise ApiError(400, "no profile is being recorded (/start_profile begins one)")
    log.warning("profile written to %s", path)
    return Response("Stop profiling. This will take some time.\n")


UPDATED = {"type": "abort", "message": "aborted by /update_weights_from_disk"}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDisk, request: Request) -> Any:
    """SGLang's: serve the weights of the checkpoint at `model_path` (on the server),
    compiled as the served artefact was (serve/weight_update.py). Requests in flight finish
    on the old weights first (or end now: `abort_all_requests`; or, while generation is
    paused, are computed again with the new ones: num_paused_requests); new ones wait for
    the new. Only on a server with --admin-api-key, whose key it takes. One update at a
    time."""
    from kiln.runtime.weight_update import WeightUpdateError
    from kiln.serve.weight_update import compile_update

    ctx = _ctx(request)
    _admin_only(ctx, "/update_weights_from_disk", "changes the weights of")
    ctx.refuse_unsupported(body.unsupported())
    engine = ctx.async_engine
    async with ctx.weight_lock:
        art = await compile_update(ctx.engine.art.manifest, body.model_path, body.load_format)
        try:
            await engine.run(lambda e: setattr(e.scheduler, "holding", True))
            if body.abort_all_requests:
                engine.abort_all(UPDATED)
            # Those in flight finish on the old weights; but under /pause_generation (a
            # trainer's round) they are not stepped: update_weights retracts them.
            while not engine.paused and await engine.run(lambda e: len(e.scheduler.running)):
                await asyncio.sleep(0.01)
            held = await engine.run(lambda e: len(e.scheduler.running))
            await engine.run(lambda e: e.update_weights(art))
        except WeightUpdateError as e:
            raise ApiError(400, f"model_path: {e}") from None
        finally:
            await engine.run(lambda e: setattr(e.scheduler, "holding", False))
            shutil.rmtree(art.parent, ignore_errors=True)
    if body.weight_version is not None:
        ctx.weight_version = body.weight_version
    return {"success": True, "message": "Succeeded to update model weights.",
            "num_paused_requests": held}  # fmt: skip


@router.get("/weight_version")
@router.get("/get_weight_version")
async def weight_version(request: Request) -> dict[str, Any]:
    """SGLang's: the label of the weights served (--weight-version, or the last
    /update_weight_version)."""
    return {"weight_version": _ctx(request).weight_version}


@router.post("/update_weight_version")
async def update_weight_version(body: UpdateWeightVersion, request: Request) -> dict[str, Any]:
    """SGLang's: relabel the weights served (after a trainer synced them), ending every
    request in flight first unless abort_all_requests is false, so that no answer carries
    the new label from the old weights. The admin key only, as /abort_request."""
    ctx = _ctx(request)
    if body.abort_all_requests:
        _admin_only(ctx, "/update_weight_version with abort_all_requests")
        ctx.async_engine.abort_all(RELABELLED)
    ctx.weight_version = body.new_version
    return {
        "success": True,
        "message": f"Weight version updated to {body.new_version}",
        "new_version": body.new_version,
    }


@router.post("/parse_function_call")
async def parse_function_call(body: ParseFunctionCallRequest, request: Request) -> dict[str, Any]:
    """SGLang's: the calls of `tools` in a model's text, as the chat route would read them
    (serve/tool_calls.py), and the text that is not calls. Text that does not parse as
    calls of these tools stays text."""
    name = _parser(body.tool_call_parser, _ctx(request).args.tool_call_parser, FORMATS, "tool")
    names = [t.function.name for t in body.tools]
    schemas = {t.function.name: t.function.parameters or {} for t in body.tools}
    reader = ToolStream(FORMATS[name], schemas, first_only=False)
    text = reader.feed(body.text)
    rest, calls = reader.finish()
    return {
        "normal_text": text + rest,
        "calls": [
            {
                "tool_index": names.index(f),
                "name": f,
                "parameters": json.dumps(args, ensure_ascii=False),
            }
            for f, args in calls
        ],
    }


@router.post("/separate_reasoning")
async def separate_reasoning(body: SeparateReasoningRequest, request: Request) -> dict[str, Any]:
    """SGLang's: a thinking model's text split into its reasoning and its answer, as the
    chat route splits it (serve/reasoning.py)."""
    name = _parser(body.reasoning_parser, _ctx(request).args.reasoning_parser, PARSERS, "reasoning")
    split = splitter(PARSERS[name], "")
    parts = split.feed(body.text) + split.finish()
    return {
        "reasoning_text": "".join(t for kind, t in parts if kind == REASONING),
        "text": "".join(t for kind, t in parts if kind == CONTENT),
    }


def _parser(given: str | None, server: str | None, known: Mapping[str, Any], kind: str) -> str:
    name = given or server
    if name is None:
        raise ApiError(400, f"{kind}_parser: name one ({', '.join(known)}); the server has none")
    if name not in known:
        raise ApiError(400, f"{kind}_parser: {name!r} is not one of {', '.join(known)}")
    return name


@router.post("/flush_cache")
async def flush_cache(request: Request) -> dict[str, Any]:
    """Drop every prefix-cache entry that no running request uses."""
    freed = await _ctx(request).async_engine.run(lambda e: e.flush_cache())
    return {"message": "cache flushed", "freed_tokens": freed}


@router.post("/clear_hicache_storage_backend")
async def clear_hicache_storage_backend(request: Request) -> dict[str, Any]:
    """SGLang's: remove every KV block the prefix cache's disk tier keeps for this model
    (--hicache-storage-backend file); the pool's own prefix cache stays. POST only, as
    /flush_cache: SGLang takes a GET too, which any web page can make a browser send."""

    def clear(engine: Any) -> int:
        if engine.kv_store is None:
            raise ApiError(
                400,
                "no storage tier to clear; start the server with --enable-hierarchical-cache "
                "--hicache-storage-backend file",
            )
        return int(engine.kv_store.clear())

    removed = await _ctx(request).async_engine.run(clear)
    return {"message": "hicache storage backend cleared", "removed_blocks": removed}


@router.api_route("/freeze_gc", methods=["GET", "POST"])
async def freeze_gc(request: Request) -> Response:
    """SGLang's: exempt every object the server holds now from the cyclic garbage
    collector (runtime/gc_watch.py), so its walks no longer stall streams; meant for after
    a few warm-up requests."""
    freeze()
    return Response("Garbage collection frozen.\n", media_type="text/plain")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m = _ctx(request).metrics
    if not m.enabled:
        raise ApiError(
            404, "metrics are off; start the server with --enable-metrics", "NotFoundError"
        )
    return Response(m.render(), media_type="text/plain; version=0.0.4")

"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models, and
SGLang's /v1/tokenize, /v1/detokenize and /v1/score; /v1/embeddings for an embedding
model."""

from __future__ import annotations

import base64
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.runtime.request import prompt_positions
from kiln.runtime.sampler import TokenLogprob
from kiln.runtime.sampling_params import MAX_N
from kiln.serve.chat_output import plan_chat
from kiln.serve.context import MAX_BEST_OF, ServingContext, cache_key
from kiln.serve.protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from kiln.serve.streams import ApiError, events, merged, sse

router = APIRouter()


def _ctx(request: Request) -> ServingContext:
    return request.app.state.kiln


def _last_hidden(out: Any) -> list[float]:
    """SGLang's OpenAI `hidden_states` of a choice: the last of meta_info's hidden states
    when it holds more than the prompt's rows (the last fed token's), else []."""
    rows = out.hidden_states or []
    return rows[-1] if len(rows) > out.prompt_tokens else []


def _finish_reason(out: Any) -> tuple[str | None, Any]:
    reason = out.finish_reason or {}
    kind = reason.get("type")
    return (
        {"stop": "stop", "length": "length"}.get(kind, kind) if kind else None,
        reason.get("matched"),
    )


# -- /v1/models -------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    adapters = [ctx.model_card(name) for name in ctx.engine.adapters]
    return {"object": "list", "data": [ctx.model_card(), *adapters]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    if model_id in ctx.engine.adapters:
        return ctx.model_card(model_id)
    if model_id != ctx.model_name:
        raise ApiError(404, f"the model '{model_id}' does not exist", "NotFoundError")
    return ctx.model_card()


# -- /v1/tokenize, /v1/detokenize (SGLang's; /tokenize and /detokenize too) ------------------
@router.post("/v1/tokenize")
@router.post("/tokenize", include_in_schema=False)
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    one = isinstance(body.prompt, str)
    texts = [body.prompt] if one else body.prompt
    ids = await ctx.off_loop(lambda: ctx.tokenize(texts, body.add_special_tokens))
    counts = [len(t) for t in ids]
    return {
        "tokens": ids[0] if one else ids,
        "count": counts[0] if one else counts,
        "max_model_len": ctx.context_length,
    }


@router.post("/v1/detokenize")
@router.post("/detokenize", include_in_schema=False)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    one = not body.tokens or not isinstance(body.tokens[0], list)
    rows = [body.tokens] if one else body.tokens
    texts = await ctx.off_loop(lambda: ctx.detokenize(rows, body.skip_special_tokens))
    return {"text": texts[0] if one else texts}


# -- /v1/embeddings (a model compiled with --is-embedding) -----------------------------------
@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """Each input's embedding (Engine.embed's), as floats or, with encoding_format base64
    (the openai client's default), its float32 little-endian bytes in base64; `dimensions`
    cuts a Matryoshka model's to that width (a 400 for other models)."""
    ctx = _ctx(request)
    ctx.refuse_unsupported(body.unsupported())
    reqs, results = await ctx.pooled(
        request, lambda: ctx.prompt_ids(body.input), dimensions=body.dimensions
    )
    data = []
    for i, acc in enumerate(results):
        vector: Any = acc.embedding
        if body.encoding_format == "base64":
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    usage = ctx.usage(reqs, 1, 0)
    del usage["completion_tokens"]
    return {"object": "list", "data": data, "model": ctx.model_name, "usage": usage}


@router.post("/v1/classify")
async def classify(body: ClassifyRequest, request: Request) -> dict[str, Any]:
    """SGLang's: each input's label (the classifier's highest logit) and the softmax of its
    logits over the labels. A reward model's one label always has probability 1: its raw
    score is /classify's or /v1/embeddings' vector."""
    ctx = _ctx(request)
    ctx.refuse_unsupported(body.unsupported())
    labels = ctx.engine.art.spec.labels
    if not labels:
        raise ApiError(400, f"{ctx.model_name} is not a sequence classifier (its checkpoint's "
                       "architecture is not a *ForSequenceClassification)")  # fmt: skip
    reqs, results = await ctx.pooled(request, lambda: ctx.prompt_ids(body.input), rid=body.rid)
    data = []
    for i, acc in enumerate(results):
        logits = np.asarray(acc.embedding, dtype=np.float64)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        data.append({"index": i, "label": labels[int(logits.argmax())],
                     "probs": probs.tolist(), "num_classes": len(labels)})  # fmt: skip
    usage = ctx.usage(reqs, 1, 0)
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": ctx.model_name, "data": data, "usage": usage}  # fmt: skip


@router.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request) -> list[dict[str, Any]]:
    """SGLang's: each document's score (a one-label classifier's logit for the query and
    the document as a text pair), highest first, with its index in `documents`."""
    ctx = _ctx(request)
    labels = ctx.engine.art.spec.labels
    if len(labels) != 1:
        raise ApiError(400, f"{ctx.model_name} is not a reranker: /v1/rerank needs a "
                       "sequence classifier of one label")  # fmt: skip
    reqs, results = await ctx.pooled(request, lambda: ctx.pair_ids(body.query, body.documents))
    ranked = [
        {"score": (acc.embedding or [0.0])[0], "index": i,
         **({"document": doc} if body.return_documents else {}),
         "meta_info": {"id": r.rid, "prompt_tokens": acc.prompt_tokens}}
        for i, (doc, r, acc) in enumerate(zip(body.documents, reqs, results, strict=True))
    ]  # fmt: skip
    return sorted(ranked, key=lambda item: -item["score"])


# -- /v1/score (SGLang's) ---------------------------------------------------------------------
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    """For each item, the label tokens' probabilities right after query + item: one
    greedy token of each prompt with the labels' logprobs (token_ids_logprob), as exp of
    each, or with apply_softmax a softmax over the labels alone."""
    ctx = _ctx(request)
    labels = body.label_token_ids
    assert labels is not None
    params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    multi = ctx.args.multi_item_scoring_delimiter is not None
    if multi and body.item_first:
        raise ApiError(400, "item_first: the query comes first with --multi-item-scoring-delimiter")
    query, prompts = await ctx.off_loop(lambda: _score_prompts(ctx, body, multi))
    if query and len(prompts) > 1:
        # The query once: each item's prompt starts from its cached K/V (what SGLang's
        # one packed, masked sequence computes).
        await ctx.warm_prefixes([(query, None, None)])

    def build() -> list[Any]:
        return ctx.make_requests(prompts, params, 1, top_logprobs=0, logprob_ids=labels)

    reqs = await ctx.build(build)
    results = await ctx.collect(request, reqs)
    scores = []
    for acc in results:
        values = [v for _, v in acc.logprobs[0].ids]
        if body.apply_softmax:
            top = max(values)
            exps = [math.exp(v - top) for v in values]
            scores.append([e / sum(exps) for e in exps])
        else:
            scores.append([math.exp(v) for v in values])
    return {
        "object": "scoring",
        "model": ctx.model_name,
        "scores": scores,
        "usage": ctx.usage(reqs, 1, 0, sum(acc.cached_tokens for acc in results)),
    }


def _score_prompts(
    ctx: ServingContext, body: ScoreRequest, multi: bool
) -> tuple[list[int], list[list[int]]]:
    """The query's ids (multi-item scoring's; else none) and each item's prompt. With
    --multi-item-scoring-delimiter the query and each item are tokenized apart (items
    without special tokens), as SGLang packs them, and an item's prompt is the query's ids
    then its own; else each prompt is query + item (or item + query) tokenized whole."""
    if not multi:
        return [], [ctx.prompt_ids(p)[0] for p in body.prompts()]
    items: list[Any] = [body.items] if isinstance(body.items, str) else list(body.items or [])
    if isinstance(body.query, str):
        query = ctx.prompt_ids(body.query)[0]
        items = ctx.tokenize(items, add_special_tokens=False)
    else:
        query = list(body.query or [])
    if not all(items):
        raise ApiError(400, "items: an item is empty")
    return query, [[*query, *item] for item in items]


# -- /v1/completions --------------------------------------------------------------------------
@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    ctx = _ctx(request)
    ctx.refuse_unsupported(body.unsupported())
    n = body.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}")
    best_of = n if body.best_of is None else body.best_of
    if body.best_of is not None and not n <= best_of <= MAX_BEST_OF:
        raise ApiError(400, f"best_of must be in [n, {MAX_BEST_OF}], got {best_of} (n is {n})")
    if body.stream and best_of != n:
        raise ApiError(400, "best_of > n cannot be streamed")
    want_lp = body.logprobs is not None or best_of > n
    # OpenAI's echo with logprobs: the prompt's tokens have logprobs too (a scorer's
    # request, often with max_tokens 0), the first's null.
    scored = body.logprobs if body.echo and body.logprobs is not None else None

    prompt = body.prompt
    if body.suffix:  # fill in the middle: the template wraps each text prompt
        template = ctx.completion_template
        if template is None:
            raise ApiError(
                400,
                "suffix: this server has no --completion-template (how its model reads a "
                "fill-in-the-middle prompt)",
            )
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "suffix: needs text prompts, not token ids")
        fim = [template.prompt(t, body.suffix) for t in texts]
        prompt = fim[0] if isinstance(prompt, str) else fim

    def build() -> tuple[list[list[int]], list[str], list[Any]]:
        prompts = ctx.prompt_ids(prompt)
        echo = [ctx.decode(p) if body.echo else "" for p in prompts]
        reqs = ctx.make_requests(
            prompts,
            body.sampling_params(body.max_tokens),
            best_of,
            defaults="openai",
            top_logprobs=(body.logprobs or 0) if want_lp else None,
            priority=ctx.priority(body),
            rid=body.rid,
            prompt_top_logprobs=scored,
            cache_key=cache_key(body.cache_salt, body.extra_key),
            lora=ctx.adapter_for(body.model, body.lora_path),
            hidden_states=body.return_hidden_states,
        )
        return prompts, echo, reqs

    prompts, echo, reqs = await ctx.off_loop(build)
    await ctx.start(reqs)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}

    if body.stream:
        include_usage, continuous = _usage_options(body)

        async def chunks() -> AsyncIterator[str]:
            started: set[int] = set()
            completion_tokens = 0
            cached: dict[int, int] = {}

            def usage() -> dict[str, Any]:
                prompt_cached = sum(cached.get(i * n, 0) for i in range(len(prompts)))
                return {"usage": ctx.usage(reqs, n, completion_tokens, prompt_cached)}

            async for i, out in merged(ctx, reqs):
                cached[i] = out.cached_tokens
                text, prompt_lps = out.text, None
                if i not in started:
                    started.add(i)
                    text = echo[i // n] + text
                    prompt_lps = out.prompt_logprobs
                completion_tokens += len(out.token_ids)
                reason, matched = _finish_reason(out)
                if not text and not out.finished and prompt_lps is None:
                    continue
                choice = {
                    "index": i,
                    "text": text,
                    "logprobs": _completion_logprobs(ctx, out.logprobs, prompts[i // n], prompt_lps)
                    if body.logprobs is not None
                    else None,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
                if body.return_hidden_states and out.finished:
                    choice["hidden_states"] = _last_hidden(out)
                yield sse({**head, "choices": [choice], **(usage() if continuous else {})})
            if include_usage:
                yield sse({**head, "choices": [], **usage()})

        return StreamingResponse(events(chunks), media_type="text/event-stream")

    finals = await ctx.collect(request, reqs)
    choices = []
    for p_idx in range(len(prompts)):
        group = finals[p_idx * best_of : (p_idx + 1) * best_of]
        if best_of > n:  # keep the n most likely of best_of, as OpenAI does
            group = sorted(group, key=lambda r: -sum(lp.logprob for lp in r.logprobs))[:n]
        for j, res in enumerate(group):
            reason, matched = _finish_reason(res)
            choices.append(
                {
                    "index": p_idx * n + j,
                    "text": echo[p_idx] + res.text,
                    "logprobs": _completion_logprobs(
                        ctx, res.logprobs, prompts[p_idx], res.prompt_logprobs
                    )
                    if body.logprobs is not None
                    else None,
                    "finish_reason": reason,
                    "matched_stop": matched,
                    **({"hidden_states": _last_hidden(res)} if body.return_hidden_states else {}),
                }
            )
    cached = sum(finals[i * best_of].cached_tokens for i in range(len(prompts)))
    usage = ctx.usage(reqs, best_of, sum(r.completion_tokens for r in finals), cached)
    return {**head, "choices": choices, "usage": usage}


def _usage_options(body: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage in every chunk: vLLM's continuous_usage_stats)."""
    opts = body.stream_options
    return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


def _completion_logprobs(
    ctx: ServingContext,
    lps: list[TokenLogprob],
    prompt: Sequence[int] = (),
    prompt_lps: list[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """OpenAI's completion logprobs of `lps`, after the prompt's when it was scored
    (`prompt_lps`: entry j is prompt token j + 1's; the first token's are null)."""
    ids: list[int] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if prompt_lps is not None:
        for token, lp in zip(prompt, prompt_positions(len(prompt), prompt_lps), strict=True):
            ids.append(token)
            values.append(lp.logprob if lp else None)
            tops.append({ctx.token_text(t): v for t, v in lp.top} if lp else None)
    ids += [lp.token for lp in lps]
    values += [lp.logprob for lp in lps]
    tops += [{ctx.token_text(t): v for t, v in lp.top} for lp in lps]
    tokens = [ctx.token_text(t) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


# -- /v1/chat/completions ---------------------------------------------------------------------
@router.post("/v1/chat/completions", response_model=None)
@router.post("/invocations", response_model=None)  # SageMaker's route for it, as SGLang's
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    ctx = _ctx(request)
    ctx.refuse_unsupported(body.unsupported())
    plan = plan_chat(body, ctx.args.tool_call_parser, ctx.args.reasoning_parser)
    max_tokens = body.max_new_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    prompt = ""

    def build() -> list[Any]:
        nonlocal prompt
        prompt, ids, stop = ctx.chat_prompt(body.messages, body.chat_template_kwargs, plan.tools)
        params = {**body.sampling_params(max_tokens), **plan.sampling}
        if stop and not params.get("ignore_eos"):  # a conversation template's (as SGLang)
            given = params.get("stop") or []
            given = [given] if isinstance(given, str) else list(given)
            params["stop"] = given + [s for s in stop if s not in given]
        return ctx.make_requests(
            [ids],
            params,
            body.n,
            defaults="openai",
            top_logprobs=top,
            priority=ctx.priority(body),
            rid=body.rid,
            cache_key=cache_key(body.cache_salt, body.extra_key),
            lora=ctx.adapter_for(body.model, body.lora_path),
            hidden_states=body.return_hidden_states,
        )

    try:
        reqs = await ctx.build(build)
    except ApiError as e:
        if plan.forces_calls and e.message.startswith("json_schema: "):
            raise ApiError(400, "tools: " + e.message.removeprefix("json_schema: ")) from e
        raise
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": ctx.model_name}

    if body.stream:
        include_usage, continuous = _usage_options(body)
        chunk_head = {**head, "object": "chat.completion.chunk"}

        async def chunks() -> AsyncIterator[str]:
            completion_tokens = cached = 0
            streams = [plan.stream(prompt) for _ in range(body.n)]

            def usage() -> dict[str, Any]:
                return {"usage": ctx.usage(reqs, body.n, completion_tokens, cached)}

            def chunk(choice: dict[str, Any]) -> str:
                return sse({**chunk_head, "choices": [choice], **(usage() if continuous else {})})

            for i in range(body.n):
                delta = {"role": "assistant", "content": ""}
                yield chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None})
            async for i, out in merged(ctx, reqs):
                completion_tokens += len(out.token_ids)
                cached = out.cached_tokens if i == 0 else cached
                deltas = streams[i].feed(out.text) if out.text else []
                if out.finished:
                    deltas += streams[i].finish()
                logprobs = _chat_logprobs(ctx, out.logprobs) if body.logprobs else None
                if not deltas and not out.finished and not (logprobs and out.logprobs):
                    continue
                reason, matched = _finish_reason(out)
                if reason == "stop" and streams[i].has_calls:
                    reason = "tool_calls"
                for k, delta in enumerate(deltas or [{}]):
                    last = k == max(len(deltas) - 1, 0)
                    choice = {
                        "index": i,
                        "delta": delta,
                        "logprobs": logprobs if k == 0 else None,
                        "finish_reason": reason if last else None,
                        "matched_stop": matched if last else None,
                    }
                    if body.return_hidden_states and last and out.finished:
                        choice["hidden_states"] = _last_hidden(out)
                    yield chunk(choice)
            if include_usage:
                yield sse({**chunk_head, "choices": [], **usage()})

        return StreamingResponse(events(chunks), media_type="text/event-stream")

    finals = await ctx.collect(request, reqs)
    choices = []
    for i, res in enumerate(finals):
        reason, matched = _finish_reason(res)
        message, has_calls = plan.message(prompt, res.text)
        if reason == "stop" and has_calls:
            reason = "tool_calls"
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": _chat_logprobs(ctx, res.logprobs) if body.logprobs else None,
                "finish_reason": reason,
                "matched_stop": matched,
                **({"hidden_states": _last_hidden(res)} if body.return_hidden_states else {}),
            }
        )
    usage = ctx.usage(
        reqs, body.n, sum(r.completion_tokens for r in finals), finals[0].cached_tokens
    )
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage})


def _chat_logprobs(ctx: ServingContext, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": ctx.token_text(token), "logprob": logprob, "bytes": ctx.token_bytes(token)}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }

"""What every endpoint shares: the engine, the tokenizer, limits and metrics, and the
helpers that turn HTTP bodies into validated, claimed requests.

Tokenizing and building requests can take long for big prompts or fan-outs, so handlers
run them on `--tokenizer-worker-num` threads (`off_loop`), never on the event loop that
answers /health and every other client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kiln.args import ArgError, ServerArgs, json_object
from kiln.runtime.detokenizer import token_bytes
from kiln.runtime.engine import EMBED, Engine, RequestError
from kiln.runtime.request import Request, RequestOutput
from kiln.runtime.sampling_params import MAX_N, SamplingParams
from kiln.serve import conversation, fim
from kiln.serve.async_engine import AsyncEngine, QueueFull, RidInUse, Unavailable
from kiln.serve.metrics import Metrics
from kiln.serve.protocol import ChatMessage
from kiln.serve.request_log import PROBE_RID, CrashDump, MetricsFile, RequestLog
from kiln.serve.response_store import ResponseStore
from kiln.serve.sessions import SessionStore
from kiln.serve.streams import Accumulated, ApiError, failure, join, merged

log = logging.getLogger("kiln.serve")

T = TypeVar("T")
# Limits on one HTTP request's fan-out (documented in docs/serving.md); n itself is
# capped by SamplingParams.
MAX_BEST_OF = 20  # OpenAI's limit for legacy completions
MAX_REQUESTS_PER_CALL = 1024  # prompts x n (or best_of) in one HTTP request
# /health_generate runs at most one generation per this many seconds, however many call it.
HEALTH_PROBE_SECONDS = 1.0
# Threads that compile grammars (json_schema, regex...): apart from the tokenizer threads,
# so a grammar that takes seconds to compile delays only the requests that have one.
GRAMMAR_THREADS = 2
# An embedding model's requests (Engine.embed's): the prompt and its pooled state.
EMBED_PARAMS = {"max_new_tokens": EMBED.max_new_tokens, "temperature": EMBED.temperature}
EMBEDDING_ONLY = (
    "this server's model was compiled with --is-embedding: it answers /v1/embeddings and "
    "/encode, not generation"
)
NOT_EMBEDDING = (
    "this server's model generates text; embeddings need one compiled with --is-embedding"
)
RID = re.compile(r"[!-~]{1,256}")  # printable ASCII, no spaces: safe in logs and headers
# apply_chat_template's own arguments: not for chat_template_kwargs to override.
_TEMPLATE_RESERVED = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# /generate's sampling defaults before --preferred-sampling-params: SGLang's 128 new tokens
NATIVE_DEFAULTS: dict[str, Any] = {"max_new_tokens": 128}


# --chat-template's (a conversation or a Jinja template's text) and --completion-template's.
Templates = tuple[conversation.Conversation | str | None, fim.CompletionTemplate | None]


def read_templates(args: ServerArgs) -> Templates:
    """The template flags' values, read and checked once; ValueError naming the flag."""
    return conversation.load(args.chat_template), fim.load(args.completion_template)


class ServingContext:
    def __init__(self, engine: Engine, args: ServerArgs, templates: Templates | None = None):
        self.args = args
        self.engine = engine
        self._workers = ThreadPoolExecutor(
            max_workers=args.tokenizer_worker_num, thread_name_prefix="kiln-tokenize"
        )
        # --log-requests: its texts are decoded and its lines written on a thread of its
        # own, in order; a line still waiting there as the server stops is written still.
        self._log_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-log")
        self.async_engine = AsyncEngine(engine, args.max_queued_requests)
        self.configure_logging(args.log_requests, args.log_requests_level)
        self.tokenizer = engine.tokenizer
        self.model_name = args.served_model_name or engine.art.spec.served_model_name
        # --weight-version, then what /update_weight_version sets (SGLang's label of the
        # weights a reinforcement-learning trainer last synced; reported in meta_info).
        self.weight_version = args.weight_version
        self.context_length = engine.context_length
        self.metrics = Metrics(args, self.async_engine, self.model_name)
        if args.export_metrics_to_file:
            if not args.export_metrics_to_file_dir:
                raise ArgError("--export-metrics-to-file: needs --export-metrics-to-file-dir")
            self.async_engine.metrics_file = MetricsFile(
                args.export_metrics_to_file_dir, self.model_name, self._log_worker
            )
        delimiter = args.multi_item_scoring_delimiter
        if delimiter is not None and not 0 <= delimiter < engine.art.spec.vocab_size:
            raise ArgError(
                f"--multi-item-scoring-delimiter {delimiter}: not a token id of this model "
                f"(0 to {engine.art.spec.vocab_size - 1})"
            )
        if args.crash_dump_folder:
            self.async_engine.crash_dump = CrashDump(args.crash_dump_folder, args.to_dict())
        # `kiln serve` read them before the artefact loaded (serve/server.py)
        self.chat_template, self.completion_template = templates or read_templates(args)
        self.preferred = _preferred_sampling(args.preferred_sampling_params)
        self.model_defaults = _model_sampling(engine, args.sampling_defaults)
        self.started = time.time()
        # the Responses API's stored responses (serve/response_store.py); None: none kept
        budget = args.max_stored_response_bytes
        self.responses = ResponseStore(budget) if budget > 0 else None
        # SGLang's sessions (serve/sessions.py); None: --max-session-tokens 0
        tokens = args.max_session_tokens
        self.sessions = SessionStore(tokens) if tokens > 0 else None
        self.weight_lock = asyncio.Lock()  # one /update_weights_from_disk at a time
        self._grammar_workers = ThreadPoolExecutor(
            max_workers=GRAMMAR_THREADS, thread_name_prefix="kiln-grammar"
        )
        self._probe: asyncio.Future[bool] | None = None
        self._probed = (-HEALTH_PROBE_SECONDS, False)  # (when, healthy)

    def configure_logging(self, on: bool, level: int) -> None:
        """--log-requests and its level, at start and from /configure_logging: a request
        that ends later is logged (or not) as they say."""
        self.async_engine.request_log = (
            RequestLog(level, self.args.log_requests_format, self.engine.tokenizer,
                       workers=self._log_worker)
            if on
            else None
        )  # fmt: skip

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._grammar_workers.shutdown(wait=False, cancel_futures=True)
        self._log_worker.shutdown(wait=True)  # the last lines and records are written
        if self.engine.kv_store is not None:  # the disk tier's pages on the way are written
            self.engine.kv_store.close()
        if self.async_engine.metrics_file is not None:
            self.async_engine.metrics_file.close()

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` on a tokenizer thread and await it."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn)

    # -- prompts (tokenizer threads) ------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """Completions' `prompt`: text, list of texts, token ids, or lists of token ids."""
        if isinstance(prompt, str):
            return self._encode(prompt)
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        texts = [p for p in prompt if isinstance(p, str)]
        if self.args.enable_tokenizer_batch_encode and len(texts) == len(prompt) > 1:
            return self._encode(*texts)
        return [self._encode(p)[0] if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[arg-type]

    def chat_prompt(
        self,
        messages: Sequence[ChatMessage],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int], tuple[str, ...]]:
        """The conversation rendered by the chat template (with `tools`, OpenAI's tool
        objects, as transformers passes them), as text and as token ids, and the strings a
        conversation template (serve/conversation.py) stops at."""
        tokenizer = self._tokenizer("chat")
        reserved = sorted(set(template_kwargs or {}) & _TEMPLATE_RESERVED)
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}")
        convo = [_turn(m) for m in messages]
        if isinstance(self.chat_template, conversation.Conversation):
            try:
                text = conversation.prompt(
                    self.chat_template, convo, template_kwargs, self.args.reasoning_parser
                )
            except ValueError as e:
                raise ApiError(400, str(e)) from e
            ids = list(tokenizer.encode(text, add_special_tokens=True))  # as SGLang's
            return text, ids, self.chat_template.stop
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ApiError(
                400,
                "the model has no chat template; start the server with --chat-template (a "
                "Jinja file, or a conversation template such as chatml)",
            )
        try:
            text = tokenizer.apply_chat_template(
                convo,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=True,
                tools=tools,
                **(template_kwargs or {}),
            )
        except Exception as e:  # a template error is about this conversation
            raise ApiError(400, f"the chat template failed on these messages: {e}") from e
        return text, list(tokenizer.encode(text, add_special_tokens=False)), ()

    def _encode(self, *texts: str) -> list[list[int]]:
        """Each text's ids (several: in one tokenizer call, Engine.encode_batch); a 400
        for an empty one or a server without a tokenizer."""
        if not all(texts):
            raise ApiError(400, "the prompt is empty")
        try:
            if len(texts) == 1:
                return [self.engine.encode(texts[0])]
            return self.engine.encode_batch(list(texts))
        except RequestError as e:
            raise ApiError(400, str(e)) from e

    def pair_ids(self, query: str, documents: list[str]) -> list[list[int]]:
        """/v1/rerank's prompts: the query and each document as a text pair (the tokenizer's
        pair template, as a cross-encoder reads them); a 400 for an empty one."""
        if not query or not all(documents):
            raise ApiError(400, "the query and every document must be non-empty")
        tokenizer = self._tokenizer("rerank")
        pairs = [(query, d) for d in documents]
        if hasattr(tokenizer, "encode_pairs"):
            return tokenizer.encode_pairs(pairs)
        return [list(tokenizer(q, d)["input_ids"]) for q, d in pairs]  # transformers'

    def tokenize(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """/v1/tokenize: each text's ids (an empty text too: its special tokens)."""
        tokenizer = self._tokenizer("tokenize")
        return [list(tokenizer.encode(t, add_special_tokens=add_special_tokens)) for t in texts]

    def detokenize(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """/v1/detokenize: each list's text. Ids outside the vocabulary are a 400 (the
        tokenizer would drop them without a word, or fail on a negative one)."""
        tokenizer = self._tokenizer("detokenize")
        try:
            self.engine.check_vocabulary((t for row in ids for t in row), "token ids")
        except RequestError as e:
            raise ApiError(400, str(e)) from e
        return [str(tokenizer.decode(row, skip_special_tokens=skip_special_tokens)) for row in ids]

    def _tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, f"{what} needs a tokenizer; this server was started without one")
        return self.tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token: int) -> str:
        return self.decode([token], skip_special_tokens=False)

    def token_bytes(self, token: int) -> list[int]:
        """The token's own bytes (part of a UTF-8 character for some tokens)."""
        if self.tokenizer is None:
            return []
        return list(token_bytes(self.tokenizer, token))

    def priority(self, body: Any) -> int:
        """A body's priority. Without priority scheduling it orders nothing; with
        --abort-on-priority-when-disabled a body that names one is then a 400 (SGLang's
        flag), so a client that relies on it learns it is not honoured."""
        args = self.args
        if (
            "priority" in body.model_fields_set
            and args.abort_on_priority_when_disabled
            and not (args.enable_priority_scheduling or args.schedule_policy == "priority")
        ):
            raise ApiError(
                400,
                "priority: this server does not schedule by priority "
                "(no --enable-priority-scheduling; --abort-on-priority-when-disabled)",
            )
        return int(body.priority)

    def refuse_unsupported(self, fields: list[str]) -> None:
        if fields:
            raise ApiError(400, f"{', '.join(fields)}: not supported by kiln yet")

    # -- requests (tokenizer threads, then claimed on the loop) -------------------------------
    def make_requests(
        self,
        prompts: list[list[int]],
        params: dict[str, Any] | list[dict[str, Any]],
        n: int | None = None,
        top_logprobs: int | None = None,
        priority: int = 0,
        rid: str | list[str] | None = None,
        prompt_top_logprobs: int | None = None,
        logprob_ids: list[int] | list[list[int]] | None = None,
        embed: bool = False,
        dimensions: int | None = None,
        defaults: str | None = None,
        cache_key: str | list[str] | None = None,
        hidden_states: bool = False,
        lora: str | list[str | None] | None = None,
    ) -> list[Request]:
        """`n` requests per prompt (default: the params' own `n`), validated; raises
        ApiError(400) naming the problem. `params` is one dict for all prompts or one per
        prompt; `rid` a client id (suffixed per request when it fans out) or one per prompt;
        `prompt_top_logprobs`, the prompts' logprobs too; `logprob_ids`, the tokens whose
        logprobs each position reports, for all prompts or one list per prompt
        (Engine.make_request); `embed`, an embedding model's requests, which such a model
        takes and no other (a 400 either way round), and `dimensions` the width a
        Matryoshka model's vectors are cut to. `defaults`, a client's generation request:
        "native" (/generate) starts from --preferred-sampling-params, "openai" from the
        model's recommended sampling (--sampling-defaults model) under those; the
        request's own fields win. `cache_key`: SGLang's extra_key (with cache_salt), for
        all prompts or one per prompt: requests share cached prefixes only with requests
        of the same key. `hidden_states`: SGLang's return_hidden_states (an
        --enable-return-hidden-states artefact). `lora`: a loaded LoRA adapter's name,
        for all prompts or one (or None) per prompt."""
        if embed != self.engine.art.spec.is_embedding:
            raise ApiError(400, NOT_EMBEDDING if embed else EMBEDDING_ONLY)
        if n is not None and not 1 <= n <= MAX_N:
            raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}")
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if defaults is not None:
            # SGLang's native default is 128 new tokens (OpenAI routes: up to the context).
            first = self.model_defaults if defaults == "openai" else NATIVE_DEFAULTS
            base = {**first, **(self.preferred or {})}
            per_prompt = [{**base, **_as_dict(p)} for p in per_prompt]
        if len(per_prompt) != len(prompts):
            raise ApiError(400, f"{len(per_prompt)} sampling_params for {len(prompts)} prompts")
        try:
            parsed = [SamplingParams.from_dict(_as_dict(p)) for p in per_prompt]
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        counts = [n or sp.n for sp in parsed]
        if sum(counts) > MAX_REQUESTS_PER_CALL:
            raise ApiError(
                400,
                f"this request fans out to {sum(counts)} generations (prompts x n); "
                f"at most {MAX_REQUESTS_PER_CALL} per request",
            )
        rids = _request_ids(rid, counts)
        named = _per_prompt_ids(logprob_ids, len(prompts))
        keys = _per_prompt_keys(cache_key, len(prompts))
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ApiError(400, f"{len(loras)} lora_path values for {len(prompts)} prompts")
        reqs = []
        for ids, p, sp, count, names, lp_ids, key, adapter in zip(
            prompts, per_prompt, parsed, counts, rids, named, keys, loras, strict=True
        ):
            # No max_new_tokens: generate up to the end of the context, as SGLang does.
            given = p.get("max_new_tokens") is not None
            ids = self._fit(ids, sp.max_new_tokens if given else None)
            try:
                if not given:
                    sp = dataclasses.replace(sp, max_new_tokens=self.context_length - len(ids))
                reqs += [
                    self.engine.make_request(
                        ids,
                        sp,
                        index=i,
                        top_logprobs=top_logprobs,
                        priority=priority,
                        rid=name,
                        prompt_top_logprobs=prompt_top_logprobs,
                        logprob_ids=lp_ids,
                        dimensions=dimensions,
                        return_hidden_states=hidden_states,
                        lora=adapter,
                    )
                    for i, name in zip(range(count), names, strict=True)
                ]
            except (ValueError, RequestError) as e:
                raise ApiError(400, str(e)) from e
            for req in reqs[len(reqs) - count :]:
                req.cache_key = key
        return reqs

    def admit(self, reqs: list[Request]) -> None:
        """Claim the requests' ids (on the event loop: atomic against other handlers)."""
        if self.async_engine.draining:
            message = self.async_engine.failure or "the server is shutting down"
            raise ApiError(503, message, "ServiceUnavailableError")
        try:
            self.async_engine.claim(reqs)
        except RidInUse as e:
            raise ApiError(400, str(e)) from e

    async def build(self, fn: Callable[[], list[Request]]) -> list[Request]:
        """Build requests on a tokenizer thread, compile their grammars, admit them (a
        prompt several of them share prefilled once first: warm_prefixes)."""
        reqs = await self.off_loop(fn)
        await self.start(reqs)
        return reqs

    async def pooled(
        self, http: Any, prompts: Callable[[], list[list[int]]], **kw: Any
    ) -> tuple[list[Request], list[Accumulated]]:
        """An embedding model's (or classifier's) requests for `prompts()` (tokenized on a
        tokenizer thread; `kw`: make_requests' rid, dimensions), run to their end: each
        one's pooled vector is its result's `embedding`."""
        reqs = await self.build(
            lambda: self.make_requests(prompts(), EMBED_PARAMS, 1, embed=True, **kw)
        )
        return reqs, await self.collect(http, reqs)

    async def start(self, reqs: list[Request]) -> None:
        """Compile the requests' grammars, prefill a prompt several of them share once
        first (warm_prefixes), admit them."""
        await self.compile_grammars(reqs)
        await self.warm_prefixes(_shared_prompts(reqs, self.engine.art.spec.is_embedding))
        self.admit(reqs)

    async def warm_prefixes(self, prompts: list[tuple[list[int], str | None, str | None]]) -> None:
        """Prefill each (ids, LoRA adapter, cache key) once and wait: its K/V go to the
        prefix cache, so the requests that follow start from them rather than each
        computing the prompt in one batch (which shares nothing). SGLang sends a prompt
        of parallel sampling (n > 1) ahead so; /v1/score's multi-item mode sends its
        query. Nothing without the prefix cache."""
        if not prompts or self.args.disable_radix_cache:
            return

        def make() -> list[Request]:
            warm = []
            for ids, lora, key in prompts:
                req = self.engine.make_request(list(ids), _WARM, lora=lora)
                req.cache_key = key
                warm.append(req)
            return warm

        try:
            warm = await self.off_loop(make)
        except (ValueError, RequestError) as e:
            raise ApiError(400, str(e)) from e
        self.admit(warm)
        async for _ in merged(self, warm):
            pass

    async def compile_grammars(self, reqs: list[Request]) -> None:
        """Each constrained request's matcher, compiled on the grammar threads (cached by
        constraint); a 400 naming the field when one does not compile."""
        pending = [r for r in reqs if r.params.constraint is not None]
        if not pending:
            return

        def attach() -> None:
            for r in pending:
                self.engine.attach_grammar(r)

        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_workers, attach)
        except (ValueError, RequestError) as e:
            raise ApiError(400, str(e)) from e

    def _fit(self, ids: list[int], max_new: int | None) -> list[int]:
        """Check the prompt (and max tokens) against the context; truncate if allowed."""
        ctx = self.context_length
        if len(ids) >= ctx:
            if not self.args.allow_auto_truncate:
                raise ApiError(
                    400,
                    f"the prompt has {len(ids)} tokens, more than the context "
                    f"length of {ctx} allows (at most {ctx - 1})",
                )
            ids = ids[: ctx - 1]
        if max_new is not None and len(ids) + max_new > ctx:
            raise ApiError(
                400,
                f"the prompt ({len(ids)} tokens) plus max tokens ({max_new}) "
                f"exceeds the context length of {ctx}",
            )
        return ids

    # -- outputs ---------------------------------------------------------------------------------
    async def stream(self, req: Request) -> AsyncIterator[RequestOutput]:
        """The request's outputs, joined into pieces of --stream-interval tokens, with
        metrics recorded per step. A failure ends it with ApiError (503 when the queue is
        full or the server is stopping, 500 when the engine had to stop the request)."""
        start = last = time.perf_counter()
        pending: RequestOutput | None = None
        try:
            async for out in self.async_engine.stream(req):
                now = time.perf_counter()
                self.metrics.on_output(
                    out, first=(last == start), since_last=now - last, since_start=now - start
                )
                last = now
                pending = out if pending is None else join(pending, out)
                if pending.finished or len(pending.token_ids) >= self.args.stream_interval:
                    error = failure(pending) if pending.finished else None
                    if error is not None:
                        raise error
                    yield pending
                    pending = None
        except (QueueFull, Unavailable) as e:
            raise ApiError(503, str(e), "ServiceUnavailableError") from e

    async def collect(self, http: Any, reqs: list[Request]) -> list[Accumulated]:
        """Run `reqs` to the end; abort them if the client disconnects first."""
        results = [Accumulated() for _ in reqs]

        async def drain() -> None:
            async for i, out in merged(self, reqs):
                results[i].add(out)

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                await asyncio.wait([task], timeout=0.5)
                if not task.done() and await http.is_disconnected():
                    task.cancel()
        except asyncio.CancelledError:  # the caller was cancelled (a background response's
            task.cancel()  # cancel): its requests are aborted too, not left to run
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return results

    async def probe(self, max_new_tokens: int) -> bool:
        """Generate a few tokens from the BOS token; True when the request finished."""
        bos = self.engine.art.spec.bos_token_id or 0
        params = {"max_new_tokens": max_new_tokens, "temperature": 0}
        embed = self.engine.art.spec.is_embedding  # then one pooled step, not tokens
        reqs = self.make_requests(
            [[bos]],
            EMBED_PARAMS if embed else params,
            embed=embed,
            rid=PROBE_RID + uuid.uuid4().hex,
        )
        self.admit(reqs)
        finished = False
        async for out in self.stream(reqs[0]):
            finished = out.finished
        return finished

    async def health_probe(self) -> bool:
        """/health_generate's answer. Concurrent callers await one shared probe, and an
        answer younger than HEALTH_PROBE_SECONDS is reused, so keyless callers (the route
        is public) cost at most one one-token generation a second. A caller that leaves
        does not cancel the probe the others wait for. While /pause_generation holds the
        engine no token comes: healthy is then the engine thread's being alive."""
        if self.async_engine.paused:
            return self.async_engine.thread.alive
        at, healthy = self._probed
        if self._probe is None and time.monotonic() - at < HEALTH_PROBE_SECONDS:
            return healthy
        if self._probe is None:
            self._probe = asyncio.ensure_future(self._run_probe())
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> bool:
        healthy = False
        try:
            healthy = await self.probe(max_new_tokens=1)
        except ApiError:
            pass
        finally:
            self._probed = (time.monotonic(), healthy)
            self._probe = None
        return healthy

    def usage(
        self, reqs: list[Request], per_prompt: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """OpenAI usage; each prompt counted once (its requests are `per_prompt` in a row),
        as the model saw it (after any truncation)."""
        prompt_tokens = sum(len(r.prompt_ids) for r in reqs[::per_prompt])
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.args.enable_cache_report:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage

    def model_card(self, adapter: str | None = None) -> dict[str, Any]:
        """/v1/models' entry of the model, or of a LoRA adapter on it (vLLM's form: its
        name the id, the served model its parent)."""
        card = {
            "id": adapter or self.model_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "kiln",
            "root": adapter or self.model_name,
            "max_model_len": self.context_length,
        }
        return card if adapter is None else {**card, "parent": self.model_name}

    def adapter_for(self, model: str, lora_path: str | None) -> str | None:
        """The LoRA adapter an OpenAI request asks for: `model` "SERVED:ADAPTER" (SGLang's
        form, which wins over lora_path) or an adapter's own name (vLLM's, as /v1/models
        lists them), else its lora_path. Other model names serve the model, as before."""
        adapters = self.engine.adapters
        if adapters and model in adapters:
            return model
        base, colon, name = model.partition(":")
        if colon and name and self.engine.args.enable_lora and base == self.model_name:
            return name  # an unknown one is the 400 make_request gives
        return lora_path


# A prompt prefilled ahead (ServingContext.warm_prefixes): its first token, greedy.
_WARM = SamplingParams(max_new_tokens=1, temperature=0.0)
# Prompts shorter than this are not prefilled ahead: the wait costs more than they do.
WARM_MIN_TOKENS = 16


def _shared_prompts(
    reqs: list[Request], embedding: bool
) -> list[tuple[list[int], str | None, str | None]]:
    """The prompts (with their adapter and cache key) that two or more of `reqs` share,
    of at least WARM_MIN_TOKENS tokens, whose requests read the prefix cache (not an
    embedding model's, not a prompt computed whole for its logprobs or hidden states)."""
    if embedding or len(reqs) < 2:
        return []
    groups: dict[Any, list[Request]] = {}
    for r in reqs:
        if len(r.prompt_ids) >= WARM_MIN_TOKENS and not r.scoring:
            groups.setdefault((tuple(r.prompt_ids), r.prefix_space), []).append(r)
    return [
        (list(g[0].prompt_ids), g[0].lora, g[0].cache_key) for g in groups.values() if len(g) > 1
    ]


def _per_prompt_ids(ids: list[int] | list[list[int]] | None, prompts: int) -> list[tuple[int, ...]]:
    """token_ids_logprob for each prompt: one list for all, or one list each."""
    if not ids or not isinstance(ids[0], list):
        return [tuple(ids or ())] * prompts  # type: ignore[arg-type]
    if len(ids) != prompts:
        raise ApiError(400, f"{len(ids)} token_ids_logprob lists for {prompts} prompts")
    return [tuple(row) for row in ids]


MAX_CACHE_KEY_CHARS = 256


def cache_key(*parts: str | list[str] | None) -> str | list[str] | None:
    """SGLang's cache_salt and extra_key as one key (each a string, or a list of one per
    prompt), the parts kept apart so that ("ab", "c") and ("a", "bc") differ."""
    given = [p for p in parts if p]
    if not given:
        return None
    if all(isinstance(p, str) for p in given):
        return "\x1f".join(given)  # type: ignore[arg-type]
    lists = [p if isinstance(p, list) else None for p in given]
    n = max(len(p) for p in lists if p is not None)
    if any(p is not None and len(p) != n for p in lists):
        raise ApiError(400, "cache_salt and extra_key: lists of different lengths")
    cols = [p if isinstance(p, list) else [p] * n for p in given]
    return ["\x1f".join(row) for row in zip(*cols, strict=True)]


def _per_prompt_keys(key: str | list[str] | None, prompts: int) -> list[str | None]:
    """The cache key of each prompt: one for all, or one each; each at most
    MAX_CACHE_KEY_CHARS characters."""
    keys: list[str | None] = list(key) if isinstance(key, list) else [key] * prompts
    if len(keys) != prompts:
        raise ApiError(400, f"{len(keys)} extra_key / cache_salt values for {prompts} prompts")
    for k in keys:
        if k is not None and len(k) > MAX_CACHE_KEY_CHARS:
            raise ApiError(400, f"extra_key / cache_salt: at most {MAX_CACHE_KEY_CHARS} characters")
    return keys


def _request_ids(rid: str | list[str] | None, counts: list[int]) -> list[list[str | None]]:
    """Per prompt, the id of each of its requests: None (the engine makes a uuid), the
    client's id, or the client's id suffixed `_i` when it covers several requests."""
    if rid is None:
        return [[None] * c for c in counts]
    given = [rid] if isinstance(rid, str) else list(rid)
    for r in given:
        if not RID.fullmatch(r):
            raise ApiError(400, f"rid {r[:40]!r}: 1-256 printable ASCII characters, no spaces")
    if isinstance(rid, str):
        total = sum(counts)
        names = [rid] if total == 1 else [f"{rid}_{i}" for i in range(total)]
        out, at = [], 0
        for c in counts:
            out.append(list(names[at : at + c]))
            at += c
        return out  # type: ignore[return-value]
    if len(given) != len(counts):
        raise ApiError(400, f"{len(given)} rids for {len(counts)} prompts")
    return [
        [r] if c == 1 else [f"{r}_{i}" for i in range(c)]
        for r, c in zip(given, counts, strict=True)
    ]


def _as_dict(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise ApiError(400, f"sampling_params: expected an object, got {params!r:.40}")
    return params


def _turn(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (transformers' conventions): text content, and
    earlier calls' arguments as objects where they are JSON objects (as SGLang passes them;
    templates such as Qwen2.5's write them with `tojson`)."""
    turn: dict[str, Any] = {"role": m.role, "content": _text_content(m.content)}
    for key in ("name", "reasoning_content", "tool_call_id"):
        if getattr(m, key):
            turn[key] = getattr(m, key)
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            args: Any = c.function.arguments
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            calls.append(
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {
                        "name": c.function.name,
                        "arguments": parsed if isinstance(parsed, dict) else args,
                    },
                }
            )
        turn["tool_calls"] = calls
    return turn


def _text_content(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text", ""), str):
            raise ApiError(
                400, f"message content of type {part.get('type')!r} is not supported (text only)"
            )
        parts.append(part.get("text", ""))
    return "".join(parts)


def _preferred_sampling(text: str | None) -> dict[str, Any] | None:
    """--preferred-sampling-params: a JSON object of sampling parameters every generation
    request starts from (its own fields win), checked as a request's would be."""
    if text is None:
        return None
    flag = "--preferred-sampling-params"
    params = json_object(flag, text)
    try:
        SamplingParams.from_dict(params)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    return params


def _model_sampling(engine: Engine, where: str) -> dict[str, Any]:
    """With --sampling-defaults model (SGLang's default), what the checkpoint's
    generation_config.json recommends for the OpenAI routes' unset temperature, top_p,
    top_k, min_p and repetition_penalty; each value the sampler would refuse is left out,
    with a warning. With `openai`, nothing (OpenAI's defaults)."""
    if where != "model":
        return {}
    kept = {}
    for key, value in engine.art.spec.sampling_defaults.items():
        try:
            SamplingParams.from_dict({key: value})
        except ValueError as e:
            log.warning("generation_config.json's %s is not used: %s", key, e)
            continue
        kept[key] = value
    if kept:
        log.info("sampling defaults from generation_config.json: %s", kept)
    return kept

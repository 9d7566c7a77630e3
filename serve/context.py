"""What every endpoint shares: the engine, the tokenizer, limits, metrics, and the helpers
that turn HTTP bodies into validated requests and engine outputs into results."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.args import ServerArgs
from kiln.runtime.engine import Engine, RequestError
from kiln.runtime.request import Request, RequestOutput
from kiln.runtime.sampler import TokenLogprob
from kiln.runtime.sampling_params import SamplingParams
from kiln.serve.async_engine import AsyncEngine
from kiln.serve.metrics import Metrics
from kiln.serve.protocol import ChatMessage


class ApiError(Exception):
    """An error answered as JSON with an HTTP status (4xx for the client's mistakes)."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class Accumulated:
    """A finished request: the concatenation of its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.finish_reason = out.finish_reason
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        self.cached_tokens = out.cached_tokens


class ServingContext:
    def __init__(self, engine: Engine, args: ServerArgs) -> None:
        self.args = args
        self.engine = engine
        self.async_engine = AsyncEngine(engine, args.max_queued_requests)
        self.tokenizer = engine.tokenizer
        self.model_name = args.served_model_name or engine.art.spec.served_model_name
        self.context_length = engine.context_length
        self.metrics = Metrics(args, self.async_engine)
        self.chat_template = _read_template(args.chat_template)
        self.started = time.time()

    # -- prompts --------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """Completions' `prompt`: text, list of texts, token ids, or lists of token ids."""
        if isinstance(prompt, str):
            return [self._encode(prompt)]
        if not prompt:
            raise ApiError(400, "the prompt is empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return [self._encode(p) if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[arg-type]

    def chat_prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "chat needs a tokenizer; this server was started without one")
        convo = [{"role": m.role, "content": _text_content(m.content)} for m in messages]
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ApiError(
                400, "the model has no chat template; start the server with --chat-template FILE"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                convo, chat_template=template, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # a template error is about this conversation
            raise ApiError(400, f"the chat template failed on these messages: {e}") from e
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise ApiError(400, "the prompt is empty")
        try:
            return self.engine.encode(text)
        except RequestError as e:
            raise ApiError(400, str(e)) from e

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token: int) -> str:
        return self.decode([token], skip_special_tokens=False)

    def refuse_unsupported(self, fields: list[str]) -> None:
        if fields:
            raise ApiError(400, f"{', '.join(fields)}: not supported by kiln yet")

    # -- requests -------------------------------------------------------------------------------
    def make_requests(
        self,
        prompts: list[list[int]],
        params: dict[str, Any],
        n: int,
        top_logprobs: int | None = None,
        priority: int = 0,
    ) -> list[Request]:
        """n requests per prompt, validated; raises ApiError(400) naming the problem."""
        if n < 1:
            raise ApiError(400, f"n must be >= 1, got {n}")
        reqs = []
        for ids in prompts:
            ids = self._fit(ids, params.get("max_new_tokens"))
            p = dict(params)
            if p.get("max_new_tokens") is None:
                p["max_new_tokens"] = self.context_length - len(ids)
            try:
                sp = SamplingParams.from_dict(p)
                reqs += [
                    self.engine.make_request(
                        ids, sp, index=i, top_logprobs=top_logprobs, priority=priority
                    )
                    for i in range(n)
                ]
            except (ValueError, RequestError) as e:
                raise ApiError(400, str(e)) from e
        return reqs

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

    async def stream(self, req: Request) -> AsyncIterator[RequestOutput]:
        """The request's outputs, joined into pieces of --stream-interval tokens, with
        metrics recorded per step; QueueFull becomes a 503."""
        from kiln.serve.async_engine import QueueFull

        start = last = time.perf_counter()
        pending: RequestOutput | None = None
        try:
            async for out in self.async_engine.stream(req):
                now = time.perf_counter()
                self.metrics.on_output(
                    out, first=(last == start), since_last=now - last, since_start=now - start
                )
                last = now
                pending = out if pending is None else _join(pending, out)
                if pending.finished or len(pending.token_ids) >= self.args.stream_interval:
                    yield pending
                    pending = None
        except QueueFull as e:
            raise ApiError(503, str(e), "ServiceUnavailableError") from e

    async def collect(self, http: Any, reqs: list[Request]) -> list[Accumulated]:
        """Run `reqs` to the end; abort them if the client disconnects first."""
        results = [Accumulated() for _ in reqs]

        async def drain() -> None:
            async for i, out in merged(self, reqs):
                results[i].add(out)

        task = asyncio.ensure_future(drain())
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await http.is_disconnected():
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return results

    async def probe(self, max_new_tokens: int) -> bool:
        """Generate a few tokens from the BOS token; True when the request finished."""
        req = self.make_requests(
            [[self.engine.art.spec.bos_token_id or 0]],
            {"max_new_tokens": max_new_tokens, "temperature": 0},
            1,
        )[0]
        finished = False
        async for out in self.stream(req):
            finished = out.finished
        return finished

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

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "kiln",
            "root": self.model_name,
            "max_model_len": self.context_length,
        }


async def merged(
    ctx: ServingContext, reqs: list[Request]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index. Closing
    this iterator early cancels every stream, which aborts their requests."""
    if len(reqs) == 1:
        async for out in ctx.stream(reqs[0]):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, req: Request) -> None:
        try:
            async for out in ctx.stream(req):
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        done = 0
        while done < len(tasks):
            i, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _join(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one."""
    return dataclasses.replace(
        b,
        token_ids=a.token_ids + b.token_ids,
        text=a.text + b.text,
        logprobs=a.logprobs + b.logprobs,
    )


def _text_content(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ApiError(
                400, f"message content of type {part.get('type')!r} is not supported (text only)"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--chat-template: {path} is not a file (give a Jinja template file)")
    return p.read_text()

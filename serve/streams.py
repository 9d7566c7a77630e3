"""Engine outputs as the endpoints use them: merged across a request's fan-out, summed
into results, and turned into server-sent events (errors included)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.runtime.request import Request, RequestOutput
from kiln.runtime.sampler import TokenLogprob
from kiln.serve.middleware import error_body

if TYPE_CHECKING:
    from kiln.serve.context import ServingContext


class ApiError(Exception):
    """An error answered as JSON with an HTTP status (4xx for the client's mistakes)."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def failure(out: RequestOutput) -> ApiError | None:
    """The error a finished output carries: the engine stopped the request on a failure
    (500) or for shutdown (503). A plain abort (its client left) is not one."""
    reason = out.finish_reason or {}
    status = reason.get("status_code")
    if reason.get("type") != "abort" or not isinstance(status, int):
        return None
    kind = "ServiceUnavailableError" if status == 503 else "InternalServerError"
    return ApiError(status, str(reason.get("message", "aborted")), kind)


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
    spec: dict[str, Any] | None = None  # speculative decoding's meta_info
    prompt_logprobs: list[TokenLogprob] | None = None  # when the request scored its prompt
    embedding: list[float] | None = None  # an embedding model's
    hidden_states: list[list[float]] | None = None  # return_hidden_states: every row

    def add(self, out: RequestOutput) -> None:
        if out.hidden_states is not None:
            self.hidden_states = out.hidden_states
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.embedding is not None:
            self.embedding = out.embedding
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.finish_reason = out.finish_reason
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.spec = out.spec


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def events(body: Callable[[], AsyncIterator[str]]) -> AsyncIterator[str]:
    """A stream's events, then `[DONE]`; an error mid-stream becomes a final error event
    (the status line was sent long ago)."""
    try:
        async for event in body():
            yield event
    except ApiError as e:
        yield sse(error_body(e.status, e.message, e.kind))
    yield "data: [DONE]\n\n"


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


def join(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one."""
    return dataclasses.replace(
        b,
        token_ids=a.token_ids + b.token_ids,
        text=a.text + b.text,
        logprobs=a.logprobs + b.logprobs,
    )


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`: a stream holds them
    until the next piece says whether the marker follows."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

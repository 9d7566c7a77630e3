"""OpenAI's Responses API (`/v1/responses`), served as the chat completion it asks for:
`instructions` and `input` (a string, or message, `function_call` and
`function_call_output` items) become the messages, `tools` (Responses' flat function
tools), `tool_choice`, `text.format` and the sampling fields become the chat request's,
and the chat completion's message (reasoning, text, tool calls; serve/chat_output.py)
becomes the response's output items. Streamed, the chat deltas become Responses' typed
events (`response.created`, `response.output_text.delta`, ... `response.completed`).

Responses are kept (`store`, true by default) in serve/response_store.py: a request
continues one with `previous_response_id` (its conversation, input and output, before the
new input; its instructions are not carried over, as in OpenAI's API); GET
/v1/responses/{id} fetches one, GET .../input_items lists its input, DELETE drops it. With
`background: true` the request is answered at once (status `queued`) and runs on; GET polls
it and POST .../cancel stops it. `conversation` objects and inputs other than text are
refused (a 400 naming them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from kiln.serve.openai_api import _ctx, chat_completions
from kiln.serve.protocol import ChatCompletionRequest, ResponsesRequest
from kiln.serve.response_store import ResponseStore, Stored
from kiln.serve.streams import ApiError

log = logging.getLogger("kiln.serve")

router = APIRouter()

TEXT_PARTS = ("input_text", "output_text", "text")
_STOP_S = 10  # how long a cancel waits for a background run to stop


@router.post("/v1/responses", response_model=None)
async def responses(body: ResponsesRequest, request: Request) -> Any:
    ctx = _ctx(request)
    ctx.refuse_unsupported(body.unsupported())
    store: ResponseStore | None = ctx.responses
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        before = _stored(store, body.previous_response_id, "previous_response_id")
        if before.running:
            raise ApiError(400, f"previous_response_id: response {body.previous_response_id} "
                           f"is still {before.response['status']}")  # fmt: skip
        history = before.history
    inputs = input_items(body)
    chat = chat_request(body, history + inputs, len(history))
    keep = store is not None and body.store
    body = body.model_copy(update={"store": keep})  # what the response says
    rid = f"resp_{uuid.uuid4().hex}"
    head: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": ctx.model_name,
    }
    said = history + inputs

    def kept(state: dict[str, Any]) -> None:
        if keep and store is not None:
            store.put(rid, Stored(state, said + carried(state["output"]), inputs))

    if body.background:
        if not keep:
            raise ApiError(400, "background: needs store (a background response is kept "
                           "for GET and cancel)" + _off(store))  # fmt: skip
        if body.stream:
            raise ApiError(400, "background: kiln does not stream a background response; "
                           "poll GET /v1/responses/{id}")  # fmt: skip
        queued = response(body, head, [], None, None, status="queued")
        stored = Stored(queued, said, inputs)
        assert store is not None
        store.put(rid, stored)
        stored.task = asyncio.create_task(_background(request, chat, body, head, stored, store))
        return queued
    answer = await chat_completions(chat, request)
    if not body.stream:
        final = finished(body, head, answer)
        kept(final)
        return final
    return StreamingResponse(
        ResponseEvents(body, head, kept).translate(answer.body_iterator),
        media_type="text/event-stream",
    )


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve(response_id: str, request: Request) -> Any:
    if request.query_params.get("stream") in ("true", "1"):
        raise ApiError(400, "stream: kiln does not stream a stored response again")
    return _stored(_ctx(request).responses, response_id, "response_id").response


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete(response_id: str, request: Request) -> Any:
    store = _ctx(request).responses
    stored = _stored(store, response_id, "response_id")
    await _stop(stored)
    assert store is not None
    store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel", response_model=None)
async def cancel(response_id: str, request: Request) -> Any:
    """Stop a background response (status `cancelled`, what it had made dropped); one that
    already ended is returned as it is."""
    stored = _stored(_ctx(request).responses, response_id, "response_id")
    if not stored.response.get("background"):
        raise ApiError(400, f"response {response_id}: only a background response can be "
                       "cancelled")  # fmt: skip
    await _stop(stored)
    return stored.response


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> Any:
    """The response's own input items (those of its request, not of the responses it
    continues), `order`ed, `limit` at a time from the item after `after`."""
    items = list(_stored(_ctx(request).responses, response_id, "response_id").inputs)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"after: no input item {after!r} in response {response_id}")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def _off(store: ResponseStore | None) -> str:
    return "; this server keeps none (--max-stored-response-bytes 0)" if store is None else ""


def _stored(store: ResponseStore | None, rid: str, field: str) -> Stored:
    """The stored response `rid`, or a 404 naming `field`."""
    if not rid.startswith("resp_"):
        raise ApiError(400, f"{field}: {rid!r} is not a response id (they begin with resp_)")
    stored = store.get(rid) if store is not None else None
    if stored is None:
        raise ApiError(404, f"{field}: no stored response {rid}" + _off(store), "NotFoundError")
    return stored


async def _stop(stored: Stored) -> None:
    """Cancel `stored`'s background run if it is still going: its requests are aborted."""
    task = stored.task
    if task is None or task.done():
        return
    stored.response["status"] = "cancelled"
    task.cancel()
    await asyncio.wait([task], timeout=_STOP_S)  # its requests' aborts sent and seen
    if not task.done():
        log.warning("background response %s: its run did not stop in %d s", stored.response["id"],
                    _STOP_S)  # fmt: skip


class _Detached:
    """The part of a request a background run uses once its caller has had the answer:
    the app; never disconnected (cancel stops it instead)."""

    def __init__(self, request: Request) -> None:
        self.app = request.app

    async def is_disconnected(self) -> bool:
        return False


async def _background(
    request: Request,
    chat: ChatCompletionRequest,
    body: ResponsesRequest,
    head: dict[str, Any],
    stored: Stored,
    store: ResponseStore,
) -> None:
    """Run a background response to its end and keep what it made (or why it failed)."""
    stored.response["status"] = "in_progress"
    try:
        answer = await chat_completions(chat, _Detached(request))  # type: ignore[arg-type]
        final = finished(body, head, answer)
    except asyncio.CancelledError:
        stored.response["status"] = "cancelled"
        stored.task = None
        store.put(head["id"], stored)
        raise
    except ApiError as e:
        final = response(body, head, [], None, None, status="failed")
        final["error"] = {"code": e.kind, "message": e.message}
    except Exception as e:  # the engine's own failure: the response says so
        log.exception("background response %s failed", head["id"])
        final = response(body, head, [], None, None, status="failed")
        final["error"] = {"code": "server_error", "message": f"{type(e).__name__}: {e}"}
    done = Stored(final, stored.history + carried(final["output"]), stored.inputs)
    if not store.put(head["id"], done):  # too large for the store: say so rather than vanish
        final = response(body, head, [], None, None, status="failed")
        final["error"] = {"code": "server_error", "message": "the response is larger than "
                          "--max-stored-response-bytes; it was not kept"}  # fmt: skip
        store.put(head["id"], Stored(final, [], []))


# -- request ----------------------------------------------------------------------------
def chat_request(
    body: ResponsesRequest, items: list[dict[str, Any]], stored: int = 0
) -> ChatCompletionRequest:
    """The chat completion request `body` asks for, its conversation `items` (the first
    `stored` a stored conversation's, then its own input); ApiError(400) naming the field."""
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages(body.instructions, items, stored),
        "parallel_tool_calls": body.parallel_tool_calls,
        "stream": bool(body.stream),
    }
    for ours, theirs in (
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("top_k", body.top_k),
        ("min_p", body.min_p),
        ("repetition_penalty", body.repetition_penalty),
        ("frequency_penalty", body.frequency_penalty),
        ("presence_penalty", body.presence_penalty),
        ("stop", body.stop),
        ("extra_key", body.extra_key),
        ("cache_salt", body.cache_salt),
    ):
        if theirs is not None:
            chat[ours] = theirs
    if body.priority:
        chat["priority"] = body.priority
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [_tool(i, t) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.get("format") is not None:
        chat["response_format"] = _format(body.text["format"])
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ApiError(400, f"{where}: {err['msg']}") from None


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as a list of items (a string is one user message), each with an id."""
    given = body.input
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) \
        else given  # fmt: skip
    out = []
    for item in items:
        kind = item.get("type", "message")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
        out.append({"id": _id(prefix.get(kind, "item")), **item, "type": kind})
    return out


def carried(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the input items a continuation reads: its text and calls
    (reasoning is not carried into the next turn)."""
    return [item for item in output if item["type"] != "reasoning"]


def messages(
    instructions: str | None, items: list[dict[str, Any]], stored: int = 0
) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and the input `items` (the first `stored` from
    a stored conversation, which errors name apart): a function call joins the assistant
    message before it (or starts one), a call's output is a tool message."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i - stored}]" if i >= stored else f"previous_response_id's item {i}"
        if kind == "message":
            out.append({"role": _text_field(item, "role", where), "content": _content(item, where)})
        elif kind == "function_call":
            call = {
                "id": _text_field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _text_field(item, "name", where),
                    "arguments": _text_field(item, "arguments", where),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            given = item.get("output")
            text = given if isinstance(given, str) else json.dumps(given)
            call_id = _text_field(item, "call_id", where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise ApiError(400, f"{where}.type {kind!r}: kiln takes message, function_call and "
                           "function_call_output items")  # fmt: skip
    return out


def _text_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key}: a string is required")
    return value


def _content(item: dict[str, Any], where: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: a string or a list of text parts is required")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}].type {kind!r}: kiln takes text parts")
        texts.append(part["text"])
    return "".join(texts)


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (name, parameters at the top) as a chat tool."""
    if tool.get("type") != "function":
        raise ApiError(400, f"tools[{i}].type {tool.get('type')!r}: kiln serves function tools")
    keys = ("name", "description", "parameters", "strict")
    unknown = sorted(set(tool) - {"type", *keys})
    if unknown:
        raise ApiError(400, f"tools[{i}].{unknown[0]}: unknown field")
    return {"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "tool_choice: 'none', 'auto', 'required' or a function by name")


def _format(fmt: dict[str, Any]) -> dict[str, Any]:
    """text.format as the chat's response_format."""
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ApiError(400, f"text.format.type {kind!r}: one of text, json_object, json_schema")


# -- response ---------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": content,
            "status": status}  # fmt: skip


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, status: str = "completed") -> dict[str, Any]:
    parts = [] if text is None else [text_part(text)]
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": parts}  # fmt: skip


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn.get("arguments", ""), "status": status}  # fmt: skip


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's message as output items: reasoning, text, then each call."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        out.append(message_item(message["content"]))
    out += [call_item(c) for c in message.get("tool_calls") or []]
    return out


def finished(body: ResponsesRequest, head: dict[str, Any], answer: Any) -> dict[str, Any]:
    """The response object of a non-streamed chat completion's answer."""
    data = json.loads(answer.body)
    choice = data["choices"][0]
    output = output_items(choice["message"])
    return response(body, head, output, choice["finish_reason"], usage(data["usage"]))


def usage(chat: dict[str, Any]) -> dict[str, Any]:
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def response(
    body: ResponsesRequest,
    head: dict[str, Any],
    output: list[dict[str, Any]],
    finish_reason: str | None,
    used: dict[str, Any] | None,
    status: str | None = None,
) -> dict[str, Any]:
    """The response object; `finish_reason` None while it is in progress (or `status`)."""
    if status is None:
        status = {None: "in_progress", "length": "incomplete"}.get(finish_reason, "completed")
    return {
        **head,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [],
        "text": body.text or {"format": {"type": "text"}},
        "truncation": "disabled",
        "store": body.store,
        "background": body.background,
        "previous_response_id": body.previous_response_id,
        "usage": used,
    }


class ResponseEvents:
    """A streamed chat completion's chunks as Responses events: each output item opened
    when its first delta comes (reasoning, the message's text, each call) and closed when
    the next begins or the stream ends, then `response.completed` (`incomplete` when it
    ran out of tokens) with the whole response."""

    def __init__(
        self,
        body: ResponsesRequest,
        head: dict[str, Any],
        keep: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """`keep`: given the final response once the stream has ended (the store)."""
        self.body, self.head, self.keep = body, head, keep
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item its deltas go to
        self.calls: dict[int, dict[str, Any]] = {}  # chat call index -> item

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def translate(self, chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
        state = response(self.body, self.head, [], None, None)
        yield self.event("response.created", response=state)
        yield self.event("response.in_progress", response=state)
        finish, used = None, None
        async for raw in chunks:
            text = raw if isinstance(raw, str) else raw.decode()
            for line in text.splitlines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the chat stream failed part way
                    yield self.event("error", code=str(chunk["error"].get("code")),
                                     message=chunk["error"].get("message"), param=None)  # fmt: skip
                    return
                if chunk.get("usage"):
                    used = usage(chunk["usage"])
                for choice in chunk.get("choices", []):
                    for event in self.delta(choice.get("delta") or {}):
                        yield event
                    finish = choice.get("finish_reason") or finish
        for event in self.close():
            yield event
        state = response(self.body, self.head, self.output, finish or "stop", used)
        if self.keep is not None:
            self.keep(state)
        kind = "response.incomplete" if state["status"] == "incomplete" else "response.completed"
        yield self.event(kind, response=state)

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self.begin("reasoning")
            assert self.open is not None
            self.open["content"][0]["text"] += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", **self.where(),
                                  delta=delta["reasoning_content"]))  # fmt: skip
        if delta.get("content"):
            out += self.begin("message")
            assert self.open is not None
            self.open["content"][0]["text"] += delta["content"]
            out.append(self.event("response.output_text.delta", **self.where(),
                                  delta=delta["content"], logprobs=[]))  # fmt: skip
        for tc in delta.get("tool_calls") or []:
            if tc["index"] not in self.calls:  # a call's head: id and name
                out += self.close()
                item = call_item({**tc, "function": {**tc["function"], "arguments": ""}},
                                 "in_progress")  # fmt: skip
                self.calls[tc["index"]] = self.open = item
                self.output.append(item)
                out.append(self.event("response.output_item.added",
                                      output_index=len(self.output) - 1, item=item))  # fmt: skip
            args = tc.get("function", {}).get("arguments", "")
            if args:
                item = self.calls[tc["index"]]
                item["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self.output.index(item),
                                      delta=args))  # fmt: skip
        return out

    def where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1,
                "content_index": 0}  # fmt: skip

    def begin(self, kind: str) -> list[str]:
        """Open an item of `kind` for the deltas that follow, closing another first."""
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self.close()
        make = reasoning_item if kind == "reasoning" else message_item
        item = self.open = make("", "in_progress")
        self.output.append(item)
        out.append(self.event("response.output_item.added",
                              output_index=len(self.output) - 1, item=item))  # fmt: skip
        part = item["content"][0]
        out.append(self.event("response.content_part.added", **self.where(), part=part))
        return out

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=item["arguments"]))  # fmt: skip
        else:
            part = item["content"][0]
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = ("response.reasoning_text.done" if item["type"] == "reasoning"
                    else "response.output_text.done")  # fmt: skip
            extra: dict[str, Any] = {} if item["type"] == "reasoning" else {"logprobs": []}
            out.append(self.event(done, **at, text=part["text"], **extra))
            out.append(self.event("response.content_part.done", **at, part=part))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

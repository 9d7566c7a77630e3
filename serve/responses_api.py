"""OpenAI's Responses API (`POST /v1/responses`), served as the chat completion it asks
for: `instructions` and `input` (a string, or message, `function_call` and
`function_call_output` items) become the messages, `tools` (Responses' flat function
tools), `tool_choice`, `text.format` and the sampling fields become the chat request's,
and the chat completion's message (reasoning, text, tool calls; serve/chat_output.py)
becomes the response's output items. Streamed, the chat deltas become Responses' typed
events (`response.created`, `response.output_text.delta`, ... `response.completed`).

kiln keeps no responses: `store` is accepted and nothing is kept to fetch or continue, so
`previous_response_id`, `conversation` and `background` are refused (a 400 naming them),
as are inputs other than text.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from kiln.serve.openai_api import _ctx, chat_completions
from kiln.serve.protocol import ChatCompletionRequest, ResponsesRequest
from kiln.serve.streams import ApiError

router = APIRouter()

TEXT_PARTS = ("input_text", "output_text", "text")


@router.post("/v1/responses", response_model=None)
async def responses(body: ResponsesRequest, request: Request) -> Any:
    ctx = _ctx(request)
    ctx.refuse_unsupported(body.unsupported())
    chat = chat_request(body)
    head = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": ctx.model_name,
    }
    answer = await chat_completions(chat, request)
    if not body.stream:
        data = json.loads(answer.body)
        choice = data["choices"][0]
        output = output_items(choice["message"])
        return response(body, head, output, choice["finish_reason"], usage(data["usage"]))
    return StreamingResponse(
        ResponseEvents(body, head).translate(answer.body_iterator),
        media_type="text/event-stream",
    )


# -- request ----------------------------------------------------------------------------
def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request `body` asks for; ApiError(400) naming the field."""
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "stream": body.stream,
    }
    for ours, theirs in (
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
    ):
        if theirs is not None:
            chat[ours] = theirs
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


def messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and `input`: a function call joins the
    assistant message before it (or starts one), a call's output is a tool message."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
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
) -> dict[str, Any]:
    """The response object; `finish_reason` None while it is in progress."""
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
        "store": False,
        "usage": used,
    }


class ResponseEvents:
    """A streamed chat completion's chunks as Responses events: each output item opened
    when its first delta comes (reasoning, the message's text, each call) and closed when
    the next begins or the stream ends, then `response.completed` (`incomplete` when it
    ran out of tokens) with the whole response."""

    def __init__(self, body: ResponsesRequest, head: dict[str, Any]) -> None:
        self.body, self.head = body, head
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

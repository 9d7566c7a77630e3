"""What a chat completion's output becomes: reasoning (serve/reasoning.py), content and
tool calls (serve/tool_calls.py), as OpenAI deltas while it streams and as one message
when it does not. A non-streamed message is the stream's deltas joined, so the two agree.

`plan_chat` reads the request's `tools`, `tool_choice`, `parallel_tool_calls`,
`separate_reasoning` and `stream_reasoning` against the server's `--tool-call-parser` and
`--reasoning-parser`: what the template gets, the constraint that forces calls, and how
the output is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.serve.protocol import ChatCompletionRequest
from kiln.serve.reasoning import PARSERS as REASONING_PARSERS
from kiln.serve.reasoning import REASONING, ReasoningFormat, splitter
from kiln.serve.streams import ApiError
from kiln.serve.tool_calls import (
    FORCED,
    FORMATS,
    ToolFormat,
    ToolStream,
    forced_schema,
    openai_call,
)


@dataclass(frozen=True)
class ChatPlan:
    tools: list[dict[str, Any]] | None = None  # for the chat template
    tool_format: ToolFormat | None = None  # how calls are read back
    # each tool's name to its parameters' JSON schema (what calls are checked against)
    schemas: dict[str, Any] = field(default_factory=dict)
    first_only: bool = False  # parallel_tool_calls: false
    reasoning: ReasoningFormat | None = None
    stream_reasoning: bool = True
    sampling: dict[str, Any] = field(default_factory=dict)  # added to the sampling params

    @property
    def forces_calls(self) -> bool:
        return self.tool_format is FORCED

    def stream(self, prompt: str) -> ChatStream:
        return ChatStream(self, prompt)

    def message(self, prompt: str, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a whole output, and whether it holds tool calls."""
        s = self.stream(prompt)
        deltas = s.feed(text) + s.finish()
        message: dict[str, Any] = {"role": "assistant", "content": None}
        content = "".join(d.get("content", "") for d in deltas)
        calls: dict[int, dict[str, Any]] = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                call = calls.setdefault(
                    tc["index"], {"id": tc.get("id"), "type": "function", "function": {}}
                )
                fn = call["function"]
                for key, value in tc.get("function", {}).items():
                    fn[key] = fn.get(key, "") + value
        if self.reasoning is not None:
            reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        message["content"] = content if content or not calls else None
        return message, bool(calls)


class ChatStream:
    """One choice's output as OpenAI deltas: `feed` each new piece of text, `finish` once."""

    def __init__(self, plan: ChatPlan, prompt: str) -> None:
        self.plan = plan
        self.split = splitter(plan.reasoning, prompt) if plan.reasoning else None
        fmt = plan.tool_format
        self.tools = ToolStream(fmt, plan.schemas, plan.first_only) if fmt else None
        self.has_calls = False
        self._reasoning = ""  # held while stream_reasoning is off

    def feed(self, text: str) -> list[dict[str, Any]]:
        pieces = self.split.feed(text) if self.split else [("content", text)]
        return self._deltas(pieces)

    def finish(self) -> list[dict[str, Any]]:
        out = self._deltas(self.split.finish() if self.split else [])
        if self.tools is not None:
            rest, calls = self.tools.finish()
            out += self._content(rest)
            for i, call in enumerate(calls):
                c = openai_call(call)
                args = c["function"]["arguments"]
                head = {**c, "index": i, "function": {"name": c["function"]["name"]}}
                head["function"]["arguments"] = ""
                out.append({"tool_calls": [head]})
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args}}]})
            self.has_calls = bool(calls)
        return self._held() + out

    def _deltas(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in pieces:
            if kind == REASONING:
                if self.plan.stream_reasoning:
                    out.append({"reasoning_content": text})
                else:
                    self._reasoning += text
            else:
                answer = self.tools.feed(text) if self.tools is not None else text
                out += self._content(answer)
        return out

    def _content(self, text: str) -> list[dict[str, Any]]:
        return [*self._held(), {"content": text}] if text else []

    def _held(self) -> list[dict[str, Any]]:
        """Reasoning held back (stream_reasoning: false), in one delta before the answer."""
        if not self._reasoning:
            return []
        out, self._reasoning = [{"reasoning_content": self._reasoning}], ""
        return out


def plan_chat(
    body: ChatCompletionRequest, tool_call_parser: str | None, reasoning_parser: str | None
) -> ChatPlan:
    """How this request's tools and reasoning are served; ApiError(400) naming the field."""
    reasoning = None
    if reasoning_parser is not None and body.separate_reasoning:
        reasoning = REASONING_PARSERS[reasoning_parser]
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools or []]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    # harmony's channel markers are special tokens: kept in the text the parser reads
    keep = {"skip_special_tokens": False} if reasoning is not None and reasoning.harmony else {}
    base = ChatPlan(reasoning=reasoning, stream_reasoning=body.stream_reasoning, sampling=keep)
    if choice == "none" or not tools:
        return base
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    first_only = not body.parallel_tool_calls
    if choice == "auto":
        if tool_call_parser is None:
            raise ApiError(
                400,
                "tools: this server reads no tool calls (start it with --tool-call-parser, "
                f"one of {', '.join(sorted(FORMATS))}), or give tool_choice 'required' "
                "or a function",
            )
        fmt = FORMATS[tool_call_parser]
        sampling: dict[str, Any] = dict(base.sampling)
        if fmt.special_markers:
            sampling["skip_special_tokens"] = False
        return replace(
            base,
            tools=tools,
            tool_format=fmt,
            schemas=schemas,
            first_only=first_only,
            sampling=sampling,
        )
    given = body.constraint()
    if given:
        raise ApiError(
            400, f"tool_choice {_show(choice)} and {', '.join(given)}: give one constraint"
        )
    chosen = tools
    if choice != "required":
        name = choice.function.name
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ApiError(400, f"tool_choice.function.name: {name!r} is not one of the tools")
    schema = forced_schema(chosen, at_most_one=first_only or choice != "required")
    return replace(
        base,
        tools=tools,
        tool_format=FORCED,
        schemas=schemas,
        first_only=first_only,
        sampling={**base.sampling, "json_schema": json.dumps(schema)},
    )


def _show(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else "function"

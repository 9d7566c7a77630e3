"""Tool calls: what the model writes, read back as OpenAI `tool_calls` (`--tool-call-parser`,
SGLang's names), and the grammar that makes `tool_choice: "required"` or a named function
always give a valid call.

Formats (each a parser of the text from where its calls begin):

- `qwen25` (and `qwen`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
- `llama3`: `<|python_tag|>` or a first `{`, then `{"name": ..., "parameters": {...}}`
  objects separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`;
- `pythonic`: a first `[`, then Python calls with keyword arguments,
  `[get_weather(city="Paris"), ...]`, read with `ast` (literals only; nothing is run).

With `tool_choice` `required` or a named function the output is instead constrained by a
JSON schema to a list of `{"name": ..., "parameters": {...}}` whose names and parameters
are the tools' own, as SGLang does; that needs no parser.

Text that looks like calls but does not parse as calls of the request's tools stays
content: nothing the model wrote is lost.
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.serve.streams import held_back

Call = tuple[str, dict[str, Any]]  # (function name, arguments)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str | None  # where calls begin, anywhere in the text
    opener: str | None  # where calls begin when the text starts with it (after spaces)
    parse: Callable[[str], list[Call]]  # the calls in the text from there; ValueError if none
    special_markers: bool = False  # the marker is a special token: keep special tokens


_JSON = json.JSONDecoder()


def _call(obj: Any, args_keys: Sequence[str] = ("arguments", "parameters")) -> Call:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return obj["name"], args


def _json_values(text: str, sep: str = "") -> list[Any]:
    """The JSON values in `text`, separated by whitespace (and `sep`); nothing else."""
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or (sep and text[at] == sep)):
            at += 1
        if at == len(text):
            return values
        value, at = _JSON.raw_decode(text, at)
        values.append(value)


def _qwen25(text: str) -> list[Call]:
    calls, rest = [], text.strip()
    while rest:
        if not rest.startswith("<tool_call>"):
            raise ValueError("text between calls")
        value, at = _JSON.raw_decode(rest, len("<tool_call>") + _spaces(rest, len("<tool_call>")))
        calls.append(_call(value))
        rest = rest[at:].strip()
        if rest.startswith("</tool_call>"):
            rest = rest[len("</tool_call>") :].strip()
        elif rest:
            raise ValueError("unclosed call")
    return calls


def _spaces(text: str, at: int) -> int:
    return len(text[at:]) - len(text[at:].lstrip())


def _llama3(text: str) -> list[Call]:
    text = text.strip().removeprefix("<|python_tag|>")
    return [_call(v) for v in _json_values(text, sep=";")]


def _mistral(text: str) -> list[Call]:
    values = _json_values(text.strip().removeprefix("[TOOL_CALLS]"))
    items = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return [_call(v) for v in items]


def _pythonic(text: str) -> list[Call]:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError("not Python") from e
    if not isinstance(tree, ast.List):
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call with keyword arguments")
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError("** arguments")
            args[kw.arg] = ast.literal_eval(kw.value)  # literals only: nothing runs
        calls.append((node.func.id, args))
    return calls


def _json_list(text: str) -> list[Call]:
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError("not a list")
    return [_call(v, ("parameters",)) for v in value]


FORMATS = {
    "qwen25": ToolFormat("qwen25", "<tool_call>", None, _qwen25),
    "qwen": ToolFormat("qwen", "<tool_call>", None, _qwen25),
    "llama3": ToolFormat("llama3", "<|python_tag|>", "{", _llama3, special_markers=True),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", None, _mistral, special_markers=True),
    "pythonic": ToolFormat("pythonic", None, "[", _pythonic),
}
# tool_choice "required" or named: the output the schema below forces.
FORCED = ToolFormat("json", None, "[", _json_list)


def forced_schema(tools: Sequence[dict[str, Any]], at_most_one: bool) -> dict[str, Any]:
    """A JSON schema for a list of calls of `tools` (OpenAI tool objects), at least one."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if at_most_one:
        schema["maxItems"] = 1
    return schema


def openai_call(call: Call) -> dict[str, Any]:
    name, args = call
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


class ToolStream:
    """One generation's answer text: content passes through until calls begin, the rest is
    held and read as calls when the generation ends."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str], first_only: bool) -> None:
        self.fmt, self.names, self.first_only = fmt, names, first_only
        self._state = "start" if fmt.opener else "content"
        self._buf = ""

    def feed(self, text: str) -> str:
        """The content that may go out now."""
        self._buf += text
        if self._state == "start":
            head = self._buf.lstrip()
            if not head:
                return ""
            assert self.fmt.opener is not None
            if head.startswith(self.fmt.opener):
                self._state = "calls"
                return ""
            self._state = "content"
        if self._state == "calls":
            return ""
        marker = self.fmt.marker
        if marker is None:
            out, self._buf = self._buf, ""
            return out
        at = self._buf.find(marker)
        if at >= 0:
            out, self._buf, self._state = self._buf[:at], self._buf[at:], "calls"
            return out
        cut = len(self._buf) - held_back(self._buf, marker)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """(the content held back, the calls) once the generation has ended."""
        text, self._buf = self._buf, ""
        if self._state != "calls":
            return text, []
        try:
            calls = self.fmt.parse(text)
        except (ValueError, SyntaxError, TypeError, RecursionError):
            return text, []
        if not calls or any(name not in self.names for name, _ in calls):
            return text, []
        return "", calls[:1] if self.first_only else calls

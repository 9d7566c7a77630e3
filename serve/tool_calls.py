"""Tool calls: what the model writes, read back as OpenAI `tool_calls` (`--tool-call-parser`,
SGLang's names), and the grammar that makes `tool_choice: "required"` or a named function
always give a valid call.

Formats (each a parser of the text from where its calls begin):

- `qwen25` (and `qwen`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
- `llama3`: `<|python_tag|>` or a first `{`, then `{"name": ..., "parameters": {...}}`
  objects separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`;
- `pythonic`: a first `[`, then Python calls with keyword arguments,
  `[get_weather(city="Paris"), ...]`, read with `ast` (literals only; nothing is run);
- `deepseekv3`: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function
  <｜tool▁sep｜>NAME` and the arguments in a json code block, `<｜tool▁call▁end｜>`;
- `deepseekv31`: the same markers, `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>`;
- `kimi_k2`: `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>
  functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`;
- `qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>value</parameter>...
  </function></tool_call>`;
- `glm45` (and `glm`, SGLang's other name for it): `<tool_call>NAME`, then
  `<arg_key>KEY</arg_key><arg_value>value</arg_value>` pairs, `</tool_call>`;
- `step3`: `<｜tool_calls_begin｜>`, then per call `<｜tool_call_begin｜>function<｜tool_sep｜>
  <steptml:invoke name="NAME"><steptml:parameter name="KEY">value</steptml:parameter>...
  </steptml:invoke><｜tool_call_end｜>`, `<｜tool_calls_end｜>`;
- `gpt-oss`: harmony messages to a function, `to=functions.NAME [<|constrain|>json]
  <|message|>{...}<|call|>` (with the gpt-oss reasoning parser, which hands them on so).

qwen3_coder, glm45 and step3 write each argument's value as bare text: it is read as the
tool's JSON schema types it (a string stays the text as written; integer, number, boolean,
object, array and null values are parsed, and stay text when they do not parse as that
type).

With `tool_choice` `required` or a named function the output is instead constrained by a
JSON schema to a list of `{"name": ..., "parameters": {...}}` whose names and parameters
are the tools' own, as SGLang does; that needs no parser.

Text that looks like calls but does not parse as calls of the request's tools stays
content: nothing the model wrote is lost.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.serve.streams import held_back

Call = tuple[str, dict[str, Any]]  # (function name, arguments)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str | None  # where calls begin, anywhere in the text
    opener: str | None  # where calls begin when the text starts with it (after spaces)
    # The calls in the text from there, the tools' parameter schemas by name at hand (for
    # formats whose argument values are bare text); ValueError if none.
    parse: Callable[[str, Mapping[str, Any]], list[Call]]
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


def _qwen25(text: str, tools: Mapping[str, Any]) -> list[Call]:
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


def _llama3(text: str, tools: Mapping[str, Any]) -> list[Call]:
    text = text.strip().removeprefix("<|python_tag|>")
    return [_call(v) for v in _json_values(text, sep=";")]


def _mistral(text: str, tools: Mapping[str, Any]) -> list[Call]:
    values = _json_values(text.strip().removeprefix("[TOOL_CALLS]"))
    items = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return [_call(v) for v in items]


def _pythonic(text: str, tools: Mapping[str, Any]) -> list[Call]:
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


def _json_list(text: str, tools: Mapping[str, Any]) -> list[Call]:
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError("not a list")
    return [_call(v, ("parameters",)) for v in value]


def _between_calls(text: str, end: str = "") -> None:
    """What is left once the calls are taken out: spaces and the section's end only."""
    if text.replace(end, "").strip() if end else text.strip():
        raise ValueError("text between calls")


_DS_CALL = re.compile("<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_BEGIN, _DS_END, _DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁sep｜>"


def _deepseek_calls(text: str) -> list[str]:
    body = text.strip().removeprefix(_DS_BEGIN)
    _between_calls(_DS_CALL.sub("", body), _DS_END)
    return _DS_CALL.findall(body)


def _deepseekv3(text: str, tools: Mapping[str, Any]) -> list[Call]:
    calls = []
    for inner in _deepseek_calls(text):
        kind, sep, rest = inner.partition(_DS_SEP)
        name, newline, block = rest.partition("\n")
        block = block.strip()
        if kind.strip() != "function" or not sep or not newline or not block.startswith("```"):
            raise ValueError("not a deepseekv3 call")
        block = block.removeprefix("```json").removeprefix("```").removesuffix("```")
        calls.append(_call({"name": name.strip(), "arguments": json.loads(block)}))
    return calls


def _deepseekv31(text: str, tools: Mapping[str, Any]) -> list[Call]:
    calls = []
    for inner in _deepseek_calls(text):
        name, sep, args = inner.partition(_DS_SEP)
        if not sep:
            raise ValueError("not a deepseekv31 call")
        calls.append(_call({"name": name.strip(), "arguments": json.loads(args)}))
    return calls


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.\-]+):\d+\s*"
    r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.DOTALL,
)


def _kimi_k2(text: str, tools: Mapping[str, Any]) -> list[Call]:
    body = text.strip().removeprefix("<|tool_calls_section_begin|>")
    _between_calls(_KIMI_CALL.sub("", body), "<|tool_calls_section_end|>")
    return [_call({"name": n, "arguments": json.loads(a)}) for n, a in _KIMI_CALL.findall(body)]


def _typed(value: str, schema: Any) -> Any:
    """A bare-text argument as its JSON schema types it (text where it does not parse)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), None)
    if value.strip() == "null" and kind != "string":
        return None
    try:
        if kind == "string":
            return value
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return int(number) if number.is_integer() and "." not in value else number
        if kind == "boolean":
            return {"true": True, "false": False}[value.strip().lower()]
        parsed = json.loads(value)  # object, array, or a parameter the schema does not type
        if kind in ("object", "array") and not isinstance(parsed, dict | list):
            return value
        return parsed
    except (ValueError, KeyError):
        return value


def _arguments(name: str, pairs: list[tuple[str, str]], tools: Mapping[str, Any]) -> Call:
    props = (tools.get(name) or {}).get("properties") or {}
    return name, {k.strip(): _typed(v, props.get(k.strip())) for k, v in pairs}


_QC_CALL = re.compile(
    r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL
)
_QC_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _tagged_calls(
    text: str,
    tools: Mapping[str, Any],
    call: re.Pattern[str],
    arg: re.Pattern[str],
    section: tuple[str, str] = ("", ""),
) -> list[Call]:
    """Calls each `call` match of (name, body) makes, the body's `arg` matches its
    (key, bare-text value) pairs; nothing else between the calls or in a body (but the
    `section`'s begin and end markers around them)."""
    body = text.strip().removeprefix(section[0])
    _between_calls(call.sub("", body), section[1])
    calls = []
    for name, args in call.findall(body):
        _between_calls(arg.sub("", args))
        calls.append(_arguments(name.strip(), arg.findall(args), tools))
    return calls


def _qwen3_coder(text: str, tools: Mapping[str, Any]) -> list[Call]:
    return _tagged_calls(text, tools, _QC_CALL, _QC_PARAM)


_GLM_CALL = re.compile(r"<tool_call>([^<\n]+)\n?(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm45(text: str, tools: Mapping[str, Any]) -> list[Call]:
    return _tagged_calls(text, tools, _GLM_CALL, _GLM_ARG)


_S3_SECTION = ("<｜tool_calls_begin｜>", "<｜tool_calls_end｜>")
_S3_CALL = re.compile(
    r"<｜tool_call_begin｜>\s*function\s*<｜tool_sep｜>\s*"
    r'<steptml:invoke name="([^"]+)">(.*?)</steptml:invoke>\s*<｜tool_call_end｜>',
    re.DOTALL,
)
_S3_PARAM = re.compile(
    r'<steptml:parameter name="([^"]+)">\s*(.*?)\s*</steptml:parameter>', re.DOTALL
)


def _step3(text: str, tools: Mapping[str, Any]) -> list[Call]:
    return _tagged_calls(text, tools, _S3_CALL, _S3_PARAM, _S3_SECTION)


_OSS_CALL = re.compile(
    r"to=functions\.([\w.\-]+)(?:\s|<\|channel\|>commentary|<\|constrain\|>|json)*"
    r"<\|message\|>(.*?)(?:<\|call\|>|$)",
    re.DOTALL,
)
_OSS_FRAMING = ("<|start|>assistant", "<|channel|>commentary", "<|end|>")


def _gpt_oss(text: str, tools: Mapping[str, Any]) -> list[Call]:
    """Harmony messages to functions (`to=functions.NAME ... <|message|>ARGS<|call|>`), as
    the gpt-oss reasoning parser passes them on, or as the raw output has them."""
    body = text.strip()
    rest = _OSS_CALL.sub("", body)
    for framing in _OSS_FRAMING:
        rest = rest.replace(framing, "")
    _between_calls(rest)
    return [_call({"name": n, "arguments": json.loads(a)}) for n, a in _OSS_CALL.findall(body)]


FORMATS = {
    "qwen25": ToolFormat("qwen25", "<tool_call>", None, _qwen25),
    "qwen": ToolFormat("qwen", "<tool_call>", None, _qwen25),
    "llama3": ToolFormat("llama3", "<|python_tag|>", "{", _llama3, special_markers=True),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", None, _mistral, special_markers=True),
    "pythonic": ToolFormat("pythonic", None, "[", _pythonic),
    "deepseekv3": ToolFormat("deepseekv3", _DS_BEGIN, None, _deepseekv3, special_markers=True),
    "deepseekv31": ToolFormat("deepseekv31", _DS_BEGIN, None, _deepseekv31, special_markers=True),
    "kimi_k2": ToolFormat(
        "kimi_k2", "<|tool_calls_section_begin|>", None, _kimi_k2, special_markers=True
    ),
    "qwen3_coder": ToolFormat("qwen3_coder", "<tool_call>", None, _qwen3_coder),
    "glm45": ToolFormat("glm45", "<tool_call>", None, _glm45, special_markers=True),
    "glm": ToolFormat("glm", "<tool_call>", None, _glm45, special_markers=True),
    "step3": ToolFormat("step3", _S3_SECTION[0], None, _step3, special_markers=True),
    "gpt-oss": ToolFormat("gpt-oss", "to=functions.", None, _gpt_oss, special_markers=True),
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

    def __init__(self, fmt: ToolFormat, tools: Mapping[str, Any], first_only: bool) -> None:
        """`tools`: the request's tools, each name to its parameters' JSON schema."""
        self.fmt, self.tools, self.first_only = fmt, tools, first_only
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
            calls = self.fmt.parse(text, self.tools)
        except (ValueError, SyntaxError, TypeError, RecursionError):
            return text, []
        if not calls or any(name not in self.tools for name, _ in calls):
            return text, []
        return "", calls[:1] if self.first_only else calls

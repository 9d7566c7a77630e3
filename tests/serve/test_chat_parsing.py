"""Reading a chat answer back (issue 25): tool calls in each --tool-call-parser format and
reasoning in each --reasoning-parser format, split the same however the text is streamed;
text that is not calls stays content; a pythonic call is read, never run."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kiln.serve.chat_output import ChatPlan
from kiln.serve.reasoning import PARSERS, splitter
from kiln.serve.tool_calls import FORCED, FORMATS, ToolStream, forced_schema

# The tools' parameter schemas, by name (the XML formats read argument values by them).
NAMES = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    },
    "add": {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array"},
            "c": {"type": ["number", "null"]},
        },
    },
}
WEATHER = ("get_weather", {"city": "Paris", "unit": "°C"})
ADD = ("add", {"a": 1, "b": [2, 3.5], "c": None})
CALLS = {
    "qwen25": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "°C"}}\n</tool_call>\n<tool_call>{"name":"add","arguments":{"a":1,"b":[2,3.5],'
        '"c":null}}</tool_call>',
        "Let me look.\n",
    ),
    "llama3": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}};'
        ' {"name": "add", "parameters": {"a": 1, "b": [2, 3.5], "c": null}}',
        "",
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, '
        '{"name": "add", "arguments": {"a": 1, "b": [2, 3.5], "c": null}}]',
        "",
    ),
    "pythonic": ('[get_weather(city="Paris", unit="°C"), add(a=1, b=[2, 3.5], c=None)]', ""),
    "deepseekv3": (
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris", "unit": "°C"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n"
        '```json\n{"a": 1, "b": [2, 3.5], "c": null}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Sure.",
    ),
    "deepseekv31": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "unit": "°C"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>'
        '{"a": 1, "b": [2, 3.5], "c": null}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "",
    ),
    "kimi_k2": (
        "I will check. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "unit": "°C"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>"
        '{"a": 1, "b": [2, 3.5], "c": null}<|tool_call_end|><|tool_calls_section_end|>',
        "I will check. ",
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\n°C\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n[2, 3.5]\n"
        "</parameter>\n<parameter=c>\nnull\n</parameter>\n</function>\n</tool_call>",
        "",
    ),
    "gpt-oss": (
        'to=functions.get_weather<|message|>{"city": "Paris", "unit": "°C"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
        '{"a": 1, "b": [2, 3.5], "c": null}<|call|>',
        "",
    ),
    "glm45": (
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
        "</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>°C</arg_value>\n</tool_call>"
        "<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key>"
        "<arg_value>[2, 3.5]</arg_value><arg_key>c</arg_key><arg_value>null</arg_value>"
        "</tool_call>",
        "Checking.\n",
    ),
    "step3": (
        "Let me check.<｜tool_calls_begin｜>\n<｜tool_call_begin｜>function<｜tool_sep｜>"
        '<steptml:invoke name="get_weather">\n<steptml:parameter name="city">Paris'
        '</steptml:parameter>\n<steptml:parameter name="unit"> °C </steptml:parameter>\n'
        "</steptml:invoke><｜tool_call_end｜>\n<｜tool_call_begin｜>function<｜tool_sep｜>"
        '<steptml:invoke name="add"><steptml:parameter name="a">1</steptml:parameter>'
        '<steptml:parameter name="b">[2, 3.5]</steptml:parameter><steptml:parameter name="c">'
        "null</steptml:parameter></steptml:invoke><｜tool_call_end｜>\n<｜tool_calls_end｜>",
        "Let me check.",
    ),
}
CALLS["glm"] = CALLS["glm45"]  # SGLang's other name for the format


def read(fmt, text: str, step: int, first_only: bool = False) -> tuple[str, list]:
    stream = ToolStream(fmt, NAMES, first_only)
    content = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
    rest, calls = stream.finish()
    return content + rest, calls


@pytest.mark.parametrize("parser", sorted(CALLS))
@pytest.mark.parametrize("step", [1, 2, 7, 10_000])
def test_each_format_gives_its_calls_however_streamed(parser: str, step: int) -> None:
    text, before = CALLS[parser]
    assert read(FORMATS[parser], text, step) == (before, [WEATHER, ADD])
    assert read(FORMATS[parser], text, step, first_only=True) == (before, [WEATHER])


@pytest.mark.parametrize(
    "parser, text",
    [
        ("qwen25", 'a <tool_call>{"name": "get_weather", "arguments": {"city": '),  # cut short
        ("qwen25", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # not a tool
        ("qwen25", '<tool_call>{"name": "add"}</tool_call> and then some prose'),
        ("llama3", '{"name": "add", "parameters": [1, 2]}'),  # arguments not an object
        ("llama3", "{not json at all"),
        ("mistral", "[TOOL_CALLS] nothing"),
        ("pythonic", "[__import__('os').system('touch /tmp/pwned')]"),  # read, never run
        ("pythonic", "[add(1, 2)]"),  # positional arguments
        ("pythonic", "[add(a=open('/etc/passwd').read())]"),
        ("pythonic", "[this is prose in brackets]"),
        (
            "deepseekv3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json",
        ),
        ("deepseekv31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add{}<｜tool▁call▁end｜>"),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|>prose<|tool_call_begin|>functions.add:0"
            "<|tool_call_argument_begin|>{}<|tool_call_end|>",
        ),
        ("qwen3_coder", "<tool_call><function=add><parameter=a>1</parameter></function>"),
        ("glm45", "<tool_call>add\n<arg_key>a</arg_key>1</tool_call>"),
        (
            "step3",
            "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>"
            '<steptml:invoke name="add">1<steptml:parameter name="a">1</steptml:parameter>'
            "</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>",
        ),
        (
            "step3",
            "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>"
            '<steptml:invoke name="add"></steptml:invoke><｜tool_call_end｜> and then prose',
        ),
    ],
)
def test_what_is_not_a_call_stays_content(parser: str, text: str) -> None:
    for step in (1, 5, 10_000):
        assert read(FORMATS[parser], text, step) == (text, [])


def test_plain_text_is_content_and_streams_at_once() -> None:
    stream = ToolStream(FORMATS["qwen25"], NAMES, False)
    assert stream.feed("Hello <tool") == "Hello "  # what may begin a marker waits
    assert stream.feed("box> there") == "<toolbox> there"
    assert stream.finish() == ("", [])


def test_forced_calls_match_their_schema() -> None:
    tools = [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "get_weather"}},
    ]
    schema = forced_schema(tools, at_most_one=False)
    good = [{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "rm", "parameters": {}}], [{"name": "add"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, forced_schema(tools, at_most_one=True))
    assert read(FORCED, json.dumps(good), 3) == ("", [("add", {"a": 1}), ("get_weather", {})])


@pytest.mark.parametrize(
    "parser, prompt, text, reasoning, content",
    [
        (
            "qwen3",
            "<|im_start|>assistant\n",
            "<think>\nStep one.\n</think>\n\nParis.",
            "Step one.\n",
            "Paris.",
        ),
        ("qwen3", "", "Paris, no thinking.", "", "Paris, no thinking."),
        ("qwen3", "", "  <thin", "", "<thin"),  # looked like a start; it was not
        ("qwen3", "assistant\n<think>\n", "Forced.</think>Done", "Forced.", "Done"),
        ("qwen3", "", "<think>never closed", "never closed", ""),
        ("deepseek-r1", "<think>\n", "Hmm.</think>\n42", "Hmm.", "42"),
        ("deepseek-r1", "", "<think>Own tag.</think>42", "Own tag.", "42"),
        ("deepseek-r1", "", "All reasoning, cut short", "All reasoning, cut short", ""),
        ("qwen3-thinking", "", "x</think>y", "x", "y"),
        ("deepseek-v3", "<｜Assistant｜><think>", "Think.</think>Answer.", "Think.", "Answer."),
        ("deepseek-v3", "<｜Assistant｜></think>", "Answer at once.", "", "Answer at once."),
        ("glm45", "", "<think>g</think>h", "g", "h"),
        ("step3", "", "all of it</think>then this", "all of it", "then this"),
        ("kimi", "", "◁think▷Ponder.◁/think▷Reply.", "Ponder.", "Reply."),
        ("kimi", "", "<think>not Kimi's marker</think>", "", "<think>not Kimi's marker</think>"),
        (
            "gpt-oss",
            "<|start|>assistant",
            "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Answer.",
            "Think.",
            "Answer.",
        ),
        ("gpt-oss", "", "<|channel|>final<|message|>Direct.<|return|>", "", "Direct."),
        ("gpt-oss", "", "No harmony here.", "", "No harmony here."),
        (
            "gpt-oss",
            "",
            "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary"
            "<|message|>Checking now.<|end|>",
            "a",
            "Checking now.",
        ),
    ],
)
def test_reasoning_splits_the_same_however_streamed(
    parser: str, prompt: str, text: str, reasoning: str, content: str
) -> None:
    for step in (1, 2, 3, 10_000):
        split = splitter(PARSERS[parser], prompt)
        pieces = []
        for i in range(0, len(text), step):
            pieces += split.feed(text[i : i + step])
        pieces += split.finish()
        got = {k: "".join(t for kind, t in pieces if kind == k) for k in ("reasoning", "content")}
        assert got == {"reasoning": reasoning, "content": content}, step


def test_a_message_is_its_stream_joined() -> None:
    """Reasoning, then content, then a call: the non-streamed message and the deltas agree,
    and held reasoning (stream_reasoning: false) comes in one delta before the answer."""
    text = "<think>plan</think>Sure.<tool_call>" + '{"name": "add", "arguments": {"a": 1}}'
    for stream_reasoning in (True, False):
        plan = ChatPlan(
            tool_format=FORMATS["qwen25"],
            schemas=NAMES,
            reasoning=PARSERS["qwen3"],
            stream_reasoning=stream_reasoning,
        )
        message, has_calls = plan.message("", text)
        assert has_calls and message["content"] == "Sure."
        assert message["reasoning_content"] == "plan"
        call = message["tool_calls"][0]
        assert call["function"] == {"name": "add", "arguments": '{"a": 1}'}
        assert call["id"].startswith("call_") and call["type"] == "function"
        stream = plan.stream("")
        deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
        reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
        assert "".join(reasoning) == "plan"
        assert len(reasoning) == (4 if stream_reasoning else 1)
        assert "".join(d.get("content", "") for d in deltas) == "Sure."
        assert deltas[0] == {"reasoning_content": "p" if stream_reasoning else "plan"}


def test_bare_text_arguments_are_read_as_their_schema_types() -> None:
    """qwen3_coder, glm45 and step3 write values as text: a string stays as written (an id of
    digits too), typed values parse, and one that does not parse as its type stays text."""
    tools = {
        "f": {
            "properties": {
                "id": {"type": "string"},
                "n": {"type": "integer"},
                "x": {"type": "number"},
                "on": {"type": "boolean"},
                "opts": {"type": "object"},
            }
        }
    }
    params = {"id": "007", "n": "twelve", "x": "2.5", "on": "True", "opts": '{"k": [1]}'}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    text = f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    stream = ToolStream(FORMATS["qwen3_coder"], tools, False)
    stream.feed(text)
    want = {"id": "007", "n": "twelve", "x": 2.5, "on": True, "opts": {"k": [1]}}
    assert stream.finish() == ("", [("f", want)])


def test_harmony_hands_its_calls_to_the_gpt_oss_tool_parser() -> None:
    """gpt-oss's raw output through the reasoning split and then the tool parser, as a
    chat answer goes: analysis is reasoning, the call to a function becomes the call."""
    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "unit": "°C"}'
    )  # <|call|> is a stop token: the text ends at the arguments
    for step in (1, 3, 10_000):
        split = splitter(PARSERS["gpt-oss"], "<|start|>assistant")
        tools = ToolStream(FORMATS["gpt-oss"], NAMES, False)
        reasoning, content = "", ""
        pieces = []
        for i in range(0, len(text), step):
            pieces += split.feed(text[i : i + step])
        for kind, piece in pieces + split.finish():
            if kind == "reasoning":
                reasoning += piece
            else:
                content += tools.feed(piece)
        rest, calls = tools.finish()
        assert (reasoning, content + rest, calls) == ("Need the weather.", "", [WEATHER]), step


def test_harmony_streams_text_that_is_not_harmony_at_once() -> None:
    """A gpt-oss answer that is no harmony message (a grammar's JSON) is content as it
    comes, not held to the end; a header still waits for its message."""
    split = splitter(PARSERS["gpt-oss"], "")
    assert split.feed('{"a": ') == [("content", '{"a": ')]
    assert split.feed("1}") == [("content", "1}")]
    harmony = splitter(PARSERS["gpt-oss"], "")
    assert harmony.feed("<|chan") == [] and harmony.feed("nel|>final") == []
    assert harmony.feed("<|message|>Hi") == [("content", "Hi")]


def test_harmony_splits_any_run_of_its_markers() -> None:
    """Random runs of harmony's markers and text, fed in random pieces: every call returns
    (no marker sequence makes it loop) and the text comes back the same however it is
    cut."""
    import random

    words = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary",
             " to=functions.add", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
             "<|constrain|>", "x", " ", "{}", "<|"]  # fmt: skip
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        results = []
        for step in (1, rng.randint(2, 9), len(text)):
            split = splitter(PARSERS["gpt-oss"], "")
            pieces = []
            for i in range(0, len(text), step):
                pieces += split.feed(text[i : i + step])
            pieces += split.finish()
            results.append(
                {k: "".join(t for kind, t in pieces if kind == k) for k in ("reasoning", "content")}
            )
        assert results[0] == results[1] == results[2], text

"""Tool calls and reasoning through a real `kiln serve` and the openai client (issue 25):
tools reach the chat template, `required` and a named function always give a valid call,
a call / tool message / answer round trip, auto calls read by --tool-call-parser,
reasoning separated by --reasoning-parser, streamed deltas that join to the non-streamed
answer, and a 400 naming the field for what cannot be served."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_helpers import API_KEY

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The example template, plus what tool-aware templates render (briefly: the tiny model's
# context is 256 tokens): the tools' names and parameters, earlier calls and the call a
# tool message answers.
TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }}"
    "({{ t.function.parameters.properties | list | join(',') }}){% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def server(artefact, launch, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    return launch(
        artefact("llama"),
        "--api-key",
        API_KEY,
        "--constrained-json-disable-any-whitespace",
        "--tool-call-parser",
        "qwen25",
        "--reasoning-parser",
        "qwen3",
        "--chat-template",
        str(template),
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), **kw)


def test_tools_reach_the_template_unless_tool_choice_is_none(client) -> None:
    def prompt_tokens(**kw) -> int:
        return chat(client, max_tokens=1, **kw).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    assert prompt_tokens(tools=TOOLS, tool_choice="required") > plain + 20


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_always_give_a_valid_call(client, choice) -> None:
    """The tiny random model has no idea of tools: the grammar alone makes every output a
    call of a given tool with arguments that validate, at any temperature."""
    for temperature in (0.0, 1.0, 1.5):
        for seed in range(3):
            reply = chat(
                client,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                temperature=temperature,
                seed=seed,
                max_tokens=60,
            )
            out = reply.choices[0]
            assert out.finish_reason == "tool_calls", out
            assert out.message.content is None and len(out.message.tool_calls) == 1
            call = out.message.tool_calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            if isinstance(choice, dict):
                assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_tool_round_trip(client) -> None:
    """Call, the tool's answer, the model's answer: the history renders (the prompt grows
    by the call and the tool message) and the answer is text."""
    first = chat(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    out = answer.choices[0]
    assert out.finish_reason in ("stop", "length") and out.message.tool_calls is None
    assert isinstance(out.message.content, str)
    grown = answer.usage.prompt_tokens - first.usage.prompt_tokens
    assert grown >= len(call.function.arguments) // 4, grown  # the call and reply rendered


def joined(stream) -> tuple[dict, str, str | None]:
    """A chat stream's deltas joined: the message, its finish reason, its reasoning."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = c["id"] or tc.id
                c["name"] += (tc.function and tc.function.name) or ""
                c["arguments"] += (tc.function and tc.function.arguments) or ""
            reason = choice.finish_reason or reason
    message = {"content": content or None, "calls": [calls[i] for i in sorted(calls)]}
    return message, reason, reasoning or None


def plain(message) -> dict:
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    return {"content": message.content, "calls": calls}


def test_streamed_calls_join_to_the_non_streamed_answer(client) -> None:
    kw = {
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 60,
        "temperature": 0,
    }
    whole = chat(client, **kw).choices[0]
    message, reason, _ = joined(chat(client, stream=True, **kw))
    assert reason == whole.finish_reason == "tool_calls"
    expected = plain(whole.message)
    for got, want in zip(message["calls"], expected["calls"], strict=True):
        assert got["id"].startswith("call_")
        got["id"] = want["id"]  # each answer names its calls afresh
    assert message == expected


def escaped(text: str) -> str:
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}" else c for c in text)


# What a Qwen model answers, forced out of the tiny one with a regex: reasoning, a word,
# and a call in Qwen 2.5's format, which --reasoning-parser qwen3 and --tool-call-parser
# qwen25 read back.
QWEN_ANSWER = '<think>ok</think>Sure.<tool_call>{"name": "add", "arguments": {"a": 4}}</tool_call>'


def test_auto_calls_and_reasoning_are_read_back(client) -> None:
    kw = {"tools": TOOLS, "max_tokens": 150, "extra_body": {"regex": escaped(QWEN_ANSWER)}}
    out = chat(client, **kw).choices[0]
    assert out.finish_reason == "tool_calls"
    assert out.message.content == "Sure."
    assert out.message.reasoning_content == "ok"
    (call,) = out.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 4})

    message, reason, reasoning = joined(chat(client, stream=True, **kw))
    message["calls"][0]["id"] = call.id
    assert (message, reason, reasoning) == (plain(out.message), "tool_calls", "ok")


def test_separate_and_stream_reasoning_switches(client) -> None:
    kw = {"max_tokens": 30, "extra_body": {"regex": escaped("<think>a b c</think>Paris.")}}
    out = chat(client, **kw).choices[0]
    assert (out.message.reasoning_content, out.message.content) == ("a b c", "Paris.")
    kept = chat(client, **{**kw, "extra_body": {**kw["extra_body"], "separate_reasoning": False}})
    assert kept.choices[0].message.content == "<think>a b c</think>Paris."
    held = {**kw["extra_body"], "stream_reasoning": False}
    chunks = list(chat(client, stream=True, **{**kw, "extra_body": held}))
    pieces = [
        c.choices[0].delta.reasoning_content
        for c in chunks
        if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)
    ]
    assert pieces == ["a b c"]  # one delta, once the reasoning has ended


NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"tool_choice": "required"}, "tool_choice: only allowed with tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
            "tool_choice.function.name: 'rm' is not one of the tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "give one constraint"),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "tools: function 'add' is defined twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "two words"}}]},
            "tools.0.function.name",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": 5}}},
                        },
                    }
                ],
                "tool_choice": NAMED | {"function": {"name": "f"}},
            },
            "tools: does not compile",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
        ({"tools": TOOLS * 65}, "tools"),  # more than OpenAI's 128
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(server, extra, message) -> None:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and message in r.json()["message"], r.text
    assert server.get("/health").status_code == 200


def test_the_parsers_on_their_own_routes(server) -> None:
    """SGLang's /parse_function_call and /separate_reasoning read text as the chat route
    does: the server's parsers by default, another named in the body; text that is not a
    call of the given tools stays text; an unknown parser is a 400 naming it."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    r = server.post("/parse_function_call", json={"text": "Sure. " + call, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "normal_text": "Sure. ",
        "calls": [{"tool_index": 1, "name": "add", "parameters": '{"a": 2}'}],
    }
    stranger = call.replace('"add"', '"rm"')
    r = server.post("/parse_function_call", json={"text": stranger, "tools": TOOLS})
    assert r.json() == {"normal_text": stranger, "calls": []}
    pythonic = {"text": '[get_weather(city="Rome", days=2)]', "tools": TOOLS}
    r = server.post("/parse_function_call", json={**pythonic, "tool_call_parser": "pythonic"})
    assert r.json()["calls"] == [
        {"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Rome", "days": 2}'}
    ]
    # an XML format's bare-text values are read as the body's tool schemas type them
    xml = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    body = {"text": xml, "tools": TOOLS, "tool_call_parser": "qwen3_coder"}
    r = server.post("/parse_function_call", json=body)
    assert r.json()["calls"] == [
        {"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Rome", "days": 2}'}
    ]
    r = server.post("/parse_function_call", json={**pythonic, "tool_call_parser": "nope"})
    assert r.status_code == 400 and "'nope' is not one of" in r.json()["error"]["message"]
    text = "<think>\nAdd them.</think>\n\n4"
    r = server.post("/separate_reasoning", json={"text": text})
    assert r.json() == {"reasoning_text": "Add them.", "text": "4"}
    r = server.post(
        "/separate_reasoning", json={"text": "Add. </think>4", "reasoning_parser": "deepseek-r1"}
    )
    assert r.json() == {"reasoning_text": "Add. ", "text": "4"}
    assert server.post("/separate_reasoning", json={"text": 4}).status_code == 400


# -- /v1/responses: OpenAI's Responses API, served as the chat completion it asks for ------
def test_responses_text_is_the_chat_completions(client) -> None:
    kw = {"max_tokens": 8, "temperature": 0}
    want = chat(client, messages=[{"role": "system", "content": "Be brief."}, *ASK], **kw)
    got = client.responses.create(
        model="tiny",
        instructions="Be brief.",
        input=ASK[0]["content"],
        max_output_tokens=8,
        temperature=0,
    )
    assert got.output_text == want.choices[0].message.content
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.usage.output_tokens == want.usage.completion_tokens
    status = "incomplete" if want.choices[0].finish_reason == "length" else "completed"
    assert got.status == status and got.object == "response" and got.id.startswith("resp_")
    # streamed: the text deltas join to the same text, ending with the whole response
    events = list(
        client.responses.create(
            model="tiny", instructions="Be brief.", input=ASK[0]["content"],
            max_output_tokens=8, temperature=0, stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == got.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_tool_calls_and_their_round_trip(client) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses' flat tools
    got = client.responses.create(
        model="tiny", input=ASK, tools=tools, tool_choice={"type": "function", "name": "add"},
        parallel_tool_calls=False, max_output_tokens=60, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in got.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD)
    events = list(
        client.responses.create(
            model="tiny", input=ASK, tools=tools, tool_choice={"type": "function", "name": "add"},
            parallel_tool_calls=False, max_output_tokens=60, temperature=0, stream=True,
        )
    )  # fmt: skip
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.name, i.arguments) for i in done] == [
        ("function_call", "add", call.arguments)
    ]
    # the call and its output go back as input items: a text answer
    history = [
        *ASK,
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "4"},
    ]  # fmt: skip
    answer = client.responses.create(
        model="tiny", input=history, tools=tools, tool_choice="none", max_output_tokens=6
    )
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage.input_tokens > got.usage.input_tokens  # the call and output rendered


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id: not supported"),
        ({"background": True}, "background: not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].type 'input_image': kiln takes text parts"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type 'web_search'"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type 'reasoning'"),
    ],
)  # fmt: skip
def test_responses_refusals_name_the_field(server, extra, message) -> None:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, **extra}
    r = server.post("/v1/responses", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_response_events_for_reasoning_text_and_calls() -> None:
    """The translation of a chat stream holding all three kinds of output (what the
    parsers above read from a Qwen answer): one item each, in order, closed in turn."""
    from kiln.serve.protocol import ResponsesRequest
    from kiln.serve.responses_api import ResponseEvents

    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": ""}}  # fmt: skip
    deltas = [
        {"reasoning_content": "o"}, {"reasoning_content": "k"}, {"content": "Sure."},
        {"tool_calls": [call]}, {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": " 4}"}}]},
    ]  # fmt: skip
    chunks = [f"data: {json.dumps({'choices': [{'delta': d}]})}\n\n" for d in deltas]
    chunks.append(
        f"data: {json.dumps({'choices': [{'delta': {}, 'finish_reason': 'tool_calls'}]})}\n\n"
    )
    chunks.append("data: [DONE]\n\n")

    async def source():
        for c in chunks:
            yield c

    async def run() -> list[dict]:
        stream = ResponseEvents(ResponsesRequest(input="x"), {"id": "resp_1"})
        return [json.loads(e.split("data: ", 1)[1]) async for e in stream.translate(source())]

    import asyncio

    events = asyncio.run(run())
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "ok"
    assert final["output"][1]["content"][0]["text"] == "Sure."
    assert (
        final["output"][2]["arguments"] == '{"a": 4}' and final["output"][2]["call_id"] == "call_1"
    )
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["reasoning", "message", "function_call"]
    assert all(i["status"] == "completed" for i in final["output"])

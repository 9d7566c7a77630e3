"""Tool calls and reasoning through a real `kiln serve` and the openai client (issue 25):
tools reach the chat template, `required` and a named function always give a valid call,
a call / tool message / answer round trip, auto calls read by --tool-call-parser,
reasoning separated by --reasoning-parser, streamed deltas that join to the non-streamed
answer, and a 400 naming the field for what cannot be served."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from serve_helpers import ADMIN_KEY, API_KEY

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
        "--admin-api-key",
        ADMIN_KEY,
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
    # greedy: sampled unseeded, the random model's arguments now and then ran past 60 tokens
    # (finish_reason "length", no call to answer), one run in a few full CI runs
    first = chat(
        client,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
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
    # SGLang's sampling extensions reach the chat request: top_k 1 is greedy at any
    # temperature
    one = client.responses.create(
        model="tiny", instructions="Be brief.", input=ASK[0]["content"], max_output_tokens=8,
        temperature=1.5, extra_body={"top_k": 1, "repetition_penalty": 1.0},
    )  # fmt: skip
    assert one.output_text == got.output_text


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
        model="tiny", input=history, tools=tools, tool_choice="none", max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    kinds = [item.type for item in answer.output]
    # a message; none when the tiny random model's greedy answer is an end token at once,
    # as it is for about a third of the server's random call ids (the template renders
    # the id): an empty message is left out
    assert kinds == ["message"] or (kinds == [] and answer.status == "completed"), kinds
    assert answer.usage.input_tokens > got.usage.input_tokens  # the call and output rendered
    # the same turn as a continuation of the stored response: only the call's output sent
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": "4"}]
    continued = client.responses.create(
        model="tiny", previous_response_id=got.id, input=output, tools=tools,
        tool_choice="none", max_output_tokens=6, temperature=0,
    )  # fmt: skip
    assert continued.usage.input_tokens == answer.usage.input_tokens
    assert continued.output_text == answer.output_text
    # the streamed response was kept too, as its last event showed it
    streamed = events[-1].response
    assert client.responses.retrieve(streamed.id).output[0].arguments == call.arguments


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"conversation": "conv_1"}, "conversation: not supported"),
        ({"previous_response_id": "r1"}, "previous_response_id: 'r1' is not a response id"),
        ({"background": True, "stream": True}, "background: kiln does not stream"),
        ({"background": True, "store": False}, "background: needs store"),
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


def test_a_stored_response_is_continued_fetched_listed_and_deleted(client, server) -> None:
    """store (the default): GET returns the response; previous_response_id puts its
    conversation (input and output, not its instructions) before the new input, as the
    chat the same messages make; input_items lists a response's own input; DELETE and
    store=False leave nothing to fetch."""
    first = client.responses.create(
        model="tiny", instructions="Be brief.", input=ASK[0]["content"], max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert first.store is True
    fetched = client.responses.retrieve(first.id)
    assert fetched.output_text == first.output_text and fetched.status == first.status
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, input="And Rome?", max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    said = [*ASK, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And Rome?"}]  # fmt: skip
    want = chat(client, messages=said, max_tokens=4, temperature=0)
    assert second.usage.input_tokens == want.usage.prompt_tokens
    assert second.output_text == want.choices[0].message.content
    assert second.previous_response_id == first.id
    items = client.responses.input_items.list(second.id).data
    assert [(i.type, i.role, i.content) for i in items] == [("message", "user", "And Rome?")]
    # three turns: the third sees both before it, and after the first is deleted too
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=f"no stored response {first.id}"):
        client.responses.retrieve(first.id)
    third = client.responses.create(
        model="tiny", previous_response_id=second.id, input="Thanks.", max_output_tokens=2,
        temperature=0,
    )  # fmt: skip
    said += [{"role": "assistant", "content": second.output_text},
             {"role": "user", "content": "Thanks."}]  # fmt: skip
    assert third.usage.input_tokens == chat(client, messages=said, max_tokens=2).usage.prompt_tokens
    unkept = client.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=False)
    assert unkept.store is False
    r = server.get(f"/v1/responses/{unkept.id}")
    assert r.status_code == 404 and "no stored response" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="previous_response_id: no stored response"):
        client.responses.create(model="tiny", input="Hi", previous_response_id=unkept.id)
    # listing: ids kept across pages, newest first unless asked
    many = client.responses.create(
        model="tiny", input=[{"role": "user", "content": f"{n}"} for n in range(3)],
        max_output_tokens=1,
    )  # fmt: skip
    page = client.responses.input_items.list(many.id, limit=2, order="asc")
    assert [i.content for i in page.data] == ["0", "1"] and page.has_more
    rest = client.responses.input_items.list(many.id, after=page.data[-1].id, order="asc")
    assert [i.content for i in rest.data] == ["2"] and not rest.has_more
    newest = client.responses.input_items.list(many.id).data
    assert [i.content for i in newest] == ["2", "1", "0"]
    assert server.get(f"/v1/responses/{many.id}?stream=true").status_code == 400


def test_a_background_response_is_polled_and_cancelled(client, server) -> None:
    """background: answered at once (queued), run on, polled with GET; cancelled while
    generation is paused, its request leaves the engine (nothing left to run)."""
    kw = {"model": "tiny", "input": ASK[0]["content"], "max_output_tokens": 6, "temperature": 0}
    want = client.responses.create(**kw)
    queued = client.responses.create(**kw, background=True)
    assert queued.status == "queued" and queued.background is True
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, got
        time.sleep(0.02)
    assert got.status == want.status and got.output_text == want.output_text
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        client.responses.cancel(want.id)
    assert client.responses.cancel(queued.id).status == want.status  # over: as it was
    pause = server.post("/pause_generation", key=ADMIN_KEY, json={"mode": "in_place"})
    assert pause.status_code == 200, pause.text
    try:
        held = client.responses.create(**kw, background=True)
        deadline = time.monotonic() + 60
        while server.get("/get_load").json()[0]["num_reqs"] == 0:  # on its way to the engine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert client.responses.retrieve(held.id).status == "in_progress"
        assert client.responses.cancel(held.id).status == "cancelled"
        assert client.responses.retrieve(held.id).status == "cancelled"
        deadline = time.monotonic() + 30
        while server.get("/get_load").json()[0]["num_reqs"] != 0:  # aborted, though paused
            assert time.monotonic() < deadline, "the cancelled response's request still runs"
            time.sleep(0.01)
    finally:
        server.post("/continue_generation", key=ADMIN_KEY, json={})
    assert client.responses.retrieve(held.id).output == []


def test_the_store_drops_the_least_recently_used_finished_responses() -> None:
    from kiln.serve.response_store import ResponseStore, Stored

    def made(status: str, text: str = "") -> Stored:
        return Stored({"status": status, "text": text}, [], [])

    size = made("completed").measure()
    store = ResponseStore(budget=3 * size)
    for rid in ("a", "b", "c"):
        assert store.put(rid, made("completed"))
    assert store.get("a") is not None  # a used: b is now the oldest
    assert store.put("d", made("completed"))
    assert store.get("b") is None and len(store) == 3 and store.used <= store.budget
    assert store.put("e", made("in_progress"))  # a running one is kept whatever it costs
    assert store.put("f", made("completed")) and store.put("g", made("completed"))
    assert store.get("e") is not None and store.used <= store.budget + 1
    assert not store.put("big", made("completed", "x" * 4 * size))  # larger than it all
    assert store.get("big") is None
    assert store.delete("g") is not None and store.delete("g") is None


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


def test_a_server_that_keeps_no_responses_nor_sessions(artefact, launch) -> None:
    """--max-stored-response-bytes 0: responses are answered and say store false; nothing
    can be fetched or continued (404 naming the flag) and background is a 400.
    --max-session-tokens 0: no session opens (400 naming the flag)."""
    server = launch(
        artefact("llama"),
        "--max-stored-response-bytes",
        "0",
        "--max-session-tokens",
        "0",
        "--skip-server-warmup",
    )
    r = server.post("/open_session", key=None, json={"capacity_of_str_len": 10})
    assert r.status_code == 400 and "--max-session-tokens 0" in r.json()["message"]
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2}
    r = server.post("/v1/responses", key=None, json=body)
    assert r.status_code == 200 and r.json()["store"] is False, r.text
    r = server.get(f"/v1/responses/{r.json()['id']}", key=None)
    assert r.status_code == 404 and "--max-stored-response-bytes 0" in r.json()["message"]
    r = server.post("/v1/responses", key=None, json={**body, "previous_response_id": "resp_x"})
    assert r.status_code == 404 and "--max-stored-response-bytes 0" in r.json()["message"]
    r = server.post("/v1/responses", key=None, json={**body, "background": True})
    assert r.status_code == 400 and "background: needs store" in r.json()["message"]

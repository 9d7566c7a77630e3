"""Grammar-constrained decoding (issue 25): OpenAI's response_format and SGLang's json_schema,
regex, ebnf through a real `kiln serve` and the openai client; what does not compile is a
400; a grammar that takes seconds to compile stalls nobody else; the same constraints
through --grammar-backend llguidance, with its whitespace pattern."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# A schema whose every output is short (bounded numbers, enums, short strings): the tiny
# random model must close it within a few dozen tokens, whatever it prefers.
SMALL = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "code": {"type": "string", "pattern": "^[a-z]{2,4}$"},
    },
    "required": ["n", "ok", "tag", "code"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def server(artefact, launch):
    # Compact JSON: the tiny random model would otherwise fill its tokens with the
    # whitespace JSON allows between items (the real model's test below keeps it).
    return launch(
        artefact("llama"),
        "--api-key",
        API_KEY,
        "--max-total-tokens",
        "8192",
        "--constrained-json-disable-any-whitespace",
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_json_schema_outputs_always_validate(client, temperature: float) -> None:
    for seed in range(6):
        reply = client.chat.completions.create(
            model="default",
            messages=CHAT,
            max_tokens=96,
            temperature=temperature,
            seed=seed,
            response_format=response_format(SMALL),
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SMALL)


def test_constrained_and_plain_requests_share_batches(server) -> None:
    """Constrained requests anywhere in a batch (not only its first rows), among plain
    ones: each gets its own mask, the plain ones none, and every answer is right."""
    plain = {"model": "default", "messages": CHAT, "max_tokens": 24, "temperature": 0}
    constrained = {**plain, "max_tokens": 96, "response_format": response_format(SMALL)}
    bodies = [plain, constrained, plain, constrained, constrained, plain]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))

    replies = asyncio.run(run())
    alone = server.post("/v1/chat/completions", json=plain).json()
    for body, r in zip(bodies, replies, strict=True):
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]["content"]
        if body is constrained:
            jsonschema.validate(json.loads(message), SMALL)
        else:  # greedy, as if it ran alone: no other row's mask reached it
            assert message == alone["choices"][0]["message"]["content"]


def test_json_object_gives_an_object(client) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    # json_object: any JSON object. A schema the same call cannot give (it is one field of
    # response_format), so the tiny model's object is only checked to be one.
    reply = client.chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = reply.choices[0].message.content or ""
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    bounded = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=50, extra_body={"json_schema": schema}
    )
    assert json.loads(bounded.choices[0].message.content) in ({"a": 1}, {"a": 2})


def test_regex_and_ebnf_outputs_match(server, client) -> None:
    pattern = r"(yes|no)-[0-9]{3}"
    for seed in range(5):
        out = client.completions.create(
            model="default",
            prompt="Answer:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"regex": pattern},
        )
        assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text
    ebnf = 'root ::= "item" ("," "item")* "."'
    r = server.post(
        "/generate",
        json={"text": "List:", "sampling_params": {"max_new_tokens": 40, "ebnf": ebnf}},
    )
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert re.fullmatch(r"item(,item)*\.", text), text
    assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"


def test_streamed_deltas_join_to_the_non_streamed_answer(client) -> None:
    args = {
        "model": "default",
        "messages": CHAT,
        "max_tokens": 96,
        "temperature": 0.9,
        "seed": 7,
        "response_format": response_format(SMALL),
    }
    whole = client.chat.completions.create(**args).choices[0].message.content
    parts = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**args, stream=True)
        if c.choices
    ]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), SMALL)


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/generate", {"text": "x", "sampling_params": {"regex": "(a"}}, "regex: does not"),
        (
            "/generate",
            {"text": "x", "sampling_params": {"json_schema": "{nope"}},
            "json_schema: does not compile",
        ),
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= ("}}, "ebnf: does not"),
        (
            "/generate",
            {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            "regex, ebnf: give at most one constraint",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "json_schema"}},
            "response_format.json_schema.schema: a JSON schema is required",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "json_object"}, "regex": "a"},
            "response_format json_object and regex: give one constraint",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "json_schema": {"type": "object", "minProperties": "two"}},
            "json_schema: does not compile",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structural_tag": 5},
            "structural_tag.str: Input should be a valid string",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_400(server, path, body, message) -> None:
    r = server.post(path, json=body)
    assert r.status_code == 400 and message in r.json()["message"], r.text


def test_a_slow_grammar_stalls_neither_health_nor_other_requests(server) -> None:
    """A schema of 1000 patterned fields takes seconds to compile (4 s on a Zen 3 core;
    2000 took 40): meanwhile /health stays fast and an unconstrained request runs to its
    end."""
    props = {f"f{i}": {"type": "string", "pattern": "[a-z]{1,8}[0-9]{2,5}"} for i in range(1000)}
    slow = {"type": "object", "properties": props}
    plain = {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}

    async def run() -> tuple[list[float], float, float, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            start = time.monotonic()
            constrained = asyncio.ensure_future(
                c.post(
                    "/generate",
                    json={
                        "text": "x",
                        "sampling_params": {"max_new_tokens": 2, "json_schema": slow},
                    },
                )
            )
            await asyncio.sleep(0.2)  # the compile has started
            other = await c.post("/generate", json=plain)
            other_done = time.monotonic() - start
            waits = []
            while not constrained.done():
                t0 = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                waits.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
            reply = await constrained
            assert other.status_code == 200
            return waits, other_done, time.monotonic() - start, reply

    waits, other_done, slow_done, reply = asyncio.run(run())
    assert reply.status_code == 200, reply.text
    assert other_done < slow_done / 2, (other_done, slow_done)  # it did not wait its turn
    assert len(waits) >= 5 and max(waits) < 0.5, waits


def test_grammar_backend_none_refuses_constraints(artefact, launch) -> None:
    server = launch(artefact("llama"), "--grammar-backend", "none", "--skip-server-warmup")
    r = server.post("/generate", key=None, json={"text": "x", "sampling_params": {"regex": "a+"}})
    assert r.status_code == 400
    assert "grammar-constrained decoding is off (--grammar-backend none)" in r.json()["message"]


@pytest.fixture(scope="module")
def guided(artefact, launch):
    """The same model with --grammar-backend llguidance and a whitespace pattern: JSON's
    whitespace between tokens may only be one newline."""
    return launch(
        artefact("llama"),
        "--grammar-backend",
        "llguidance",
        "--constrained-json-whitespace-pattern",
        r"[\n]",
        "--skip-server-warmup",
    )


def test_llguidance_constrains_json_regex_and_ebnf(guided) -> None:
    """--grammar-backend llguidance: schema outputs validate (sampled, seeds apart), with
    no whitespace but the pattern's newline; regex and ebnf outputs match; what does not
    compile, and xgrammar's structural tags, are a 400 naming the field."""
    from openai import OpenAI

    client = OpenAI(base_url=guided.url + "/v1", api_key="none")
    for seed in range(4):
        reply = client.chat.completions.create(
            model="default", messages=CHAT, max_tokens=96, temperature=1.0, seed=seed,
            response_format=response_format(SMALL),
        )  # fmt: skip
        text = reply.choices[0].message.content or ""
        assert reply.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SMALL)
        assert {c for c in text if c.isspace()} <= {"\n"}, repr(text)
    pattern = r"(yes|no)-[0-9]{3}"
    for seed in range(3):
        out = client.completions.create(
            model="default", prompt="Answer:", max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"regex": pattern},
        )  # fmt: skip
        assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text
    body = {"text": "List:", "sampling_params": {"max_new_tokens": 40,
            "ebnf": 'root ::= "item" ("," "item")* "."'}}  # fmt: skip
    r = guided.post("/generate", key=None, json=body)
    assert r.status_code == 200 and re.fullmatch(r"item(,item)*\.", r.json()["text"]), r.text
    for bad, message in (
        ({"regex": "(a"}, "regex: does not compile"),
        ({"json_schema": "{nope"}, "json_schema: does not compile"),
        ({"ebnf": "root ::= ("}, "ebnf: does not compile"),
        ({"structural_tag": "{}"}, "structural_tag: xgrammar's"),
    ):
        r = guided.post("/generate", key=None, json={"text": "x", "sampling_params": bad})
        assert r.status_code == 400 and message in r.json()["message"], r.text


def test_a_whitespace_pattern_needs_llguidance_or_outlines(artefact) -> None:
    from kiln import Engine
    from kiln.args import ArgError

    with pytest.raises(ArgError, match="--constrained-json-whitespace-pattern: only with"):
        Engine(artefact("llama"), constrained_json_whitespace_pattern=r"[ ]?")


def test_outlines_constrains_json_and_regex(artefact) -> None:
    """--grammar-backend outlines (outlines-core's index, as SGLang's outlines backend):
    schema outputs validate, sampled over seeds, with no whitespace but the pattern's one
    newline; regex outputs match whole and end with a stop; ebnf and structural tags, and
    what does not compile, are errors naming the field (a 400 at the server, as for the
    other backends)."""
    from kiln import Engine
    from kiln.runtime.grammar import GrammarError

    eng = Engine(
        artefact("llama"),
        grammar_backend="outlines",
        constrained_json_whitespace_pattern=r"[\n]?",
        max_total_tokens=2048,
    )
    # outlines' regex of a schema has no number ranges: a bounded integer is its digits
    schema = json.loads(json.dumps(SMALL))
    schema["properties"]["n"] = {"type": "integer", "minDigits": 1, "maxDigits": 3}
    for seed in range(4):
        params = {"json_schema": json.dumps(schema), "max_new_tokens": 96, "temperature": 1.0}
        out = eng.generate("Describe a thing as JSON.", {**params, "sampling_seed": seed})
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        got = json.loads(out["text"])
        jsonschema.validate(got, schema)
        assert abs(got["n"]) < 1000
        assert {c for c in out["text"] if c.isspace()} <= {"\n"}, repr(out["text"])
    pattern = r"(yes|no)-[0-9]{3}"
    for seed in range(3):
        params = {"regex": pattern, "max_new_tokens": 20, "temperature": 1.0}
        out = eng.generate("Answer:", {**params, "sampling_seed": seed})
        assert re.fullmatch(pattern, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    for bad, message in (
        ({"regex": "(a"}, "regex: does not compile"),
        ({"json_schema": "{nope"}, "json_schema: does not compile"),
        ({"ebnf": 'root ::= "a"'}, "ebnf: not with --grammar-backend outlines"),
        ({"structural_tag": "{}"}, "structural_tag: not with --grammar-backend outlines"),
    ):
        with pytest.raises(GrammarError, match=message):
            eng.generate("x", {**bad, "max_new_tokens": 4})


CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        # Bounded: greedy, the model would write 1111... to the end of its tokens.
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def real_client(real_artefact, launch) -> openai.OpenAI:
    from kiln.example import fetch

    server = launch(real_artefact(fetch("smollm2")), "--api-key", API_KEY)
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def test_the_real_models_json_always_validates(real_client) -> None:
    """SmolLM2 asked for a city as JSON: every output parses and validates, over seeds and
    temperatures (the model alone often writes prose around it, or none)."""
    client = real_client
    ask = [{"role": "user", "content": "Give me the capital of France as JSON."}]
    names = []
    for temperature in (0.0, 0.8, 1.2):
        for seed in range(3):
            reply = client.chat.completions.create(
                model="SmolLM2-135M-Instruct.Q4_1",
                messages=ask,
                max_tokens=120,
                temperature=temperature,
                seed=seed,
                response_format=response_format(CITY),
            )
            assert reply.choices[0].finish_reason == "stop", reply.choices[0]
            data = json.loads(reply.choices[0].message.content)
            jsonschema.validate(data, CITY)
            names.append(data["name"])
    assert "Paris" in names[0]  # greedy: the right answer, in the asked-for shape


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_a_tool_round_trip_with_the_real_model(real_client) -> None:
    """SmolLM2 knows no tool format: tool_choice required makes its answer a call of the
    tool all the same; the tool's reply in the history, it answers in words."""
    model = "SmolLM2-135M-Instruct.Q4_1"
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = real_client.chat.completions.create(
        model=model,
        messages=ask,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    ).choices[0]
    assert first.finish_reason == "tool_calls", first
    (call,) = first.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and "Paris" in args["city"]
    history = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 18 degrees Celsius."},
    ]
    answer = real_client.chat.completions.create(
        model=model,
        messages=history,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    ).choices[0]
    assert answer.message.tool_calls is None
    assert len(answer.message.content.split()) >= 3, answer.message.content


def test_outlines_allows_every_stop_token_where_its_end_is(artefact) -> None:
    """outlines' index knows one end-of-sequence token: the model's other stop tokens are
    allowed with it once the match may end, and taking one ends the match."""
    from transformers import PreTrainedTokenizerFast

    from kiln.runtime.grammar import Constraint, Grammars, token_bitmask

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(artefact("llama") / "tokenizer/tokenizer.json")
    )
    grammars = Grammars(tok, len(tok), [2, 5], backend="outlines")
    matcher = grammars.matcher(grammars.compile(Constraint("regex", "ab")))

    def allowed() -> set[int]:
        mask = token_bitmask([matcher], len(tok))[0]
        return {t for t in range(len(tok)) if int(mask[t // 32]) >> (t % 32) & 1}

    assert 2 not in allowed() and 5 not in allowed()
    for piece in ("a", "b"):
        assert matcher.accept_token(tok.convert_tokens_to_ids(piece))
    assert allowed() == {2, 5} and not matcher.is_terminated()
    assert matcher.accept_token(5) and matcher.is_terminated()

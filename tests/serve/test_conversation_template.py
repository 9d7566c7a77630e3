"""--chat-template as SGLang also takes it: a built-in conversation template's name or a
JSON file of SGLang's fields (serve/conversation.py). The expected prompts below are what
SGLang 0.5.6's own conversation code renders for the same messages (every built-in and
every separator style here was compared with it once, 212 prompts, all equal)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from kiln.serve.conversation import BUILTIN, Conversation, load, prompt

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


@pytest.mark.parametrize(
    ("name", "messages", "want"),
    [
        (
            "chatml",
            CHAT,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            "chatml",  # the template's own system message
            CHAT[1:2],
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "llama-2",
            CHAT,
            "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]",
        ),
        ("llama-2", CHAT[1:2], "[INST] Hi [/INST]"),
        (
            "gemma-it",
            CHAT,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
            "Hello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
            "<start_of_turn>model\n",
        ),
        (
            "vicuna_v1.1",
            CHAT,
            "Be brief. USER: Hi ASSISTANT: Hello!</s>USER: Bye ASSISTANT:",
        ),
        (
            "llava_llama_3",
            CHAT[1:],
            "<|start_header_id|>system<|end_header_id|>\n\n"
            + BUILTIN["llava_llama_3"].system_message
            + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
    ],
)
def test_built_in_templates_render_as_sglang_does(name, messages, want) -> None:
    assert prompt(BUILTIN[name], messages, None, None) == want


def test_thinking_is_switched_on_as_sglang_does() -> None:
    chatml = BUILTIN["chatml"]
    base = prompt(chatml, CHAT, None, None)
    assert prompt(chatml, CHAT, {"enable_thinking": True}, "qwen3") == base + "<think>"
    assert prompt(chatml, CHAT, {"thinking": True}, "deepseek-v3") == base + "<think>"
    assert prompt(chatml, CHAT, {"enable_thinking": True}, None) == base  # no parser: no switch
    assert prompt(chatml, CHAT, {"enable_thinking": False}, "qwen3") == base


def test_a_role_without_a_turn_is_refused() -> None:
    with pytest.raises(ValueError, match="role 'tool'.*'chatml'"):
        prompt(BUILTIN["chatml"], [*CHAT, {"role": "tool", "content": "42"}], None, None)


def _write(tmp_path: Path, spec: object, name: str = "t.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(spec))
    return str(path)


SPEC = {
    "name": "mine",
    "system": "<|im_start|>system",
    "user": "<|im_start|>user",
    "assistant": "<|im_start|>assistant",
    "sep_style": "CHATML",
    "sep": "<|im_end|>",
    "stop_str": "<|im_end|>",
}


def test_a_json_file_reads_as_sglang_reads_it(tmp_path) -> None:
    conv = load(_write(tmp_path, SPEC))
    assert isinstance(conv, Conversation) and conv.stop == ("<|im_end|>",)
    # SGLang puts a newline between the file's "system" and the system message.
    assert prompt(conv, CHAT[:2], None, None) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"sep_style": "RWKV"}, "sep_style 'RWKV' is not served by kiln"),
        ({"sep_style": "NOPE"}, "sep_style 'NOPE' is unknown"),
        ({"stop_str": [""]}, "stop_str is a string or a list of non-empty strings"),
        ({"user": 3}, "user must be strings"),
        ({"assistant": None}, "a JSON object with name, system"),
    ],
)
def test_a_bad_json_file_is_refused_by_name(tmp_path, change, error) -> None:
    spec = {k: v for k, v in {**SPEC, **change}.items() if v is not None}
    path = _write(tmp_path, spec)
    with pytest.raises(ValueError, match=f"--chat-template {path}: {error}"):
        load(path)


def test_other_values_of_the_flag(tmp_path) -> None:
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ messages[0]['content'] }}")
    assert load(str(jinja)) == "{{ messages[0]['content'] }}"  # a Jinja template, as before
    assert load(None) is None
    with pytest.raises(ValueError, match="not a file; .* one of SGLang's names: chatml"):
        load("chatm")
    with pytest.raises(ValueError, match="multimodal model"):
        load("qwen2-audio")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load(str(bad))


# -- through a real server: the tiny model's tokenizer has <|user|>, <|assistant|>, </s> --
TINY = {
    "name": "tiny",
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "sep_style": "NO_COLON_SINGLE",
    "sep": "</s>",
}
QUESTION = [{"role": "user", "content": "Hello there"}]
NEW = 12


@pytest.fixture(scope="module")
def tiny(artefact, launch, tmp_path_factory):
    """A server whose JSON template stops at a string its greedy answer holds: the answer
    is computed first with the same prompt (no stop string then)."""
    from kiln import Engine

    art = artefact("qwen2")
    engine = Engine(art, max_total_tokens=512)
    folder = tmp_path_factory.mktemp("conv")
    conv = load(_write(folder, {**TINY, "stop_str": "x"}))
    assert isinstance(conv, Conversation)
    text = prompt(conv, QUESTION, None, None)
    ids = engine.encode(text)  # with the special tokens (the tiny tokenizer's <s>)
    answer = engine.generate(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
    )["text"]
    stop = next(answer[i : i + 2] for i in range(3, len(answer) - 2) if answer[i : i + 2].strip())
    server = launch(art, "--chat-template", _write(folder, {**TINY, "stop_str": [stop]}))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    return client, server, ids, answer, stop


def test_the_template_renders_stops_and_adds_special_tokens(tiny) -> None:
    client, _, ids, answer, stop = tiny
    kw = {"model": "m", "messages": QUESTION, "max_tokens": NEW, "temperature": 0}
    out = client.chat.completions.create(**kw)
    assert out.usage.prompt_tokens == len(ids)  # <s> included, as SGLang's tokenizer.encode
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == answer[: answer.index(stop)]
    # With ignore_eos the template's stop strings are not added (as SGLang): the whole answer.
    whole = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == answer
    # the request's own stop strings stay, beside the template's
    mine = answer[1:3]
    both = client.chat.completions.create(**kw, stop=[mine])
    end = min(answer.index(mine), answer.index(stop))
    assert both.choices[0].message.content == answer[:end]


def test_a_role_the_template_lacks_is_a_400_and_the_server_goes_on(tiny) -> None:
    client, server, *_ = tiny
    with pytest.raises(openai.BadRequestError, match="role 'tool'"):
        client.chat.completions.create(
            model="m",
            messages=[*QUESTION, {"role": "tool", "content": "42", "tool_call_id": "a"}],
            max_tokens=2,
        )
    assert server.get("/health").status_code == 200

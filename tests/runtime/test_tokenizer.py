"""kiln's own tokenizer (runtime/tokenizer.py) against transformers' AutoTokenizer on the same
folder: same ids, texts, special tokens and chat renderings, or a fallback to transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from kiln.runtime.tokenizer import FastTokenizer, NotExact, load_tokenizer, read_folder

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces, trailing tab\t",
    "ünïcode: 東京, emoji 🙂, combining e\u0301",
    "specials inline: <s> and </s> and <|user|>",
    "line one\nline two\n\n  indented",
    "x",
    "it 's a test , isn 't it ?",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "And 3+3? <s>"},
    ],
    [  # a tool round trip, as kiln passes it (serve/context.py)
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 °C"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now, «quoted»",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# Exercises what transformers gives templates: its tojson, namespace, dict, loop controls,
# the {% generation %} tag, special-token variables, extra keyword arguments, tools and calls.
RICH_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{{ bos_token }}"
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}[{{ m.role }}]{{ m.content }}"
    "{% if m.thinking %}({{ m.thinking }}|{{ m.reasoning_content }}){% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{% endfor %}{{ ns.n }} {{ dict(a=1, b='é') | tojson }}"
    " {{ flavour | default('plain') }}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def assert_same(tok: FastTokenizer, folder: Path, ids_to_check: list[int]) -> None:
    ref = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip
                )
    for i in ids_to_check:
        assert tok.convert_ids_to_tokens(i) == ref.convert_ids_to_tokens(i)
        assert tok.decode([i]) == ref.decode([i])
    assert {i: t.content for i, t in tok.added_tokens_decoder.items()} == {
        i: t.content for i, t in ref.added_tokens_decoder.items()
    }
    assert tok.all_special_ids == sorted(ref.all_special_ids)
    assert tok.chat_template == ref.chat_template
    for template in (tok.chat_template, RICH_TEMPLATE):
        if template is None:
            continue
        for convo in CONVERSATIONS:
            for gen in (True, False):
                kw = {"chat_template": template, "add_generation_prompt": gen, "tokenize": False}
                assert tok.apply_chat_template(convo, **kw) == ref.apply_chat_template(convo, **kw)
                assert tok.apply_chat_template(
                    convo, flavour="spicy", **kw
                ) == ref.apply_chat_template(convo, flavour="spicy", **kw)
                assert tok.apply_chat_template(convo, tools=TOOLS, **kw) == (
                    ref.apply_chat_template(convo, tools=TOOLS, **kw)
                )


def edited(src: Path, dst: Path, config: dict[str, Any] | None = None, **backend: Any) -> Path:
    """A copy of a tokenizer folder with config keys and tokenizer.json fields replaced."""
    shutil.copytree(src, dst)
    if config:
        path = dst / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if backend:
        path = dst / "tokenizer.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **backend}))
    return dst


@pytest.fixture(scope="module")
def tiny(checkpoint) -> Path:
    return Path(checkpoint("llama"))


def test_the_test_checkpoints_tokenizer_is_read_exactly(tiny) -> None:
    tok = load_tokenizer(read_folder(tiny))
    assert isinstance(tok, FastTokenizer)
    assert_same(tok, tiny, list(range(400)))


def test_the_real_models_tokenizer_is_read_exactly(tmp_path) -> None:
    """SmolLM2's byte-level BPE (49152 tokens, ChatML template) as kiln's GGUF import writes it."""
    from kiln.compiler.gguf_import import GGUFFile
    from kiln.example import fetch

    folder = tmp_path / "tok"
    GGUFFile(fetch("smollm2")).write_tokenizer(folder)
    tok = load_tokenizer(read_folder(folder))
    assert isinstance(tok, FastTokenizer)
    assert_same(tok, folder, [*range(0, 49152, 97), 0, 1, 2, 49151])


@pytest.mark.parametrize(
    "config",
    [
        {"add_bos_token": False},
        {"add_bos_token": True, "add_eos_token": True},
        {"add_eos_token": True},
        {"clean_up_tokenization_spaces": True},  # transformers ignores it for BPE
        {"chat_template": "{{ messages[0]['content'] }}!"},  # the .jinja file still wins
    ],
)
def test_config_flags_change_what_they_change_in_transformers(tiny, tmp_path, config) -> None:
    folder = edited(tiny, tmp_path / "tok", config)
    tok = load_tokenizer(read_folder(folder))
    assert isinstance(tok, FastTokenizer)
    assert_same(tok, folder, [])


def test_without_a_post_processor_nothing_surrounds_a_text(tiny, tmp_path) -> None:
    """Whatever add_bos_token says: transformers drops it when tokenizer.json exists."""
    folder = edited(tiny, tmp_path / "tok", {"add_bos_token": True}, post_processor=None)
    tok = load_tokenizer(read_folder(folder))
    assert isinstance(tok, FastTokenizer)
    assert tok.encode("x") == tok.encode("x", add_special_tokens=False)
    assert_same(tok, folder, [])


@pytest.mark.parametrize(
    ("config", "backend", "why"),
    [
        ({"tokenizer_class": "GPT2Tokenizer"}, {}, "tokenizer_class"),
        ({"legacy": False}, {}, "sets legacy"),
        ({"pad_token": "<pad>"}, {}, "pad_token '<pad>'"),
        ({"split_special_tokens": True}, {}, "split_special_tokens"),
        ({"extra_special_tokens": {"image_token": "<s>"}}, {}, "named extra"),
        (
            {},
            {
                "truncation": {
                    "direction": "Right",
                    "max_length": 4,
                    "strategy": "LongestFirst",
                    "stride": 0,
                }
            },
            "truncation",
        ),
    ],
)
def test_what_is_not_reproduced_goes_to_transformers(tiny, tmp_path, config, backend, why) -> None:
    folder = edited(tiny, tmp_path / "tok", config, **backend)
    with pytest.raises(NotExact, match=why):
        FastTokenizer(read_folder(folder))
    tok = load_tokenizer(read_folder(folder))
    assert not isinstance(tok, FastTokenizer)
    assert tok.encode("The capital") == AutoTokenizer.from_pretrained(str(folder)).encode(
        "The capital"
    )


@pytest.mark.parametrize("name", ["special_tokens_map.json", "added_tokens.json"])
def test_other_special_token_files_go_to_transformers(tiny, tmp_path, name) -> None:
    folder = edited(tiny, tmp_path / "tok")
    (folder / name).write_text(json.dumps({"eos_token": "<|user|>"} if "map" in name else {}))
    with pytest.raises(NotExact, match=name):
        FastTokenizer(read_folder(folder))
    tok = load_tokenizer(read_folder(folder))
    assert not isinstance(tok, FastTokenizer)
    assert tok.encode("The capital") == AutoTokenizer.from_pretrained(str(folder)).encode(
        "The capital"
    )


def test_templates_stay_in_the_sandbox(tiny) -> None:
    from jinja2.exceptions import SecurityError, TemplateError

    tok = FastTokenizer(read_folder(tiny))
    convo = CONVERSATIONS[0]
    with pytest.raises(TemplateError, match="no system"):
        tok.apply_chat_template(convo, chat_template="{{ raise_exception('no system') }}")
    for escape in (
        "{{ messages.__class__.__mro__ }}",
        "{% set ns = namespace(_x=1) %}",
        "{{ ''.__class__.__base__.__subclasses__() }}",
    ):
        with pytest.raises(SecurityError):
            tok.apply_chat_template(convo, chat_template=escape)
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])

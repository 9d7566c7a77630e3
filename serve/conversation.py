"""SGLang's conversation templates, the other kind of `--chat-template` besides a Jinja
file: a built-in name (`chatml`, `llama-2`, `gemma-it`, ...) or a JSON file of SGLang's
fields. A base model without a chat template of its own answers chat requests through one
of these, and SGLang users' command lines and configs that name one carry over.

A conversation template is data, not code: a system prompt around the system message, the
user's and the assistant's role strings, a separator style (how a turn is written: role,
joiner, message, separator) and the strings generation stops at. The prompt is rendered as
SGLang renders it, so the same messages give the same prompt text:

- the last system message replaces the template's default one (several: the last wins);
- user and assistant turns alternate as given; any other role (tool, developer) is a 400,
  and tools are not written into the prompt (SGLang's conversations have no place for
  them: a Jinja template does); a turn with no text is written as an open turn;
- the prompt ends with the assistant's open turn; with `chat_template_kwargs`
  `enable_thinking` (`--reasoning-parser qwen3` or `glm45`) or `thinking` (`deepseek-v3`)
  it ends with `<think>`;
- it is tokenized with the tokenizer's special tokens (a BOS where the model has one);
- the template's stop strings join the request's `stop` (not with `ignore_eos`).

Guessing a template from the model's path (SGLang does so for some multimodal models and
Vicuna) is not done: kiln uses the model's own Jinja template unless `--chat-template` is
given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.serve.fim import read_json_file

# A separator style is two functions: the prompt's head, from the template and the system
# message; and one turn, from the template, the turn's index, its role string and its text
# (None: the open turn the model writes).
Head = Callable[["Conversation", str], str]
Turn = Callable[["Conversation", int, str, str | None], str]


@dataclass(frozen=True)
class Conversation:
    name: str
    system_template: str  # "{system_message}" is replaced by the system message
    system_message: str
    roles: tuple[str, str]  # the user's, the assistant's
    style: str  # one of STYLES (SGLang's SeparatorStyle names)
    sep: str = "\n"
    sep2: str | None = None
    stop: tuple[str, ...] = ()

    def render(self, turns: Sequence[tuple[str, str | None]], system: str | None) -> str:
        """The prompt for `turns` ((role, text); None: the open turn), with `system`
        instead of the default system message when given."""
        message = self.system_message if system is None else system
        head, turn = STYLES[self.style]
        out = [head(self, message)]
        out += [turn(self, i, role, text or None) for i, (role, text) in enumerate(turns)]
        return "".join(out)

    def system_prompt(self, message: str) -> str:
        return self.system_template.replace("{system_message}", message)

    def seps(self, i: int) -> str:
        return self.sep if i % 2 == 0 or self.sep2 is None else self.sep2


def _head(joiner: Callable[[Conversation], str] | None, when: str = "always") -> Head:
    """The prompt's head: the system prompt, then `joiner`'s string (None: nothing); `when`:
    "always", "nonempty" (nothing when the rendered system prompt is empty) or "message"
    (nothing when there is no system message)."""

    def head(c: Conversation, message: str) -> str:
        prompt = c.system_prompt(message)
        if (when == "nonempty" and not prompt) or (when == "message" and not message):
            return ""
        return prompt + (joiner(c) if joiner else "")

    return head


def _turn(joiner: str, open_: str, two: bool = False, end: str = "") -> Turn:
    """role + joiner + message + separator + end (the second separator on the assistant's
    turns when `two`); an open turn: role + `open_`."""

    def turn(c: Conversation, i: int, role: str, text: str | None) -> str:
        if text is None:
            return role + open_
        return role + joiner + text + (c.seps(i) if two else c.sep) + end

    return turn


def _sep(c: Conversation) -> str:
    return c.sep


def _llama2_head(c: Conversation, message: str) -> str:
    return c.system_prompt(message) if message else "[INST] "


def _llama2_turn(c: Conversation, i: int, role: str, text: str | None) -> str:
    tag = c.roles[i % 2]  # by position, not by the message's role (as SGLang)
    if text is None:
        return tag
    return text + " " if i == 0 else f"{tag} {text}{c.seps(i)}"


def _header_turn(start: str, end: str, eot: str) -> Turn:
    def turn(c: Conversation, i: int, role: str, text: str | None) -> str:
        header = f"{start}{role}{end}\n\n"
        return header if text is None else f"{header}{text.strip()}{eot}"

    return turn


def _gemma_turn(c: Conversation, i: int, role: str, text: str | None) -> str:
    if text is None:
        return role
    return text + c.sep if i == 0 else role + text + c.sep  # the system prompt opened turn 0


def _intern_turn(c: Conversation, i: int, role: str, text: str | None) -> str:
    start = "<s>" if i % 2 == 0 else ""
    return start + role + ":" + ("" if text is None else text + c.seps(i) + "\n")


def _dolly_turn(c: Conversation, i: int, role: str, text: str | None) -> str:
    if text is None:
        return role + ":\n"
    return role + ":\n" + text + c.seps(i) + ("\n\n" if i % 2 else "")


def _phoenix_turn(c: Conversation, i: int, role: str, text: str | None) -> str:
    return role + ": <s>" + ("" if text is None else text + "</s>")


def _chatglm3_turn(c: Conversation, i: int, role: str, text: str | None) -> str:
    return role + ("" if text is None else "\n" + text)


def _vl2_head(c: Conversation, message: str) -> str:
    prompt = c.system_prompt(message)
    return prompt + c.sep if prompt else ""


_LLAMA3_TURN = _header_turn("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_LLAMA4_TURN = _header_turn("<|header_start|>", "<|header_end|>", "<|eot|>")
STYLES: dict[str, tuple[Head, Turn]] = {
    "ADD_COLON_SINGLE": (_head(_sep), _turn(": ", ":")),
    "ADD_COLON_TWO": (_head(_sep), _turn(": ", ":", two=True)),
    "ADD_COLON_SPACE_SINGLE": (_head(_sep), _turn(": ", ": ")),
    "ADD_NEW_LINE_SINGLE": (_head(_sep, "nonempty"), _turn("\n", "\n")),
    "NO_COLON_SINGLE": (_head(None), _turn("", "")),
    "NO_COLON_TWO": (_head(None), _turn("", "", two=True)),
    "CHATML": (_head(lambda c: c.sep + "\n", "nonempty"), _turn("\n", "\n", end="\n")),
    "MPT": (_head(_sep), _turn("", "")),
    "ROBIN": (_head(_sep), _turn(":\n", ":\n")),
    "FALCON_CHAT": (_head(_sep, "message"), _turn(": ", ":")),
    "DEEPSEEK_CHAT": (_head(None), _turn(": ", ":", two=True)),
    "DeepSeekVL2": (_vl2_head, _turn(": ", ":", two=True)),
    "LLAMA2": (_llama2_head, _llama2_turn),
    "LLAMA3": (_head(None, "message"), _LLAMA3_TURN),
    "LLAMA4": (_head(None, "message"), _LLAMA4_TURN),
    "GEMMA3": (_head(None), _gemma_turn),
    "CHATINTERN": (_head(None), _intern_turn),
    "DOLLY": (_head(None), _dolly_turn),
    "PHOENIX": (_head(None), _phoenix_turn),
    "CHATGLM3": (_head(None, "message"), _chatglm3_turn),
}
# SGLang's other styles: for multimodal or long-retired models.
UNSUPPORTED_STYLES = ("RWKV", "CHATGLM", "METAMATH", "QWEN2_VL_EMBED", "QWEN2_AUDIO")

_LLAMA2_STOP = ("[INST]", "[/INST]")
_HELPFUL = "You are a helpful assistant."
_LLAVA_SYSTEM = (
    "You are a helpful language and vision assistant. You are able to understand the visual "
    "content that the user provides, and assist the user with a variety of tasks using "
    "natural language."
)
_LLAMA3_SYSTEM = "<|start_header_id|>system<|end_header_id|>\n\n{system_message}<|eot_id|>"

# SGLang's built-in names whose templates are text (its multimodal-only ones are not here).
BUILTIN = {
    c.name: c
    for c in (
        Conversation(
            "llama-2", "[INST] <<SYS>>\n{system_message}\n<</SYS>>\n\n", "",
            ("[INST]", "[/INST]"), "LLAMA2", " ", " </s><s>",
            (*_LLAMA2_STOP, "<<SYS>>", "<</SYS>>"),
        ),
        Conversation(
            "mistral", "[SYSTEM_PROMPT]\n{system_message}\n[/SYSTEM_PROMPT]\n\n", "",
            ("[INST]", "[/INST]"), "LLAMA2", " ", " </s><s>",
            (*_LLAMA2_STOP, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
        ),
        Conversation(
            "llama-4", "<|header_start|>system<|header_end|>\n\n{system_message}<|eot|>", "",
            ("user", "assistant"), "LLAMA4", "", None,
            ("<|end_of_text|>", "<|eot|>", "<|eom|>"),
        ),
        Conversation(
            "chatml", "<|im_start|>system\n{system_message}", _HELPFUL,
            ("<|im_start|>user", "<|im_start|>assistant"), "CHATML", "<|im_end|>", None,
            ("<|endoftext|>", "<|im_end|>"),
        ),
        Conversation(
            "chatml-llava", "<|im_start|>system\n{system_message}", _HELPFUL,
            ("<|im_start|>user", "<|im_start|>assistant"), "CHATML", "<|im_end|>", None,
            ("<|endoftext|>", "<|im_end|>"),
        ),
        Conversation(
            "vicuna_v1.1", "{system_message}",
            "A chat between a curious user and an artificial intelligence assistant. The "
            "assistant gives helpful, detailed, and polite answers to the user's questions.",
            ("USER", "ASSISTANT"), "ADD_COLON_TWO", " ", "</s>",
        ),
        Conversation(
            "llava_llama_3", _LLAMA3_SYSTEM, _LLAVA_SYSTEM, ("user", "assistant"), "LLAMA3",
            "", None, ("<|end_of_text|>", "<|eot_id|>"),
        ),
        Conversation(
            "llama_3_vision", _LLAMA3_SYSTEM, _LLAVA_SYSTEM, ("user", "assistant"), "LLAMA3",
            "", None, ("<|end_of_text|>", "<|eot_id|>"),
        ),
        Conversation(
            "internlm2-chat", "<|im_start|>system\n{system_message}", "",
            ("<|im_start|>user", "<|im_start|>assistant"), "ADD_COLON_SINGLE", "\n", None,
            ("<|im_end|>", "<|action_end|>"),
        ),
        Conversation(
            "qwen2-vl", "<|im_start|>system\n{system_message}", _HELPFUL,
            ("<|im_start|>user", "<|im_start|>assistant"), "ADD_NEW_LINE_SINGLE",
            "<|im_end|>\n", None, ("<|im_end|>",),
        ),
        Conversation(
            "gemma-it", "<start_of_turn>user\n{system_message}\n\n", _HELPFUL,
            ("<start_of_turn>user\n", "<start_of_turn>model\n"), "GEMMA3",
            "<end_of_turn>\n", None, ("<end_of_turn>",),
        ),
        Conversation(
            "phi-4-mm", "{system_message}", "", ("<|user|>", "<|assistant|>"),
            "NO_COLON_SINGLE", "<|end|>", None, ("<|end|>",),
        ),
        Conversation(
            "deepseek-vl2", "{system_message}", "", ("<|User|>", "<|Assistant|>"),
            "DeepSeekVL2", "\n\n", "<｜end▁of▁sentence｜>", ("User:", "<｜end▁of▁sentence｜>"),
        ),
    )
}  # fmt: skip
# Reasoning parsers whose models take a chat_template_kwargs switch to think (SGLang's).
THINKING_SWITCH = {
    "qwen3": "enable_thinking",
    "glm45": "enable_thinking",
    "deepseek-v3": "thinking",
}


# SGLang's other built-in names: templates of multimodal models (and Devstral's, whose
# system prompt SGLang downloads from the model hub).
NOT_BUILT_IN = (
    "deepseek-ocr", "devstral", "gme-qwen2-vl", "internvl-2-5", "janus-pro", "kimi-vl",
    "minicpmo", "minicpmv", "points-v15-chat", "qwen2-audio",
)  # fmt: skip


def load(value: str | None) -> Conversation | str | None:
    """What `--chat-template value` names: a built-in conversation, a JSON file's
    conversation (SGLang's fields: name, system, user, assistant, sep_style, sep, stop_str,
    system_message), or any other file's text as a Jinja template; None for None.
    ValueError naming the flag otherwise."""
    if value is None:
        return None
    if value in BUILTIN:
        return BUILTIN[value]
    flag = f"--chat-template {value}"
    if value in NOT_BUILT_IN:
        raise ValueError(
            f"{flag}: SGLang's template for a multimodal model, not built into kiln; give a "
            "Jinja or JSON template file"
        )
    path = Path(value)
    if not path.is_file():
        raise ValueError(
            f"{flag}: not a file; give a Jinja template file, a JSON conversation file or "
            f"one of SGLang's names: {', '.join(sorted(BUILTIN))}"
        )
    if path.suffix != ".json":
        return path.read_text()
    return _from_json(flag, read_json_file(flag, path))


def _from_json(flag: str, spec: Any) -> Conversation:
    required = ("name", "system", "user", "assistant", "sep_style", "stop_str")
    if not isinstance(spec, dict) or any(k not in spec for k in required):
        raise ValueError(f"{flag}: a JSON object with {', '.join(required)} (SGLang's fields)")
    strings = ("name", "system", "user", "assistant", "sep_style", "sep", "system_message")
    bad = [k for k in strings if k in spec and not isinstance(spec[k], str)]
    if bad:
        raise ValueError(f"{flag}: {', '.join(bad)} must be strings")
    stop = spec["stop_str"]
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"{flag}: stop_str is a string or a list of non-empty strings")
    style = spec["sep_style"]
    if style not in STYLES:
        why = "not served by kiln" if style in UNSUPPORTED_STYLES else "unknown"
        raise ValueError(
            f"{flag}: sep_style {style!r} is {why}; one of {', '.join(sorted(STYLES))}"
        )
    return Conversation(
        name=spec["name"],
        system_template=spec["system"] + "\n{system_message}",  # as SGLang reads the file
        system_message=spec.get("system_message", ""),
        roles=(spec["user"], spec["assistant"]),
        style=style,
        sep=spec.get("sep", "\n"),
        stop=tuple(stop),
    )


def prompt(
    conv: Conversation,
    messages: Sequence[dict[str, Any]],
    template_kwargs: dict[str, Any] | None,
    reasoning_parser: str | None,
) -> str:
    """The prompt text for chat `messages` (as chat templates read them: role and text
    content); ValueError for a role the template has no turn for."""
    system: str | None = None
    turns: list[tuple[str, str | None]] = []
    for m in messages:
        role, text = m["role"], m.get("content") or ""
        if role == "system":
            system = text
        elif role in ("user", "assistant"):
            turns.append((conv.roles[role == "assistant"], text))
        else:
            raise ValueError(
                f"role {role!r}: the chat template {conv.name!r} has system, user and "
                "assistant turns only (a Jinja --chat-template can write others)"
            )
    text = conv.render([*turns, (conv.roles[1], None)], system)
    switch = THINKING_SWITCH.get(reasoning_parser or "")
    if switch and (template_kwargs or {}).get(switch):
        text += "<think>"
    return text

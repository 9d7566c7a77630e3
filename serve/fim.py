"""--completion-template (SGLang's): fill-in-the-middle prompts for code models. A
/v1/completions request with a `suffix` asks for the text between its prompt and that
suffix; the template says how the model was trained to read such a request, with its
special tokens around the two parts: `MIDDLE` puts them begin + prompt + middle + suffix +
end, `END` begin + prompt + end + suffix + middle. The built-in names are SGLang's
(deepseek_coder, star_coder, qwen_coder); any other value is a JSON file with the same
fields (name, fim_begin_token, fim_middle_token, fim_end_token, fim_position), read once
at start."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CompletionTemplate:
    name: str
    begin: str
    middle: str
    end: str
    position: str  # "MIDDLE" or "END": where the middle token goes

    def prompt(self, prefix: str, suffix: str) -> str:
        if self.position == "MIDDLE":
            return f"{self.begin}{prefix}{self.middle}{suffix}{self.end}"
        return f"{self.begin}{prefix}{self.end}{suffix}{self.middle}"


TEMPLATES = {
    t.name: t
    for t in (
        CompletionTemplate(
            "deepseek_coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "MIDDLE"
        ),
        CompletionTemplate("star_coder", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "END"),
        CompletionTemplate(
            "qwen_coder", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "END"
        ),
    )
}
_FIELDS = ("name", "fim_begin_token", "fim_middle_token", "fim_end_token", "fim_position")
MAX_FILE_BYTES = 65536


def read_json_file(flag: str, path: Path) -> Any:
    """A template file's JSON (this and the chat template's, serve/conversation.py): at most
    MAX_FILE_BYTES; ValueError naming the flag otherwise."""
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{flag}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: not JSON ({e})") from None


def load(value: str | None) -> CompletionTemplate | None:
    """The template --completion-template names: a built-in one, or a JSON file's;
    ValueError naming the flag otherwise."""
    if value is None:
        return None
    if value in TEMPLATES:
        return TEMPLATES[value]
    flag = f"--completion-template {value}"
    path = Path(value)
    if not path.is_file():
        raise ValueError(
            f"{flag}: neither one of {', '.join(TEMPLATES)} nor a JSON file of {', '.join(_FIELDS)}"
        )
    spec = read_json_file(flag, path)
    if not isinstance(spec, dict) or any(not isinstance(spec.get(f), str) for f in _FIELDS):
        raise ValueError(f"{flag}: a JSON object of strings {', '.join(_FIELDS)}")
    if spec["fim_position"] not in ("MIDDLE", "END"):
        raise ValueError(f"{flag}: fim_position is MIDDLE or END, got {spec['fim_position']!r}")
    return CompletionTemplate(
        spec["name"],
        spec["fim_begin_token"],
        spec["fim_middle_token"],
        spec["fim_end_token"],
        spec["fim_position"],
    )

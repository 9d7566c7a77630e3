"""transformers' answers for the real models (SmolLM2's Q4_1 file, Gemma 3's Q4_K_M file),
computed in a process of their own beside the test session.

Reading a GGUF file costs transformers 30-60 s on a slow core (its reader builds a numpy
view per vocabulary string, for the tokenizer, the config and the weights), and the CI
machine's second core sits mostly idle while the tests run one at a time. So the session
starts this module as a low-priority process once it has collected a test that asks for a
real model's oracle (tests/conftest.py), and that test waits for its files. The oracle is
still transformers reading the same file: only where it runs changed.

Run by hand: `python tests/hf_oracle.py OUT_DIR smollm2 gemma3`; each model's answers land
as OUT_DIR/<name>.json (prompt ids, greedy continuations, their texts) and
OUT_DIR/<name>.safetensors (the logits of the first prompt and its continuation)."""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    prompts: tuple[str, ...] = ()  # plain text prompts
    chat: tuple[dict[str, str], ...] = ()  # or one chat, through the file's template
    new_tokens: int = 16
    tokenizer: dict[str, str] = field(default_factory=dict)


SMOLLM2_QUESTION = ({"role": "user", "content": "What is the capital of France?"},)
CASES = {
    "smollm2": Case(chat=SMOLLM2_QUESTION, new_tokens=32),
    # The tokenizer type spares a config built from the file.
    "gemma3": Case(
        prompts=("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"),
        new_tokens=12,
        tokenizer={"tokenizer_type": "gemma3_text"},
    ),
}


def compute(name: str, out_dir: Path) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.example import fetch

    case = CASES[name]
    path = fetch(name)
    # transformers opens the file three times (tokenizer, config, weights), each a parse by
    # the gguf package; one parse serves all three (that reader's result, not kiln's).
    parsed = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
    reader, gguf.GGUFReader = gguf.GGUFReader, lambda p: parsed(str(p))  # type: ignore[misc]
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, **case.tokenizer)
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    finally:
        gguf.GGUFReader = reader  # type: ignore[misc]
    texts = list(case.prompts)
    if case.chat:
        texts = [
            tok.apply_chat_template(list(case.chat), add_generation_prompt=True, tokenize=False)
        ]
    answers = []
    for text in texts:
        ids = tok(text)["input_ids"]  # greedy, stopping at the end of text as generate does
        out = hf.generate(torch.tensor([ids]), max_new_tokens=case.new_tokens, do_sample=False)
        cont = out[0, len(ids) :].tolist()
        answers.append({"prompt": text, "ids": ids, "continuation": cont, "text": tok.decode(cont)})
    first = answers[0]
    with torch.no_grad():
        logits = hf(torch.tensor([first["ids"] + first["continuation"]])).logits[0]
    # the weights first, the JSON last: a reader that sees the JSON finds both
    tmp = out_dir / f".{name}.tmp"
    save_file({"logits": logits.contiguous()}, str(tmp))
    os.replace(tmp, out_dir / f"{name}.safetensors")
    tmp.write_text(json.dumps({"answers": answers}))
    os.replace(tmp, out_dir / f"{name}.json")


def load(name: str, out_dir: Path) -> dict[str, Any]:
    """A model's answers as written by compute(): {"answers": [...], "logits": tensor}."""
    from safetensors.torch import load_file

    answers = json.loads((out_dir / f"{name}.json").read_text())
    return {**answers, "logits": load_file(str(out_dir / f"{name}.safetensors"))["logits"]}


def main(argv: list[str]) -> int:
    out_dir, names = Path(argv[0]), argv[1:]
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    # one thread, below the tests' priority: this runs on the core they leave idle
    torch.set_num_threads(1)
    os.nice(10)
    for name in names:
        compute(name, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

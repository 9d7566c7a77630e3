"""Reasoning parsers (`--reasoning-parser`, SGLang's names): a thinking model's reasoning,
written between `<think>` and `</think>`, is split from its answer and returned as
`reasoning_content`, in responses and, as it is generated, in streams.

- `deepseek-r1`: the template opens the reasoning in the prompt, so the output is reasoning
  until `</think>` (a `<think>` the model writes itself is dropped); an output with no
  `</think>` is all reasoning.
- `qwen3`: the output is reasoning only when it opens with `<think>`, or when the rendered
  prompt ends with `<think>` (templates that force thinking); with `chat_template_kwargs:
  {"enable_thinking": false}` Qwen3's template closes an empty block in the prompt and the
  output is all answer.
- `qwen3-thinking`: Qwen3's thinking-only models, which always reason first: as
  `deepseek-r1`.
- `deepseek-v3` (DeepSeek-V3.1's thinking mode, its template ending the prompt with
  `<think>` when asked to think) and `glm45`: as `qwen3`; `step3`: as `deepseek-r1`;
  `kimi`: Kimi's `◁think▷` ... `◁/think▷`, reasoning only where the output opens with it.
  (SGLang's mapping of these names.)

The split runs on text as it streams (`ReasoningSplit.feed`); a non-streamed response is
the same split fed the whole text at once, so joined stream deltas equal it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.serve.streams import held_back

REASONING = "reasoning"
CONTENT = "content"


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    forced: bool  # the output begins inside the reasoning


PARSERS = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", forced=True),
    "qwen3": ReasoningFormat("<think>", "</think>", forced=False),
    "qwen3-thinking": ReasoningFormat("<think>", "</think>", forced=True),
    "deepseek-v3": ReasoningFormat("<think>", "</think>", forced=False),
    "glm45": ReasoningFormat("<think>", "</think>", forced=False),
    "step3": ReasoningFormat("<think>", "</think>", forced=True),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", forced=False),
}


class ReasoningSplit:
    """One generation's text, split into (REASONING | CONTENT, text) pieces as it comes.
    Leading whitespace of each part is dropped (the newline after a marker)."""

    def __init__(self, fmt: ReasoningFormat, prompt: str) -> None:
        self.fmt = fmt
        self.opens = fmt.forced or prompt.rstrip().endswith(fmt.start)
        self._state = "start"  # until the text says whether it opens with fmt.start
        self._buf = ""
        self._trim = True  # drop whitespace at the start of the current part

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(self.fmt.start):
                self._buf, self._state = head[len(self.fmt.start) :], REASONING
            elif self.fmt.start.startswith(head):
                return out  # "", "<", "<thi": it may still open
            else:
                self._state = REASONING if self.opens else CONTENT
        if self._state == REASONING:
            at = self._buf.find(self.fmt.end)
            if at < 0:
                keep = held_back(self._buf, self.fmt.end)
                cut = len(self._buf) - keep
                self._emit(out, REASONING, self._buf[:cut])
                self._buf = self._buf[cut:]
                return out
            self._emit(out, REASONING, self._buf[:at])
            self._buf, self._state, self._trim = self._buf[at + len(self.fmt.end) :], CONTENT, True
        self._emit(out, CONTENT, self._buf)
        self._buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held back, once the generation has ended."""
        out: list[tuple[str, str]] = []
        state = self._state
        if state == "start":
            state = REASONING if self.opens else CONTENT
        self._emit(out, state, self._buf)
        self._buf = ""
        return out

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        if text:
            out.append((kind, text))

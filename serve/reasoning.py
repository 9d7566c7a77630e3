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
- `gpt-oss`: OpenAI's harmony format, messages of channels rather than tags: the
  `analysis` channel is reasoning, `final` and plain `commentary` (preambles) are the
  answer, and a `commentary` message to a function (`to=functions.NAME`) is a tool call,
  handed on as `to=functions.NAME<|message|>ARGS<|call|>` for the `gpt-oss` tool parser
  (`HarmonySplit`). Its markers are special tokens, kept in the text it reads.

The split runs on text as it streams (`ReasoningSplit.feed`); a non-streamed response is
the same split fed the whole text at once, so joined stream deltas equal it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.serve.streams import held_back

REASONING = "reasoning"
CONTENT = "content"


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    forced: bool  # the output begins inside the reasoning
    harmony: bool = False  # gpt-oss's channels (HarmonySplit), not start/end tags


PARSERS = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", forced=True),
    "qwen3": ReasoningFormat("<think>", "</think>", forced=False),
    "qwen3-thinking": ReasoningFormat("<think>", "</think>", forced=True),
    "deepseek-v3": ReasoningFormat("<think>", "</think>", forced=False),
    "glm45": ReasoningFormat("<think>", "</think>", forced=False),
    "step3": ReasoningFormat("<think>", "</think>", forced=True),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", forced=False),
    "gpt-oss": ReasoningFormat("<|channel|>analysis", "<|end|>", forced=False, harmony=True),
}


def splitter(fmt: ReasoningFormat, prompt: str) -> ReasoningSplit | HarmonySplit:
    """The split of one generation's text for this format."""
    return HarmonySplit() if fmt.harmony else ReasoningSplit(fmt, prompt)


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


_MESSAGE, _HEADER_ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
# How a message (its header) begins; "to=": a recipient in the role's place, right after
# the prompt's `<|start|>assistant`.
_OPENERS = ("<|channel|>", "<|start|>", "to=")
_RECIPIENT = re.compile(r"to=(functions\.[^\s<]+)")


class HarmonySplit:
    """gpt-oss's output, a run of harmony messages (`[<|start|>assistant]<|channel|>NAME
    [to=RECIPIENT] [<|constrain|>json]<|message|>BODY<|end|>` or `<|call|>`), split as
    ReasoningSplit splits tags: analysis bodies are reasoning; final and commentary
    bodies are content; a message to a function is passed on, whole, as content in the
    form the gpt-oss tool parser reads. Text outside any message is content."""

    def __init__(self) -> None:
        self._buf = ""
        self._kind: str | None = None  # the open message's body: REASONING, CONTENT, a call
        self._call = ""  # the open call message's recipient
        self._args = ""
        self._trim = {REASONING: True, CONTENT: True}

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self._kind is None:  # in a header, or between messages
                head = self._buf.lstrip()[: len(_OPENERS[0])]
                if head and not any(o.startswith(head) or head.startswith(o) for o in _OPENERS):
                    # not a message (a grammar's JSON, say): the answer, as it comes, up to
                    # a message that may still follow
                    self._kind = CONTENT
                    continue
                at = self._buf.find(_MESSAGE)
                if at < 0:
                    return out
                header, self._buf = self._buf[:at], self._buf[at + len(_MESSAGE) :]
                self._open(header)
                continue
            ends = [(self._buf.find(m), m) for m in _HEADER_ENDS]
            at, marker = min(((i, m) for i, m in ends if i >= 0), default=(-1, ""))
            if at < 0:
                keep = max(held_back(self._buf, m) for m in _HEADER_ENDS)
                self._body(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            self._body(out, self._buf[:at])
            self._buf = self._buf[at + (0 if marker == "<|start|>" else len(marker)) :]
            self._close(out)

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._kind is None:
            if self._buf.strip():  # not harmony at all: the text is the answer
                self._emit(out, CONTENT, self._buf)
        else:
            self._body(out, self._buf)
            self._close(out)
        self._buf = ""
        return out

    def _open(self, header: str) -> None:
        channel = header.rpartition("<|channel|>")[2].split()
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            self._kind, self._call, self._args = "call", recipient.group(1), ""
        elif channel and channel[0] == "analysis":
            self._kind = REASONING
        else:
            self._kind = CONTENT

    def _body(self, out: list[tuple[str, str]], text: str) -> None:
        if self._kind == "call":
            self._args += text
        elif self._kind is not None:
            self._emit(out, self._kind, text)

    def _close(self, out: list[tuple[str, str]]) -> None:
        if self._kind == "call":
            out.append((CONTENT, f"to={self._call}<|message|>{self._args}<|call|>"))
        self._kind = None

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if self._trim[kind]:
            text = text.lstrip()
            self._trim[kind] = not text
        if text:
            out.append((kind, text))

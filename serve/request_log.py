"""--log-requests: one log line as each request ends (SGLang's flag, levels and formats).

Level 0: its id, token counts, finish reason and times; 1: and its sampling parameters;
2: and its prompt and output text, each cut to PARTIAL_CHARS characters; 3: the whole
texts. `--log-requests-format json` writes the same fields as one JSON object a line.
Off by default: prompts and answers are the clients' data. Control characters in the
text are escaped by kiln's log formatter (kiln/terminal.py), so a prompt cannot forge a
log line.

The server logs on its event loop, where every client's stream is written: at levels 2
and 3 the texts are decoded, and the line written, on another thread (`workers`), so a
request with a long prompt does not hold other clients' chunks for its decode's time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import Executor
from typing import Any

from kiln.runtime.request import Request

log = logging.getLogger("kiln.requests")

PARTIAL_CHARS = 2048  # level 2's cut, of the prompt and of the output


class RequestLog:
    def __init__(
        self,
        level: int,
        fmt: str,
        tokenizer: Any,
        cut: int = PARTIAL_CHARS,
        workers: Executor | None = None,
    ) -> None:
        self.level, self.fmt, self.tokenizer, self.cut = level, fmt, tokenizer, cut
        self.workers = workers  # where the texts are decoded (None: in the caller)

    def finished(self, req: Request, reason: dict[str, Any] | None = None) -> None:
        """Log `req`, which has ended (with `reason` where it does not say why yet: a
        client that went away)."""
        now = time.perf_counter()
        fields: dict[str, Any] = {
            "rid": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": reason or req.finish_reason,
            "e2e_latency": round(now - req.created, 4),
        }
        if req.first_token_at is not None:
            fields["ttft"] = round(req.first_token_at - req.created, 4)
        if self.level >= 1:
            fields["sampling_params"] = {
                k: v for k, v in dataclasses.asdict(req.params).items() if v not in (None, ())
            }
        if self.level < 2:
            self._write(fields)
            return
        texts = (req.prompt_ids, list(req.output_ids))
        if self.workers is not None:
            try:
                self.workers.submit(self._write, fields, texts)
                return
            except RuntimeError:  # the workers are shut down: the server is stopping
                pass
        self._write(fields, texts)

    def _write(
        self, fields: dict[str, Any], texts: tuple[list[int], list[int]] | None = None
    ) -> None:
        if texts is not None:
            fields["input"], fields["output"] = map(self._text, texts)
        if self.fmt == "json":
            log.info("%s", json.dumps(fields, default=str))
        else:
            log.info("Finish: %s", ", ".join(f"{k}={v!r}" for k, v in fields.items()))

    def _text(self, ids: list[int]) -> str | list[int]:
        """The tokens' text (their ids without a tokenizer), below level 3 cut to `cut`
        characters: only that many tokens are decoded (each is a character or more)."""
        part = self.level < 3 and len(ids) > self.cut
        ids = ids[: self.cut] if part else ids
        if self.tokenizer is None:
            return ids
        text = str(self.tokenizer.decode(ids))
        if self.level < 3 and len(text) > self.cut:
            text, part = text[: self.cut], True
        return text + ("..." if part else "")

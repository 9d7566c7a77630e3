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
import os
import socket
import time
from array import array
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kiln.args import SECRET_ARGS, ArgError
from kiln.runtime.request import Request
from kiln.serve.metrics import REQUEST_LABELS

# The rid prefix of the server's own probes (warm-up, /health_generate): SGLang's.
PROBE_RID = "HEALTH_CHECK_"

log = logging.getLogger("kiln.requests")

PARTIAL_CHARS = 2048  # level 2's cut, of the prompt and of the output


def run_on(workers: Executor | None, fn: Callable[..., None], *args: Any) -> None:
    """`fn(*args)` on `workers` (in order, off the event loop), or here when there are none
    or they are shut down (the server is stopping: the line is still written)."""
    if workers is not None:
        try:
            workers.submit(fn, *args)
            return
        except RuntimeError:
            pass
    fn(*args)


def writable_folder(folder: str, flag: str, mode: int = 0o777) -> Path:
    """`folder`, made if missing (with `mode`); ArgError naming `flag` when it cannot be
    made or written to: the server refuses to start rather than lose records later."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=mode)
    except OSError as e:
        raise ArgError(f"{flag}: cannot create {folder}: {e}") from None
    if not os.access(path, os.W_OK):
        raise ArgError(f"{flag}: {folder} is not writable")
    return path


def ended(req: Request, reason: dict[str, Any] | None, sampling: bool) -> dict[str, Any]:
    """What a request that ended is, without its texts: id, token counts, finish reason
    (`reason` where the request does not say yet), times, and with `sampling` its
    sampling parameters."""
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
    if req.lora is not None:
        fields["lora_path"] = req.lora
    if sampling:
        fields["sampling_params"] = {
            k: v for k, v in dataclasses.asdict(req.params).items() if v not in (None, ())
        }
    return fields


class MetricsFile:
    """--export-metrics-to-file: a JSON object a line for each request that ends, in
    `kiln-request-metrics-YYYYMMDD_HH.log` (the UTC hour it ended in) under
    --export-metrics-to-file-dir: when, the served model name, what `ended` gives with the
    sampling parameters, and its custom metric labels (serve/metrics.py); never its prompt
    or output. Health and warm-up probes are left out. Written on `workers` (the request
    log's thread), so a slow disk holds no client's stream; a write that fails is logged
    once and the server serves on."""

    def __init__(self, folder: str, model_name: str, workers: Executor | None = None) -> None:
        self.folder = writable_folder(folder, "--export-metrics-to-file-dir")
        self.model_name, self.workers = model_name, workers
        self._hour = ""
        self._file: Any = None
        self._failed = False

    def finished(self, req: Request, reason: dict[str, Any] | None = None) -> None:
        if req.rid.startswith(PROBE_RID):
            return
        at = time.time()
        record = {
            "time": datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds"),
            "model_name": self.model_name,
            **ended(req, reason, sampling=True),
        }
        labels = REQUEST_LABELS.get()
        if labels:
            record["custom_labels"] = labels
        run_on(self.workers, self._write, at, json.dumps(record, default=str))

    def _write(self, at: float, line: str) -> None:
        try:
            hour = time.strftime("%Y%m%d_%H", time.gmtime(at))
            if hour != self._hour:
                self.close()
                name = f"kiln-request-metrics-{hour}.log"
                self._file = open(self.folder / name, "a", encoding="utf-8")  # noqa: SIM115
                self._hour = hour
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as e:
            if not self._failed:
                self._failed = True
                log.warning("--export-metrics-to-file: cannot write under %s: %s", self.folder, e)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file, self._hour = None, ""


# --crash-dump-folder: the requests that ended in the last five minutes (SGLang's window) ...
CRASH_DUMP_WINDOW_S = 300.0
# ... at most this many, the oldest dropped first: kiln's bound on the memory the dump holds
# (each keeps its prompt and output ids, 8 bytes a token).
CRASH_DUMP_MAX_ENDED = 1000


class CrashDump:
    """--crash-dump-folder: when the server fails (a lost rank, --crash-on-nan, a step past
    --watchdog-timeout), the requests that ended in the last CRASH_DUMP_WINDOW_S seconds
    and every request still in flight are written to
    `<folder>/<host name>/crash_dump_YYYY-MM-DD_HH-MM-SS.json` (SGLang's place; it writes a
    pickle, kiln JSON): per request what `ended` gives with its sampling parameters, its
    prompt and output token ids and whether it finished, so the failing mix can be
    replayed through /generate with `input_ids`. Prompts are clients' data: the file is
    readable by its owner only, and the server's flags in it leave out the API keys. Probes
    are left out; one dump a server."""

    def __init__(self, folder: str, args: dict[str, Any]) -> None:
        self.folder = writable_folder(folder, "--crash-dump-folder", mode=0o700)
        self.args = {k: v for k, v in args.items() if k not in SECRET_ARGS}
        self._ended: deque[tuple[float, dict[str, Any]]] = deque(maxlen=CRASH_DUMP_MAX_ENDED)
        self.written: Path | None = None

    def finished(self, req: Request, reason: dict[str, Any] | None = None) -> None:
        if req.rid.startswith(PROBE_RID):
            return
        now = time.time()
        self._ended.append((now, _dumped(req, reason, finished=True)))
        while self._ended and now - self._ended[0][0] > CRASH_DUMP_WINDOW_S:
            self._ended.popleft()

    def dump(self, reason: str, in_flight: list[Request]) -> Path | None:
        """Write the dump (once); its path, or None when it was written before or cannot be."""
        if self.written is not None:
            return None
        now = time.time()
        ended = [r for at, r in self._ended if now - at <= CRASH_DUMP_WINDOW_S]
        running = [
            _dumped(r, None, finished=False) for r in in_flight if not r.rid.startswith(PROBE_RID)
        ]
        host = os.environ.get("HOSTNAME") or socket.gethostname()
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now))
        path = self.folder / host / f"crash_dump_{stamp}.json"
        record = {
            "time": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
            "reason": reason,
            "server_args": self.args,
            "requests": ended + running,
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, default=_plain)
        except OSError as e:
            log.error("--crash-dump-folder: cannot write %s: %s", path, e)
            return None
        self.written = path
        log.error(
            "dumped %d ended and %d unfinished requests before the failure to %s",
            len(ended),
            len(running),
            path,
        )
        return path


def _dumped(req: Request, reason: dict[str, Any] | None, finished: bool) -> dict[str, Any]:
    """A request as a crash dump keeps it: `ended`'s fields, wall-clock arrival, its ids."""
    fields = ended(req, reason, sampling=True)
    fields["created"] = round(time.time() - (time.perf_counter() - req.created), 3)
    fields["finished"] = finished
    fields["input_ids"] = array("q", req.prompt_ids)
    fields["output_ids"] = array("q", req.output_ids)
    return fields


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, array) else str(value)


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
        fields = ended(req, reason, sampling=self.level >= 1)
        if self.level < 2:
            self._write(fields)
            return
        run_on(self.workers, self._write, fields, (req.prompt_ids, list(req.output_ids)))

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

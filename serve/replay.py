"""`kiln replay DUMP --url URL`: send a --crash-dump-folder dump's requests to a server again.

Each request goes to /generate with its prompt's token ids and its sampling parameters, at
the offset from the first request's arrival that it arrived at (divided by --speed), so the
replay puts the same requests in flight together as the traffic the dump caught did: what
a failure that depends on the batch's mix needs. One line a request (its id in the dump,
the status, tokens, finish reason), then a summary; exit 0 when every request got a 200.
Standard library only: it runs on a machine without torch.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Requests in flight at once, at most (each waits for its whole answer on a thread).
MAX_IN_FLIGHT = 64


@dataclass
class Replayed:
    rid: str
    status: int
    body: dict[str, Any]


def load(path: Path) -> list[dict[str, Any]]:
    """The dump's requests, in arrival order; ValueError naming the file when it is not one
    of kiln's dumps."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        requests = record["requests"]
        for r in requests:
            if not (isinstance(r["input_ids"], list) and isinstance(r["sampling_params"], dict)):
                raise TypeError
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = e if isinstance(e, OSError | ValueError) else "no requests with input_ids"
        raise ValueError(f"{path}: not a kiln crash dump ({why})") from None
    return sorted(requests, key=lambda r: float(r.get("created", 0.0)))


def _body(request: dict[str, Any]) -> dict[str, Any]:
    params = dict(request["sampling_params"])
    if "logit_bias" in params:  # kept as (token, bias) pairs; /generate takes a mapping
        params["logit_bias"] = {str(t): b for t, b in params["logit_bias"]}
    body = {"input_ids": request["input_ids"], "sampling_params": params}
    if request.get("lora_path") is not None:  # the LoRA adapter it ran with
        body["lora_path"] = request["lora_path"]
    return body


def replay(
    requests: list[dict[str, Any]], url: str, api_key: str | None = None, speed: float = 1.0
) -> list[Replayed]:
    """Send each request at its arrival offset / speed; the answers in the dump's order."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    results: list[Replayed | None] = [None] * len(requests)
    slots = threading.BoundedSemaphore(MAX_IN_FLIGHT)
    first = float(requests[0].get("created", 0.0)) if requests else 0.0
    start = time.monotonic()

    def send(i: int, rid: str, data: bytes) -> None:
        try:
            post = urllib.request.Request(url.rstrip("/") + "/generate", data, headers)
            try:
                with urllib.request.urlopen(post, timeout=3600) as r:
                    body = json.load(r)
                if isinstance(body, list):  # n > 1: one answer a sample
                    body = {"outputs": body, "meta_info": body[0].get("meta_info", {})}
                results[i] = Replayed(rid, 200, body)
            except urllib.error.HTTPError as e:
                results[i] = Replayed(rid, e.code, _json(e.read()))
            except (OSError, ValueError) as e:  # refused, reset, not JSON: no answer
                results[i] = Replayed(rid, 0, {"error": str(e)})
        finally:
            slots.release()

    threads = []
    for i, request in enumerate(requests):
        rid = str(request.get("rid"))
        try:
            data = json.dumps(_body(request)).encode()
        except (TypeError, ValueError) as e:  # a damaged entry: reported, not dropped
            results[i] = Replayed(rid, 0, {"error": f"the dump's entry cannot be sent: {e}"})
            continue
        due = start + (float(request.get("created", first)) - first) / speed
        time.sleep(max(0.0, due - time.monotonic()))
        slots.acquire()
        t = threading.Thread(target=send, args=(i, rid, data), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def _json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        return {"error": raw.decode(errors="replace")[:500]}
    return body if isinstance(body, dict) else {"error": body}


def report(results: list[Replayed]) -> tuple[list[str], bool]:
    """One line a request and a summary; whether every request got a 200."""
    lines = []
    for r in results:
        meta = r.body.get("meta_info", {}) if r.status == 200 else {}
        what = (
            f"prompt_tokens={meta.get('prompt_tokens')} "
            f"completion_tokens={meta.get('completion_tokens')} "
            f"finish_reason={json.dumps(meta.get('finish_reason'))}"
            if r.status == 200
            else json.dumps(r.body.get("error", r.body))[:300]
        )
        lines.append(f"{r.rid}: {r.status or 'no answer'} {what}")
    ok = sum(r.status == 200 for r in results)
    lines.append(f"replayed {len(results)} requests: {ok} answered 200, {len(results) - ok} not")
    return lines, ok == len(results)

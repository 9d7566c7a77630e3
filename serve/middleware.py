"""The server's front door, as one pure ASGI middleware: keys, browsers, body size.

Pure ASGI on purpose: Starlette's `@app.middleware("http")` runs the route behind a
proxy that swallows the client's disconnect message, so a non-streaming request whose
client had gone kept generating. Here `receive` reaches the route untouched (only counted).

- API keys: `--api-key` on every path but the public ones; `--admin-api-key`, when set,
  on admin paths (constant-time comparison).
- Browsers: a web page may send a "simple" cross-site POST without asking first. Any POST
  carrying an `Origin` of another site is refused (403), and POST bodies must be JSON
  (415 for form and text content types), so no page can make this server work for it.
- Body size: more than `--max-request-body-bytes` gets a 413, read no further.
- Host names: a server bound to loopback answers only requests whose `Host` is a loopback
  name (`localhost`, `127.0.0.1`, `[::1]`), its `--host` or one of `--allowed-hosts`. A page
  on evil.com whose DNS name is rebound to 127.0.0.1 sends `Host: evil.com` and a matching
  `Origin`, which the Origin check alone lets through (403 here). `--allowed-hosts` on a
  server bound to another address restricts it the same way.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths a load balancer or Prometheus reaches without a key.
PUBLIC_PATHS = frozenset({"/health", "/health_generate", "/ping", "/metrics"})
# Paths that take --admin-api-key when it is set (those that stop other clients' requests
# refuse to run without it).
ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/update_weight_version",
        "/configure_logging",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/update_weights_from_disk",
        "/start_profile",
        "/stop_profile",
    }
)
# Content types a browser may send cross-site without a preflight request.
_FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """SGLang's error object, with OpenAI's `error` envelope so either client reads it."""
    err = {"message": message, "type": kind, "param": None, "code": status}
    return {"object": "error", **err, "error": err}


async def send_error(send: Send, status: int, message: str, kind: str) -> None:
    body = json.dumps(error_body(status, message, kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def host_name(header: str) -> str:
    """The name in a Host header, without its port: `[::1]:80` -> `::1`, `a.b:1` -> `a.b`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_loopback(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class FrontDoor:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        admin_key: str | None,
        max_body: int,
        host: str = "127.0.0.1",
        allowed_hosts: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key
        self.max_body = max_body
        allowed = {host_name(h) for h in allowed_hosts}
        # None: any Host (a server bound to a public address, with no list given).
        self.host_names: set[str] | None = (
            allowed | {host_name(host)} if allowed or is_loopback(host_name(host)) else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await send_error(send, *refusal)
            return
        await self._with_body_limit(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str, str] | None:
        host = headers.get("host")
        if self.host_names is not None and host is not None:
            name = host_name(host)
            if not is_loopback(name) and name not in self.host_names:
                return (
                    403,
                    f"Host {host[:100]!r} is not a name of this server (it answers loopback "
                    "names and --allowed-hosts)",
                    "PermissionDeniedError",
                )
        path = scope["path"]
        key = self._required_key(path)
        if key is not None:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return 401, "invalid or missing API key", "AuthenticationError"
        if scope["method"] == "POST":
            origin = headers.get("origin")
            if origin is not None and urlsplit(origin).netloc != headers.get("host"):
                return 403, f"cross-origin request from {origin} refused", "PermissionDeniedError"
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype in _FORM_TYPES:
                return (
                    415,
                    f"Content-Type {ctype} is not accepted: send JSON "
                    "(Content-Type: application/json)",
                    "UnsupportedMediaTypeError",
                )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return self._too_large()
        return None

    def _required_key(self, path: str) -> str | None:
        if path in PUBLIC_PATHS:
            return None
        if path in ADMIN_PATHS and self.admin_key:
            return self.admin_key
        return self.api_key or None

    def _too_large(self) -> tuple[int, str, str]:
        return (
            413,
            f"request body larger than {self.max_body} bytes (--max-request-body-bytes)",
            "RequestTooLargeError",
        )

    async def _with_body_limit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body (chunked uploads have no length to check up front), refuse it past
        the limit, then hand it to the route; later `receive` calls (the disconnect the
        route polls for) go straight through."""
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_body:
                await send_error(send, *self._too_large())
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

"""The app's outer ASGI middleware: the replica header on every response, the API key, the
body size limit. Pure ASGI (no Starlette middleware stack): it answers 401/413 before
the app reads a byte more than it must."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from .engine import replica
from .requests import error_response

if TYPE_CHECKING:
    from .app import ServeOptions

REPLICA = "x-dflash-replica"
OPEN_PATHS = ("/health", "/health/ready", "/metrics")  # no API key needed (as vLLM: /v1 and the rest need it)


class Guard:
    """Pure ASGI middleware: replica header on every response, API key, body size limit (413)."""

    def __init__(self, app, options: ServeOptions):
        self.app, self.options = app, options
        self.key = options.api_key.encode() if options.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_replica(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == REPLICA.encode() for k, _ in headers):
                    headers.append((REPLICA.encode(), replica().encode()))
                message = {**message, "headers": headers}
            await send(message)

        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.key is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token.strip(), self.key):  # constant time
                resp = error_response(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                      code="invalid_api_key", headers={"www-authenticate": "Bearer"})
                return await resp(scope, receive, send_with_replica)
        limit = self.options.max_body_bytes
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = -1
        if declared < 0:
            return await error_response(400, "invalid Content-Length header")(scope, receive, send_with_replica)
        if declared > limit:
            return await error_response(413, f"the body has {declared} bytes; the limit is {limit}",
                                        code="request_too_large")(scope, receive, send_with_replica)
        if scope.get("method") != "POST":
            return await self.app(scope, receive, send_with_replica)
        body, more = bytearray(), True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > limit:
                return await error_response(413, f"the body is over the limit of {limit} bytes",
                                            code="request_too_large")(scope, receive, send_with_replica)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send_with_replica)

"""A limit on the size of every request body, as ASGI middleware in front of every endpoint.

A declared ``Content-Length`` over the limit is refused before any of the body is read; a body sent
without one (chunked) is counted while the endpoint reads it and refused as soon as it passes the
limit, so no endpoint ever holds more than the limit in memory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .errors import Code, Refused

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooLarge(Refused):
    """A body over the limit; raised from ``receive`` while an endpoint reads a chunked body, and
    answered by the exception policy like any refusal (413)."""

    def __init__(self, limit: int):
        super().__init__(
            Code.RESOURCE_EXHAUSTED,
            f"the body is larger than the {limit} bytes this server accepts (--max-body-bytes)",
            "too_large",
        )


class BodyLimit:
    """``BodyLimit(app, limit=N, refuse=...)``: ``refuse(scope, error)`` makes the 413 response (an
    ASGI app) for a request whose body is larger than ``limit`` bytes. An endpoint answers a chunked
    body's BodyTooLarge itself (through the exception policy); one that lets it escape gets the same
    answer here."""

    def __init__(self, app: ASGIApp, *, limit: int, refuse: Callable[[Scope, BodyTooLarge], ASGIApp]):
        self.app = app
        self.limit = limit
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await self.refuse(scope, BodyTooLarge(self.limit))(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as e:
            if not started:
                await self.refuse(scope, e)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None  # the server refuses malformed ones
    return None

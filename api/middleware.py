"""Plain ASGI middleware: bearer auth, the body size limit, and request metrics."""

from __future__ import annotations

import hmac
import json
import time

from api.errors import BodyTooLarge
from api.metrics import Metrics
from api.settings import Settings

OPEN_PATHS = ("/healthz",)


async def _send_json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(key.lower().encode(), value.encode()) for key, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


class GuardMiddleware:
    def __init__(self, app, settings: Settings, metrics: Metrics):
        self.app = app
        self.settings = settings
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, tracked_send)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(method=scope.get("method", ""), route=label, status=str(status[0])).inc()
            self.metrics.request_seconds.labels(route=label).observe(time.perf_counter() - started)

    async def _guarded(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        token = self.settings.token
        if token is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, credentials = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(credentials.strip().encode(), token.encode()):
                await _send_json(
                    send,
                    401,
                    {"error": "unauthorized", "message": "this server needs 'Authorization: Bearer <token>'", "issues": []},
                    {"WWW-Authenticate": 'Bearer realm="mosos"'},
                )
                return
        limit = self.settings.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            error = BodyTooLarge(limit)
            await _send_json(
                send,
                413,
                {"error": "limit_exceeded", "message": str(error), "issues": [{"path": "", "message": str(error)}],
                 "limit": "max_body_bytes", "limit_value": limit},
            )
            return
        received = [0]

        async def counted_receive():
            message = await receive()
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                if received[0] > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted_receive, send)

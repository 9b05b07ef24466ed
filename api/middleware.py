"""Plain ASGI middleware: bearer auth, the body size limit, and request metrics."""

from __future__ import annotations

import hmac
import json
import time

from starlette.routing import Match, Mount

from api.errors import BodyTooLarge
from api.http_rules import request_method
from api.metrics import Metrics
from api.settings import Settings

OPEN_PATHS = ("/healthz",)


async def _send_json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(key.lower().encode(), value.encode()) for key, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


def _route_label(scope) -> str:
    """The route template of the request's path: the router's match, or, for a request answered before routing (401,
    413), the first route whose path matches; "unmatched" for a path no route has."""
    route = scope.get("route")
    if route is None:
        app = scope.get("app")
        for candidate in getattr(getattr(app, "router", None), "routes", ()):
            if isinstance(candidate, Mount) and candidate.matches(scope)[0] != Match.NONE:
                return f"{candidate.path}/{{path}}"  # static files (the docs' assets): one label for the folder
            if getattr(candidate, "methods", None) and candidate.matches(scope)[0] != Match.NONE:
                route = candidate
                break
    return getattr(route, "path", None) or "unmatched"


class GuardMiddleware:
    def __init__(self, app, settings: Settings, metrics: Metrics):
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self._token_bytes = None if settings.token is None else settings.token.encode("utf-8")

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

        # matched before the request runs: a mount (the docs' assets) rewrites the scope's root path as it routes
        matched_before = _route_label(scope)
        try:
            await self._guarded(scope, receive, tracked_send)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or matched_before
            self.metrics.requests.labels(method=request_method(scope), route=label, status=str(status[0])).inc()
            self.metrics.request_seconds.labels(route=label).observe(time.perf_counter() - started)

    async def _guarded(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        if self._token_bytes is not None and scope.get("path") not in OPEN_PATHS:
            # Compared as bytes: the header is the client's UTF-8 bytes, and decoding it first (as latin-1, what
            # ASGI servers assume) made a non-ASCII token impossible to present.
            scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials.strip(b" \t"), self._token_bytes):
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

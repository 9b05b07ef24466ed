"""HTTP rules every route follows without declaring them: JSON bodies only, HEAD wherever GET, and an `Allow` that
names every method.

All work from the routes themselves, so a route added later gets them too.

JSON only: an operation that takes a body (its OpenAPI entry has a `requestBody`, or
FastAPI reads a body parameter) answers `415` unless the request says
`Content-Type: application/json` (any parameters, e.g. a charset) and sends it
uncompressed (a `Content-Encoding` other than `identity` is refused by name,
rather than read as JSON that is not UTF-8). This is what
keeps a page on another origin from queueing solves on a loopback server: a
browser sends `text/plain`, form and multipart bodies cross-origin without a
preflight and without any token, but never `application/json`.

HEAD: FastAPI routes a GET operation for GET only; HTTP says a resource that
answers GET answers HEAD with the same status and headers and no body
(`curl -I`, link checkers, load balancers' health checks). `HeadAsGet` runs such a
request as the GET and drops the body.

Allow: FastAPI makes one route per method, and Starlette answers a method that
no route of a path takes with the `Allow` of the first route it tried. Here a
405 names the methods of every route on the path, and OPTIONS answers 204 with
the same list.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Match

from api.errors import ApiError
from planner.errors import Issue

JSON_MEDIA_TYPE = "application/json"


def is_json_media_type(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def takes_body(route) -> bool:
    """Whether an APIRoute reads a request body: declared in its OpenAPI entry, or a FastAPI body parameter."""
    return "requestBody" in (getattr(route, "openapi_extra", None) or {}) or getattr(route, "body_field", None) is not None


HEAD_REQUEST_KEY = "mosos.head_request"


def request_method(scope) -> str:
    """The method the client sent: HEAD for a request `HeadAsGet` runs as GET."""
    return "HEAD" if scope.get(HEAD_REQUEST_KEY) else scope.get("method", "")


class HeadAsGet:
    """ASGI middleware: a HEAD request runs as the GET of its path, and its answer is sent without the body (the
    headers, Content-Length included, are the GET's). A path with no GET still answers 405 naming HEAD."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            await self.app(scope, receive, send)
            return
        # The scope is changed in place: the router records the matched route in it, and the metrics read that.
        scope["method"] = "GET"
        scope[HEAD_REQUEST_KEY] = True

        async def send_without_body(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app(scope, receive, send_without_body)


async def require_json_body(request: Request) -> None:
    """App-wide dependency: runs after routing (so an unknown path or method stays 404 / 405) and before the body
    is read."""
    route = request.scope.get("route")
    if route is None or not takes_body(route):
        return
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        message = (f"send the request body uncompressed; this request has 'Content-Encoding: {encoding}', which this "
                   "server does not decode")
        raise ApiError(415, "unsupported_media_type", message, issues=[Issue("", message)])
    content_type = request.headers.get("content-type")
    if content_type is not None and is_json_media_type(content_type):
        return
    given = f"'{content_type.split(';', 1)[0].strip()}'" if content_type else "no Content-Type"
    message = f"send the request body as JSON with 'Content-Type: {JSON_MEDIA_TYPE}'; this request has {given}"
    raise ApiError(415, "unsupported_media_type", message, issues=[Issue("", message)])


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the request's path takes, HEAD wherever GET, and OPTIONS."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches(request.scope)[0] != Match.NONE:
            methods |= set(route_methods)
    if "GET" in methods:
        methods.add("HEAD")
    order = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
    return sorted(methods, key=lambda method: (order.index(method) if method in order else len(order), method)) + ["OPTIONS"]


def method_not_allowed(request: Request) -> Response | None:
    """The answer to a path's unsupported method: OPTIONS gets 204 with `Allow`, anything else 405 with it.
    None when the path has no route at all (the caller answers 404)."""
    allow = allowed_methods(request)
    if allow == ["OPTIONS"]:
        return None
    headers = {"Allow": ", ".join(allow)}
    if request.method == "OPTIONS":
        return Response(status_code=204, headers=headers)
    method = request_method(request.scope)
    error = ApiError(405, "method_not_allowed", f"{method} is not a method of {request.url.path}; it takes "
                     f"{', '.join(allow)}")
    return JSONResponse(error.body(), status_code=405, headers=headers)


def refuse_if_shutting_down(request: Request, location: str) -> None:
    """A request waiting on a solve while the HTTP server shuts down (SIGTERM, Ctrl-C): a 503 at once, not a 500
    once uvicorn's grace period runs out and cancels it (and a stop of the whole grace period)."""
    server = getattr(request.app.state, "http_server", None)
    if server is not None and server.should_exit:
        raise ApiError(503, "stopping", f"the server is stopping: what this request waits for ({location}) may not "
                       "finish here; post the request again once the server is back (a plan that finished is kept)",
                       headers={"Retry-After": "5"})

"""The FastAPI application: `create_app(settings)` wires store, job queue, metrics and routes."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.docs import add_docs
from api.errors import ApiError, BodyTooLarge, invalid
from api.examples import EXAMPLE_PROFILE
from api.http_rules import HeadAsGet, method_not_allowed, refuse_if_shutting_down, require_json_body
from api.jobs import JobQueue, QueueFull, ServiceStopping
from api.max_batch import MaxBatchRequest, MaxBatchSearches
from api.max_batch import add_routes as add_max_batch_routes
from api.metrics import Metrics
from api.middleware import OPEN_PATHS, GuardMiddleware
from api.pool import RequestPool
from api.models import ErrorBody, Health, PlanList, PlanRequest, PlanStatus, SimulateRequest, SimulateResponse
from api.openapi import refine_openapi
from api.ownership import OwnedStore
from api.service import PLANNER_VERSION, Service
from api.settings import Settings
from api.solver import load_plugins
from planner.errors import Issue
from planner.strategies import load_all
from planner.validation import issues_from_validation_error
from planner.viewer import content_security_policy

log = logging.getLogger("mosos.api")
CURSOR_PATTERN = r"^[0-9]{1,18}$"  # a row's sequence number, as next_cursor gives it
WAIT_POLL_S = 0.02
REQUEUES_AFTER_DELETE = 2  # a waiting POST whose shared plan another client deletes is queued again, this often
# The viewer page runs only its own inline script and style (by hash), fetches nothing, and is never framed.
VIEW_HEADERS = {
    "Content-Security-Policy": content_security_policy(header=True),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _error_responses(*codes: int) -> dict:
    descriptions = {
        401: "Missing or wrong bearer token.",
        404: "No such plan.",
        409: "The plan is in a state that does not allow this.",
        413: "Past a size limit (max_body_bytes or max_nodes); `limit` names it.",
        422: "Bad input: one issue (JSON path + sentence) per problem, or a limit named in `limit`.",
        429: "The plan queue is full; retry after `Retry-After` seconds.",
        501: "This server cannot do it (e.g. estimate models without torch).",
        503: "The server is stopping, or a request process was lost while reading this request (retry).",
    }
    responses = {code: {"model": ErrorBody, "description": descriptions[code]} for code in codes}
    if 429 in responses:
        responses[429]["headers"] = {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}}
    return responses


def _json_body(name: str, example: dict | None = None) -> dict:
    content: dict = {"schema": {"$ref": f"#/components/schemas/{name}"}}
    if example is not None:
        content["example"] = example
    return {"requestBody": {"required": True, "content": {"application/json": content}}}


class _Shim:
    """Lets planner.validation format FastAPI's error list like a pydantic ValidationError."""

    def __init__(self, errors):
        self._errors = errors

    def errors(self, include_url: bool = False):
        return self._errors


def create_app(settings: Settings | None = None, owned_store: OwnedStore | None = None) -> FastAPI:
    """The service; `owned_store` is the plan store already opened and locked by the caller (`mosos serve` does, so
    that a store in use is refused before anything starts), else the app opens and locks it at start-up."""
    settings = settings or Settings()
    metrics = Metrics()
    load_plugins(settings.plugins)
    strategies = sorted(load_all())
    example_strategy = "mosos" if "mosos" in strategies else "keep-all"
    example_request = {
        "profile": EXAMPLE_PROFILE,
        "memory_ratio": 0.9,
        "strategy": example_strategy,
        "time_limit_s": min(10.0, settings.max_time_limit_s),
        "workers": 1,
        "seed": 0,
        "wait_s": min(10.0, settings.max_wait_s),
    }

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        owned = owned_store or OwnedStore.open(settings)
        store = owned.store
        interrupted = store.recover()  # only with the store's lock held: no other live server has plans running here
        log.warning("mosos serve: plans are stored in %s", settings.db_path)
        if interrupted:
            log.warning("mosos serve: %d plan(s) left unfinished by the last run marked failed (interrupted by restart)", interrupted)
        queue = JobQueue(store, settings, metrics)
        pool = RequestPool(settings)
        try:
            # Both kinds of process import the planner: start them side by side, and let both finish before
            # cleaning up after either one's failure.
            started = await asyncio.gather(run_in_threadpool(queue.start), run_in_threadpool(pool.start),
                                           return_exceptions=True)
            for outcome in started:
                if isinstance(outcome, BaseException):
                    raise outcome
        except Exception:
            pool.stop()
            queue.stop()
            owned.close()
            raise
        metrics.solves_running.set_function(lambda: queue.running)
        app.state.service = Service(settings, store, queue, metrics, pool)
        app.state.max_batch = MaxBatchSearches(app.state.service, settings)
        try:
            yield
        finally:
            await run_in_threadpool(app.state.max_batch.stop)
            await run_in_threadpool(pool.stop)
            await run_in_threadpool(queue.stop)
            owned.close()

    app = FastAPI(
        title="mosos planning service",
        version=PLANNER_VERSION,
        description=(
            "POST a training-step profile and a GPU memory budget, get a schedule that says which activations to "
            "keep, offload or recompute and which algorithm each node uses. Identical requests are answered from "
            "the store. Every schedule has been replayed by the simulator."
        ),
        lifespan=lifespan,
        separate_input_output_schemas=False,
        docs_url=None,  # served from the package's files by add_docs, not from a CDN
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
        dependencies=[Depends(require_json_body)],  # every route that takes a body: JSON only, else 415
    )
    app.add_middleware(HeadAsGet)  # inside the guard: a HEAD request needs the token a GET needs
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics)
    add_docs(app)

    def service(request: Request) -> Service:
        return request.app.state.service

    # Errors: one JSON shape, never a traceback ---------------------------------

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(request: Request, error: BodyTooLarge):
        issue = {"path": "", "message": str(error)}
        body = {"error": "limit_exceeded", "message": str(error), "issues": [issue], "limit": "max_body_bytes",
                "limit_value": error.limit_bytes}
        return JSONResponse(body, status_code=413)

    @app.exception_handler(RequestValidationError)
    async def request_invalid(request: Request, error: RequestValidationError):
        issues = issues_from_validation_error(_Shim(error.errors()))
        text = "; ".join(str(issue) for issue in issues)
        body = {"error": "invalid_request", "message": f"invalid request: {len(issues)} problem(s): {text}",
                "issues": [{"path": i.path, "message": i.message} for i in issues], "limit": None, "limit_value": None}
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        if error.status_code == 405:  # Allow names every route's methods on the path; OPTIONS is answered
            answer = method_not_allowed(request)
            if answer is not None:
                return answer
        names = {404: "not_found", 405: "method_not_allowed"}
        body = {"error": names.get(error.status_code, "http_error"), "message": str(error.detail), "issues": [],
                "limit": None, "limit_value": None}
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        body = {"error": "internal_error", "message": f"internal error: {type(error).__name__}", "issues": [],
                "limit": None, "limit_value": None}
        return JSONResponse(body, status_code=500)

    # Plans ------------------------------------------------------------------------

    @app.post(
        "/v1/plans",
        summary="Plan a profile within a budget",
        response_model=PlanStatus,
        responses={
            202: {"model": PlanStatus, "description": "Not ready within wait_s: poll the Location.",
                  "headers": {"Location": {"description": "URL of the plan.", "schema": {"type": "string"}}}},
            **_error_responses(401, 409, 413, 422, 429, 503),
        },
        openapi_extra=_json_body("PlanRequest", example_request),
    )
    async def create_plan(request: Request):
        """200 with the plan when it is ready within `wait_s` (or stored from an identical request), else 202."""
        svc = service(request)
        raw = await request.body()
        parsed = await svc.parse_plan(raw)
        deadline = time.monotonic() + parsed.wait_s
        for _ in range(REQUEUES_AFTER_DELETE + 1):
            try:
                hit, job = await run_in_threadpool(svc.find_or_queue, parsed)
            except QueueFull as full:
                raise ApiError(429, "queue_full", str(full), limit="queue_size", limit_value=full.queue_size,
                               headers={"Retry-After": str(full.retry_after_s)}) from None
            except ServiceStopping as stopping:
                raise ApiError(503, "stopping", str(stopping)) from None
            # Only find_or_queue (queue lock, a durable write) needs a thread; reads and rendering are as cheap as
            # a status call and stay on the event loop.
            if hit is not None:
                return Response(svc.render_json(hit, cached=True), media_type="application/json")
            while not job.finished.is_set() and time.monotonic() < deadline:
                refuse_if_shutting_down(request, f"/v1/plans/{job.id}")
                await asyncio.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))
            try:
                row = svc.get_row(job.id)
            except ApiError as error:
                if error.status_code != 404:
                    raise
                continue  # another client deleted the plan this request shared: this request is queued again
            if row.status in ("queued", "solving"):
                return Response(
                    svc.render_json(row), status_code=202, media_type="application/json",
                    headers={"Location": f"/v1/plans/{row.id}"},
                )
            return Response(svc.render_json(row), media_type="application/json")
        raise ApiError(409, "conflict", f"the plan this request shared with identical ones was deleted by another "
                       f"client {REQUEUES_AFTER_DELETE + 1} times while it waited: post it again")

    @app.get("/v1/plans", summary="Recent plans, newest first", response_model=PlanList,
             responses=_error_responses(401, 422))
    async def list_plans(
        request: Request,
        limit: int = Query(20, ge=1, le=100, description="Plans per page."),
        cursor: str | None = Query(None, description="next_cursor of the previous page.",
                                   json_schema_extra={"pattern": CURSOR_PATTERN}),
    ):
        if cursor is not None and not re.fullmatch(CURSOR_PATTERN, cursor):
            shown = f"{cursor[:30]!r}" + ("..." if len(cursor) > 30 else "")
            raise invalid([Issue("query.cursor", f"must be the next_cursor of an earlier page (up to 18 digits), "
                                                 f"not {shown}; leave it out for the first page")])
        return JSONResponse(service(request).list(limit, cursor))

    @app.get("/v1/plans/{plan_id}", summary="A plan's status, and its schedule when done", response_model=PlanStatus,
             responses=_error_responses(401, 404))
    async def get_plan(request: Request, plan_id: str):
        # On the event loop, not the thread pool: one WAL read by primary key (readers never wait for the
        # writer) costs less than the hop to a thread, and status calls are the ones that must stay fast.
        svc = service(request)
        return Response(svc.render_json(svc.get_row(plan_id)), media_type="application/json")

    @app.post("/v1/plans/{plan_id}/cancel", summary="Cancel a queued or running plan; it stays, as cancelled",
              response_model=PlanStatus, responses=_error_responses(401, 404, 409))
    def cancel_plan(request: Request, plan_id: str):
        svc = service(request)
        return Response(svc.render_json(svc.cancel(plan_id)), media_type="application/json")

    @app.delete("/v1/plans/{plan_id}", summary="Forget a plan (cancelled first if it runs): afterwards it is 404",
                status_code=204, response_class=Response,
                responses={204: {"description": "Deleted."}, **_error_responses(401, 404)})
    def delete_plan(request: Request, plan_id: str):
        service(request).delete(plan_id)
        return Response(status_code=204)

    @app.get("/v1/plans/{plan_id}/trace", summary="Chrome trace of the plan's simulated step (Perfetto)",
             responses=_error_responses(401, 404, 409, 503))
    async def plan_trace(request: Request, plan_id: str) -> dict:
        svc = service(request)
        row, profile_json = await run_in_threadpool(svc.replay_inputs, plan_id)
        return Response(await svc.trace_json(row, profile_json), media_type="application/json")

    @app.get("/v1/plans/{plan_id}/memory.png", summary="Device memory over the step, with the budget line",
             response_class=Response,
             responses={200: {"content": {"image/png": {}}, "description": "PNG picture."},
                        **_error_responses(401, 404, 409, 503)})
    async def plan_memory(request: Request, plan_id: str):
        svc = service(request)
        row, profile_json = await run_in_threadpool(svc.replay_inputs, plan_id)
        return Response(await svc.memory_png(row, profile_json), media_type="image/png")

    @app.get("/v1/plans/{plan_id}/view", summary="The plan viewer: streams, memory and decisions on one page",
             response_class=Response,
             responses={200: {"content": {"text/html": {}}, "description": "A self-contained HTML page."},
                        **_error_responses(401, 404, 409, 503)})
    async def plan_view(request: Request, plan_id: str):
        svc = service(request)
        row, profile_json = await run_in_threadpool(svc.replay_inputs, plan_id)
        return Response(await svc.view_html(row, profile_json), media_type="text/html; charset=utf-8",
                        headers=VIEW_HEADERS)

    add_max_batch_routes(app, _error_responses, _json_body)

    # Simulation ------------------------------------------------------------------

    @app.post("/v1/simulate", summary="Replay a schedule: figures, or the first violation",
              response_model=SimulateResponse, responses=_error_responses(401, 413, 422, 503),
              openapi_extra=_json_body("SimulateRequest"))
    async def simulate_schedule(request: Request):
        raw = await request.body()
        return JSONResponse(await service(request).simulate(raw))

    # Operations ------------------------------------------------------------------

    @app.get("/healthz", summary="Liveness, and what this server offers", response_model=Health)
    async def healthz(request: Request):
        svc = service(request)
        return {
            "status": "ok",
            "version": PLANNER_VERSION,
            "strategies": sorted(load_all()),
            "backend": settings.backend,
            "solve_processes": settings.solve_processes,
            "solve_processes_ready": svc.queue.ready,
            "queue_depth": svc.queue.depth,
            "solves_running": svc.queue.running,
        }

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format."},
                        **_error_responses(401)})
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _, definitions = models_json_schema(
            [(PlanRequest, "validation"), (SimulateRequest, "validation"), (MaxBatchRequest, "validation")],
            ref_template="#/components/schemas/{model}",
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in definitions.get("$defs", {}).items():
            components.setdefault(name, definition)
        if settings.token is not None:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
        app.openapi_schema = refine_openapi(schema, settings, load_all(), OPEN_PATHS)
        return schema

    app.openapi = openapi
    return app

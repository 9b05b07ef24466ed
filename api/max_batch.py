"""`POST /v1/max-batch`: the largest batch of a reference network that fits a named GPU, on the service.

A search is `planner.max_batch` driven from a thread of the server, and every
solve it asks for is an ordinary plan of this service: the estimated profile
(made in an estimator process started with the first search: torch lives
there, not in the server nor the request processes) is queued like any POSTed one,
so it runs in the solve processes under the same limits (each solve at most
`max_time_limit_s`, `max_solver_workers` threads), is answered from the store
when the same profile, budget, strategy and limits were planned before (a
repeated search costs little more than estimating its profiles), and is
cancelled with the search. Each probe's plan id is in the answer, so its
schedule, trace and memory picture are at `/v1/plans/{id}`.

The request is checked before it is accepted, without torch (names, limits,
strategies); what needs the model (its first profile: options it refuses, its
node count against `max_nodes`) is checked as the search's first step, and
answered as the request's 4xx when that happens within `wait_s` (else the
search fails with the same `issues`).

The search's own record (status, progress, result) is kept in memory, the
last `KEPT_SEARCHES`; after a restart a repeated request runs again from the
stored plans. Only estimated models: a measured workload would run the user's
code in the service.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.process
import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import math
import multiprocessing
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

import planner
from api.errors import ApiError, invalid, over_limit
from api.http_rules import refuse_if_shutting_down
from api.settings import Settings
from planner.errors import Issue, MososError
from planner.max_batch import DEFAULT_BATCH_LIMIT, DEFAULT_STRATEGIES, MAX_BATCH_LIMIT
from planner.units import MAX_SIZE_BYTES
from planner.validation import NumbersAreNumbers
# Imports inside functions here are deferred for start-up time: the planner's strategies (OR-Tools), the estimator and
# the request processes' helpers load when a search runs, not when the server starts.

log = logging.getLogger("mosos.api")
KEPT_SEARCHES = 256
QUEUE_RETRY_S = 0.5
STOP_GRACE_S = 2.0  # past the search's deadline, a solve still queued or running is cancelled
MIN_SEARCH_S = 1.0  # what a search needs left after the first estimate: each strategy gets a share of it
SearchState = Literal["queued", "running", "done", "failed", "cancelled"]


class MaxBatchRequest(NumbersAreNumbers):
    """For each strategy, the largest batch of `model` whose plan fits `budget_bytes` (default: the GPU's memory)
    within `max_overhead` over each batch's lower bound."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=100, description="Reference network (see `mosos estimate --list`).")
    gpu: str = Field(min_length=1, max_length=100, description="GPU key: titanx, p40, p100, v100, a100, h100.")
    budget_bytes: int | None = Field(default=None, gt=0, le=MAX_SIZE_BYTES, description="Default: the GPU's memory.")
    strategies: list[str] = Field(default_factory=lambda: list(DEFAULT_STRATEGIES), min_length=1, max_length=16)
    max_overhead: Annotated[float, Field(ge=0)] | Literal["forward"] | None = Field(
        default=0.1, description="Fraction over each batch's lower bound (0.1 = 10%), 'forward' (one extra forward "
        "pass, Checkmate's ceiling) or null (no limit).")
    time_limit_s: float | None = Field(default=None, gt=0, description="The whole search; default min(120 s, the "
                                       "server's max_search_time_s).")
    workers: int | None = Field(default=None, ge=1, description="Solver threads per solve; capped by the server.")
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    batch_limit: int = Field(default=DEFAULT_BATCH_LIMIT, ge=1, le=MAX_BATCH_LIMIT)
    throughput_probes: int = Field(default=6, ge=0, le=16)
    # Bounded so that batch 1 of every model estimates within the profile's bounds (an operation's time at most
    # 10^7 ms): attention grows with the square of the tokens, convolutions with the image's area.
    image_size: int | None = Field(default=None, ge=1, le=8192, description="Images: side in pixels (default 224, "
                                   "U-Net 256).")
    tokens: int | None = Field(default=None, ge=1, le=65536, description="Transformer: sequence length.")
    small: StrictBool = False
    math: Literal["fp32", "tf32"] = "fp32"
    optimizer: Literal["sgd", "sgd-momentum", "adam"] = "sgd-momentum"
    wait_s: float | None = Field(default=None, ge=0, description="Answer 200 if done within this many seconds, else 202.")

    @field_validator("max_overhead", mode="before")
    @classmethod
    def _overhead(cls, value):
        wrong = isinstance(value, bool) or (isinstance(value, str) and value != "forward") or (
            isinstance(value, (int, float)) and not (math.isfinite(value) and value >= 0))
        if wrong:
            raise ValueError(f"an overhead limit is a fraction of 0 or more (0.1 for 10%), 'forward' or null, "
                             f"not {value!r}")
        return value


class MaxBatchStatus(BaseModel):
    id: str
    status: SearchState
    cached: bool = False
    request: dict[str, Any]
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    progress: dict[str, Any] | None = Field(default=None, description="The latest batch tried while running.")
    result: dict[str, Any] | None = Field(default=None, description="planner.max_batch's result; each probe carries "
                                          "the plan_id of its solve (GET /v1/plans/{plan_id}).")
    reason: str | None = None
    issues: list[dict[str, str]] = Field(default_factory=list, description="A request found bad after it was "
                                         "accepted (once its model was estimated): one path and sentence each.")
    links: dict[str, str]


# In the request processes ---------------------------------------------------------------------------------------


def parse_request(raw: bytes) -> dict:
    """Validate a max-batch request against the schema and the server's limits; estimate batch 1 to check it."""
    from api.work import _current_settings, read_json_body, validate
    from planner.strategies import load_all

    settings = _current_settings()
    request: MaxBatchRequest = validate(MaxBatchRequest, read_json_body(raw, "max-batch request"))
    limit = settings.max_search_time_s
    time_limit_s = request.time_limit_s if request.time_limit_s is not None else min(120.0, limit)
    if time_limit_s > limit:
        raise over_limit(422, "time_limit_s", f"{time_limit_s:g} s is above this server's limit max_search_time_s = "
                         f"{limit:g} s", "max_search_time_s", limit)
    workers = request.workers if request.workers is not None else settings.max_solver_workers
    if workers > settings.max_solver_workers:
        raise over_limit(422, "workers", f"{workers} solver threads is above this server's limit max_solver_workers = "
                         f"{settings.max_solver_workers}", "max_solver_workers", settings.max_solver_workers)
    wait_s = request.wait_s if request.wait_s is not None else settings.effective_default_wait_s()
    if wait_s > settings.max_wait_s:
        raise over_limit(422, "wait_s", f"{wait_s:g} s is above this server's limit max_wait_s = "
                         f"{settings.max_wait_s:g} s", "max_wait_s", settings.max_wait_s)
    registry = load_all()
    strategies = list(dict.fromkeys(request.strategies))
    for index, name in enumerate(request.strategies):
        info = registry.get(name)
        if info is None:
            raise invalid([Issue(f"strategies[{index}]", f"unknown strategy {name!r}; known: {', '.join(sorted(registry))}")])
        if not info.uses_budget and name != "keep-all":
            raise invalid([Issue(f"strategies[{index}]", f"strategy {name!r} plans without a budget: it has no "
                                 "largest batch")])
    from models.gpus import GPUS
    from models.names import MODEL_NAMES

    # Exact names, as the OpenAPI document's enums state them (the CLI is the lenient one: `VGG-19`, `V100`).
    if request.model not in MODEL_NAMES:
        raise invalid([Issue("model", f"unknown model {request.model!r}; known: {', '.join(MODEL_NAMES)}")])
    if request.gpu not in GPUS:
        raise invalid([Issue("gpu", f"unknown GPU {request.gpu!r}; known: {', '.join(GPUS)}")])
    if importlib.util.find_spec("torch") is None:
        raise ApiError(501, "not_available", "this server cannot estimate models: torch is not installed where it "
                       "runs (pip install torch, a CPU build is enough)")
    options = {
        "model": request.model, "gpu": request.gpu, "budget_bytes": request.budget_bytes, "strategies": strategies,
        "max_overhead": request.max_overhead, "time_limit_s": float(time_limit_s), "workers": int(workers),
        "seed": request.seed, "batch_limit": request.batch_limit, "throughput_probes": request.throughput_probes,
        "image_size": request.image_size, "tokens": request.tokens, "small": request.small, "math": request.math,
        "optimizer": request.optimizer,
    }
    canonical = json.dumps({"planner_version": planner.__version__, **options}, sort_keys=True, separators=(",", ":"))
    return {"options": options, "wait_s": wait_s, "request_hash": hashlib.sha256(canonical.encode()).hexdigest()}


def estimate_profile_json(options: dict, batch: int) -> str:
    """The estimated profile at `batch`; the first batches' failures are the request's errors, at their path."""
    from models.estimator import estimate

    try:
        # torch.fx prints a traceback before some failures it then raises: the error says it, the log need not
        with contextlib.redirect_stderr(io.StringIO()):
            profile = estimate(options["model"], batch, options["gpu"], image_size=options["image_size"],
                               tokens=options["tokens"], small=options["small"], math=options["math"],
                               optimizer=options["optimizer"])
    except MososError as error:  # EstimateError, TraceFailure
        if batch > 2:
            raise  # a batch the search reached is out of the estimator's bounds: the search's business
        text = str(error)
        path = "image_size" if "image size" in text else ("tokens" if "token" in text else "model")
        raise invalid([Issue(path, f"cannot estimate batch {batch}: {text}")]) from None
    return profile.to_json(indent=None)


# In the server --------------------------------------------------------------------------------------------------


@dataclass
class Search:
    id: str
    request_hash: str
    options: dict[str, Any]
    created_at: float
    status: str = "queued"
    started_at: float | None = None
    finished_at: float | None = None
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    reason: str | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    job_id: str | None = None
    invalid: ApiError | None = None  # the request turned out bad once its first profile was estimated
    plan_ids: dict[tuple[str, str], str] = field(default_factory=dict)  # (strategy, profile digest) -> plan id

    def render(self, cached: bool = False) -> dict:
        return {
            "id": self.id, "status": self.status, "cached": cached, "request": self.options,
            "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
            "progress": self.progress if self.status in ("queued", "running") else None, "result": self.result,
            "reason": self.reason, "issues": [{"path": i.path, "message": i.message} for i in self.invalid.issues]
            if self.invalid is not None else [], "links": {"self": f"/v1/max-batch/{self.id}"},
        }


class EstimatorProcess:
    """One process, started on the first search, that estimates the searches' profiles (torch lives there).

    Not the request processes: a first estimate imports torch and traces the model (seconds on a busy machine),
    and requests queued behind it would wait. Lower priority than the server, dies with it.
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._stopped = False

    def _started(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._stopped:
                raise MososError("the server is stopping")
            if self._executor is None:
                from api.solver import become_child

                self._executor = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=become_child,
                    initargs=(os.getpid(), self.settings.request_nice))
            return self._executor

    def profile_json(self, options: dict, batch: int, timeout_s: float) -> str:
        executor = self._started()
        try:
            return executor.submit(estimate_profile_json, options, batch).result(timeout=timeout_s)
        except concurrent.futures.process.BrokenProcessPool:
            with self._lock:
                if self._executor is executor:
                    self._executor = None  # a fresh one for the next estimate
            raise MososError("the estimator process died while estimating this profile") from None
        except concurrent.futures.TimeoutError:
            raise MososError(f"estimating the profile at batch {batch} took more than {timeout_s:.0f} s") from None

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


def _settled(search: Search) -> bool:
    """A done search every strategy of which ended on its own, not stopped by the time limit: an answer to serve
    again. One the timer cut short (`stopped_by`) is kept but searched anew for an identical request, as a plan
    without a proof is (its proven solves come from the store)."""
    return all(not row.get("stopped_by") for row in (search.result or {}).get("strategies", []))


class MaxBatchSearches:
    """The searches of one server: start, look up, cancel; each runs `planner.max_batch` in its own thread."""

    def __init__(self, service, settings: Settings):
        self.service = service
        self.settings = settings
        self._lock = threading.Lock()
        self._searches: dict[str, Search] = {}
        self._stopping = False
        self.estimator = EstimatorProcess(settings)

    # Requests ----------------------------------------------------------------------------------------

    async def start(self, raw: bytes) -> tuple[Search, bool, float]:
        parsed = await self.service.pool.run(parse_request, raw)
        with self._lock:
            if self._stopping:
                raise ApiError(503, "stopping", "the server is stopping")
            for search in reversed(list(self._searches.values())):
                if search.request_hash == parsed["request_hash"] and (
                        search.status in ("queued", "running") or search.status == "done" and _settled(search)):
                    return search, search.status == "done", parsed["wait_s"]
            active = sum(1 for s in self._searches.values() if s.status in ("queued", "running"))
            if active >= max(1, self.settings.queue_size):
                raise ApiError(429, "queue_full", f"{active} max-batch searches are running, this server's limit "
                               f"(queue_size = {self.settings.queue_size}); retry later", limit="queue_size",
                               limit_value=self.settings.queue_size, headers={"Retry-After": "10"})
            search = Search(id=uuid.uuid4().hex, request_hash=parsed["request_hash"], options=parsed["options"],
                            created_at=time.time())
            self._searches[search.id] = search
            self._forget_old()
        threading.Thread(target=self._run, args=(search,), name=f"mosos-max-batch-{search.id[:8]}",
                         daemon=True).start()
        return search, False, parsed["wait_s"]

    def get(self, search_id: str) -> Search:
        search = self._searches.get(search_id)
        if search is None:
            raise ApiError(404, "not_found", f"no max-batch search with id {search_id!r} (searches are kept in memory, "
                           f"the last {KEPT_SEARCHES}; POST the request again: its solves come from the store)")
        return search

    def cancel(self, search_id: str) -> Search:
        search = self.get(search_id)
        if search.status in ("done", "failed"):
            raise ApiError(409, "conflict", f"max-batch search {search_id} has already ended ({search.status})")
        search.cancelled.set()
        if search.job_id is not None:
            self.service.queue.cancel(search.job_id)
        search.finished.wait(timeout=self.settings.cancel_grace_s + 2)
        return search

    def delete(self, search_id: str) -> None:
        """Forget a search, cancelled first if it runs; its solves stay plans of the service."""
        search = self.get(search_id)
        if search.status not in ("done", "failed", "cancelled"):
            self.cancel(search_id)
        with self._lock:
            self._searches.pop(search_id, None)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            searches = list(self._searches.values())
        for search in searches:
            search.cancelled.set()
        for search in searches:
            search.finished.wait(timeout=2)
        self.estimator.stop()

    def _forget_old(self) -> None:
        ended = [s for s in self._searches.values() if s.status in ("done", "failed", "cancelled")]
        for search in ended[: max(0, len(self._searches) - KEPT_SEARCHES)]:
            self._searches.pop(search.id, None)

    # The search thread -------------------------------------------------------------------------------

    def _run(self, search: Search) -> None:
        from planner.max_batch import max_batch
        from planner.profile import parse_profile

        options = search.options
        search.status, search.started_at = "running", time.time()
        deadline = time.monotonic() + options["time_limit_s"]

        digests: dict[int, str] = {}
        first: dict[int, Any] = {}

        def estimated(batch: int):
            text = self.estimator.profile_json(options, batch, max(120.0, deadline - time.monotonic() + STOP_GRACE_S))
            profile = parse_profile(json.loads(text), f"estimated profile at batch {batch}")
            digests[batch] = profile.digest()
            return profile

        def profile_for_batch(batch: int):
            made = first.get(batch)
            if isinstance(made, ApiError):
                raise MososError(made.message)
            if made is not None:
                return made
            try:
                return estimated(batch)
            except ApiError as error:
                raise MososError(error.message) from None

        # First the request's own checks that need the model: batch 1 (or 2: batch norm over one value) and its size
        try:
            try:
                first[1] = estimated(1)
            except ApiError as error:
                first[1] = error
                try:
                    first[2] = estimated(2)
                except ApiError:
                    raise error from None
            nodes = len(next(p for p in first.values() if not isinstance(p, ApiError)).nodes)
            if nodes > self.settings.max_nodes:
                raise over_limit(413, "model", f"the estimated profile has {nodes} nodes, above this server's limit "
                                 f"max_nodes = {self.settings.max_nodes}", "max_nodes", self.settings.max_nodes)
        except ApiError as error:
            search.invalid = error
            self._finish(search, "failed", reason=error.message)
            return
        except Exception as error:  # the request processes are gone (server stopping) or a bug
            self._finish(search, "failed", reason=f"cannot estimate the model: {type(error).__name__}: {error}")
            return

        def progress(event: dict) -> None:
            search.progress = {key: value for key, value in event.items() if isinstance(value, (str, int, float))
                               or value is None}

        def stop_search() -> bool:
            return search.cancelled.is_set() or self._stopping

        remaining = deadline - time.monotonic()  # estimating the first profile was part of the search's time
        if remaining < MIN_SEARCH_S:
            spent = options["time_limit_s"] - remaining
            self._finish(search, "failed", reason=f"{max(remaining, 0):.2f} s of the time limit "
                         f"({options['time_limit_s']:g} s) was left after estimating the model's first profile "
                         f"({spent:.2f} s), and a search needs at least {MIN_SEARCH_S:g} s: give a time_limit_s of "
                         f"{max(5, math.ceil(2 * (spent + MIN_SEARCH_S))):g} s or more")
            return
        try:
            result = max_batch(
                profile_for_batch, options["budget_bytes"], strategies=options["strategies"],
                max_overhead=options["max_overhead"], time_limit_s=remaining,
                workers=options["workers"], seed=options["seed"], batch_limit=options["batch_limit"],
                throughput_probes=options["throughput_probes"], progress=progress, should_stop=stop_search,
                solve=lambda profile, budget, **solve_options: self._solve(search, deadline, profile, budget,
                                                                           **solve_options),
            )
        except MososError as error:
            self._finish(search, "failed", reason=str(error))
            return
        except Exception as error:  # a bug must not leave a search running forever
            log.exception("max-batch search %s failed", search.id)
            self._finish(search, "failed", reason=f"internal error: {type(error).__name__}: {error}")
            return
        document = result.model_dump(mode="json")
        for raw in document["strategies"]:
            for raw_probe in raw["probes"]:
                digest = digests.get(raw_probe["batch_size"])
                raw_probe["plan_id"] = search.plan_ids.get((raw["strategy"], digest))
            raw["plan_id"] = next((p["plan_id"] for p in raw["probes"] if p["batch_size"] == raw["max_batch_size"]),
                                  None)
        if result.stopped or search.cancelled.is_set():
            self._finish(search, "cancelled", result=document, reason="cancelled by request"
                         if search.cancelled.is_set() else "the server stopped")
        elif all(row.max_batch_size is None and row.stopped_by for row in result.strategies):
            # starved by the timer, not an answer: failed, so that the same request is searched again, not served
            self._finish(search, "failed", result=document, reason=(
                f"the time limit ({options['time_limit_s']:g} s) ran out before any strategy solved a batch "
                f"({result.strategies[0].stopped_by}): give a time_limit_s of "
                f"{math.ceil(2.5 * options['time_limit_s']):g} s or more"))
        else:
            self._finish(search, "done", result=document)

    def _finish(self, search: Search, status: str, *, result: dict | None = None, reason: str | None = None) -> None:
        search.status, search.result, search.reason = status, result, reason
        search.finished_at = time.time()
        search.finished.set()

    def _solve(self, search: Search, deadline: float, profile, budget_bytes: int, *, strategy: str,
               time_limit_s: float, workers: int | None, seed: int, should_stop=None):
        """One probe as a plan of this service: queued (or found in the store), waited for, read back.

        The probe's own time limit is enforced by the solve process; this waits until the plan ends, the search is
        cancelled, or the search's deadline has passed by STOP_GRACE_S (the plan is then cancelled).
        """
        from api.jobs import QueueFull, ServiceStopping
        from api.work import ParsedPlan, plan_request_hash
        from planner.errors import InfeasibleBudget
        from planner.schedule import parse_schedule

        svc = self.service
        plan_options = {
            "budget_bytes": int(budget_bytes), "memory_ratio": None, "strategy": strategy,
            "time_limit_s": float(min(time_limit_s, self.settings.max_time_limit_s)),
            "workers": int(workers) if workers is not None else self.settings.max_solver_workers, "seed": int(seed),
        }
        digest = profile.digest()
        parsed = ParsedPlan(request_hash=plan_request_hash(digest, plan_options), options=plan_options, wait_s=0.0,
                            profile_json=profile.to_json(indent=None), profile_digest=digest,
                            profile_name=profile.name, node_count=len(profile.nodes))

        def give_up() -> bool:
            return search.cancelled.is_set() or self._stopping or time.monotonic() > deadline + STOP_GRACE_S

        stored = self._stored_elsewhere(parsed, digest)
        while stored is None:
            try:
                hit, job = svc.find_or_queue(parsed)
                break
            except QueueFull:
                if give_up():
                    raise InfeasibleBudget("not solved: the plan queue stayed full until the search's time ran out",
                                           proven=False) from None
                time.sleep(QUEUE_RETRY_S)
            except ServiceStopping:
                raise MososError("the server is stopping") from None
        if stored is not None:
            row = stored
        elif hit is not None:
            row = hit
        else:
            search.job_id = job.id
            while not job.finished.wait(0.05):
                if give_up():
                    svc.queue.cancel(job.id)
                    break
            search.job_id = None
            row = svc.get_row(job.id)
        search.plan_ids[(strategy, digest)] = row.id
        if row.status == "done" and row.feasible and row.schedule_json:
            return parse_schedule(json.loads(row.schedule_json))
        if row.status == "done":
            raise InfeasibleBudget(row.reason or "no plan within the budget", minimum_budget_bytes=row.minimum_budget_bytes)
        if row.status == "cancelled":
            raise InfeasibleBudget(f"not solved: {row.reason or 'cancelled'}", proven=False)
        raise MososError(f"the solve failed: {row.reason}")


    def _stored_elsewhere(self, parsed, digest: str):
        """A stored plan of the same profile, budget, strategy, workers and seed under another time limit of the
        search's ladder that answers this probe as well: solved with more time, or (with less) a heuristic's plan or
        one proven optimal. Searches split their time by what is left, so the same probe can come with different
        limits; this lets a repeated search reuse what an earlier one solved."""
        from api.work import plan_request_hash
        from planner.max_batch import TIME_LADDER_S

        requested = parsed.options["time_limit_s"]
        steps = sorted((t for t in TIME_LADDER_S if t <= self.settings.max_time_limit_s and t != requested),
                       key=lambda t: (t < requested, abs(t - requested)))
        for step in steps:
            row = self.service.store.find_done(plan_request_hash(digest, {**parsed.options, "time_limit_s": float(step)}))
            if row is None:
                continue
            if step < requested:
                if not (row.feasible and row.schedule_json):
                    continue
                solver = (json.loads(row.schedule_json).get("summary") or {}).get("solver")
                if solver is not None and solver.get("status") != "OPTIMAL":
                    continue
            self.service.metrics.cache_hits.inc()
            return row
        return None


def add_routes(app, error_responses, json_body) -> None:
    """`POST /v1/max-batch`, `GET` and `DELETE /v1/max-batch/{id}` on `app` (its state holds `max_batch`)."""

    def searches(request: Request) -> MaxBatchSearches:
        return request.app.state.max_batch

    def answer(search: Search, cached: bool = False, status_code: int = 200) -> Response:
        headers = {"Location": f"/v1/max-batch/{search.id}"} if status_code == 202 else None
        return Response(json.dumps(search.render(cached)), status_code=status_code, media_type="application/json",
                        headers=headers)

    @app.post(
        "/v1/max-batch",
        summary="The largest batch of a reference network that fits a GPU, per strategy",
        response_model=MaxBatchStatus,
        responses={202: {"model": MaxBatchStatus, "description": "Not done within wait_s: poll the Location."},
                   **error_responses(401, 413, 422, 429, 501, 503)},
        openapi_extra=json_body("MaxBatchRequest", {"model": "vgg19", "gpu": "v100", "strategies": ["chen-sqrt",
                                "recompute-only"], "max_overhead": "forward", "time_limit_s": 60, "wait_s": 60}),
    )
    async def create_search(request: Request):
        """Every solve is a plan of this service (see each probe's plan_id); 200 when done within `wait_s`."""
        search, cached, wait_s = await searches(request).start(await request.body())
        deadline = time.monotonic() + wait_s
        while not search.finished.is_set() and time.monotonic() < deadline:
            refuse_if_shutting_down(request, f"/v1/max-batch/{search.id}")
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if search.invalid is not None:  # found bad once the model was estimated, within wait_s: the request's error
            raise search.invalid
        return answer(search, cached, 200 if search.finished.is_set() else 202)

    @app.get("/v1/max-batch/{search_id}", summary="A max-batch search: progress while running, the result when done",
             response_model=MaxBatchStatus, responses=error_responses(401, 404))
    async def get_search(request: Request, search_id: str):
        return answer(searches(request).get(search_id))

    @app.post("/v1/max-batch/{search_id}/cancel", summary="Cancel a running max-batch search (and its solve); it "
              "stays, as cancelled", response_model=MaxBatchStatus, responses=error_responses(401, 404, 409))
    def cancel_search(request: Request, search_id: str):
        return answer(searches(request).cancel(search_id))

    @app.delete("/v1/max-batch/{search_id}", summary="Forget a search (cancelled first if it runs): afterwards it "
                "is 404", status_code=204, response_class=Response,
                responses={204: {"description": "Deleted."}, **error_responses(401, 404)})
    def delete_search(request: Request, search_id: str):
        searches(request).delete(search_id)
        return Response(status_code=204)

"""The job queue: a bounded list of waiting plans, solved by a backend (local processes or Ray).

One supervisor thread drives the backend (`api.backend`): it hands a waiting
plan to a free slot, records what comes back (one store transaction per
result), fails the plan of a process that died, and has the backend kill a
solve that overran its time limit or does not stop after a cancel. Request
threads only append, look and cancel.
"""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from api.backend import Event, LocalProcesses, SolveBackend
from api.metrics import Metrics
from api.settings import Settings
from api.store import Store
# Imports inside functions here are deferred for start-up time: Ray's backend is imported when a server asks for it:
# Ray takes seconds to import.

log = logging.getLogger("mosos.api")

PROGRESS_SAVE_INTERVAL_S = 1.0


class QueueFull(Exception):
    def __init__(self, retry_after_s: int, queue_size: int):
        self.retry_after_s = retry_after_s
        self.queue_size = queue_size
        super().__init__(f"the plan queue is full ({queue_size} waiting, the limit queue_size); retry later")


class ServiceStopping(Exception):
    pass


@dataclass
class Job:
    seq: int
    id: str
    request_hash: str
    strategy: str
    time_limit_s: float
    task: dict[str, Any]
    status: str = "queued"
    started_monotonic: float | None = None
    started_at: float | None = None
    progress: dict[str, Any] | None = None
    progress_saved: float = 0.0
    cancel_requested: float | None = None
    finished: threading.Event = field(default_factory=threading.Event)


def make_backend(settings: Settings) -> SolveBackend:
    if settings.backend == "ray":
        from api.ray_backend import RayBackend  # imports Ray only when asked for

        return RayBackend(settings)
    return LocalProcesses(settings)


class JobQueue:
    def __init__(self, store: Store, settings: Settings, metrics: Metrics, backend: SolveBackend | None = None):
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.backend = backend if backend is not None else make_backend(settings)
        self._lock = threading.RLock()
        self._pending: collections.deque[Job] = collections.deque()
        self._active: dict[str, Job] = {}
        self._running: dict[int, Job] = {}  # seq -> job, handed to the backend
        self._wake_reader, self._wake_writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
        self._wake_lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # Lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start the backend (it waits until it can solve), then the supervisor."""
        self.backend.start()
        self._thread = threading.Thread(target=self._supervise, name="mosos-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            for job in list(self._pending):
                self._finish(job, "failed", reason="the server stopped before this plan was solved")
            self._pending.clear()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for job in list(self._running.values()):
            if job.status in ("queued", "solving"):
                self._finish(job, "failed", reason="the server stopped while this plan was solving")
        self._running.clear()
        self.backend.stop()

    # What request threads call ----------------------------------------------

    @property
    def lock(self) -> threading.RLock:
        """Held while a request is matched against the store and the queue, so identical requests solve once."""
        return self._lock

    @property
    def depth(self) -> int:
        return len(self._pending)

    @property
    def ready(self) -> int:
        return self.backend.ready

    @property
    def capacity(self) -> int:
        return self.backend.capacity

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, *, insert, request_hash: str, strategy: str, time_limit_s: float, task: dict[str, Any]) -> Job:
        """Queue a plan: `insert()` stores its row (under the queue lock, so a rejected plan stores nothing)."""
        with self._lock:
            if self._stopping:
                raise ServiceStopping("the server is stopping")
            free = self.backend.capacity - len(self._running)
            if len(self._pending) >= self.settings.queue_size + free:
                raise QueueFull(self._retry_after_s(), self.settings.queue_size)
            row = insert()
            job = Job(
                seq=row.seq,
                id=row.id,
                request_hash=request_hash,
                strategy=strategy,
                time_limit_s=time_limit_s,
                task={**task, "seq": row.seq, "id": row.id},
            )
            self._pending.append(job)
            self._active[job.id] = job
            self.metrics.queue_depth.set(len(self._pending))
        self._wake()
        return job

    def find_active(self, request_hash: str) -> Job | None:
        with self._lock:
            for job in self._active.values():
                if job.request_hash == request_hash and job.cancel_requested is None:
                    return job
        return None

    def get(self, plan_id: str) -> Job | None:
        """Lock-free (a dict read is atomic): status calls never wait for a result being written."""
        return self._active.get(plan_id)

    def cancel(self, plan_id: str, *, forget: bool = False) -> bool:
        """Cancel a queued or running plan; False if it is not active here. With `forget`, its row is deleted in
        the same step as the cancel, so a request waiting on the plan never reads it as cancelled: it finds it
        gone (and is queued again)."""
        with self._lock:
            job = self._active.get(plan_id)
            if job is None:
                return False
            if job in self._pending:
                self._pending.remove(job)
                self.metrics.queue_depth.set(len(self._pending))
            else:
                job.cancel_requested = time.monotonic()
                if self._running.get(job.seq) is job:
                    self.backend.request_stop(job.seq)
            self._finish(job, "cancelled", forget=forget, reason="cancelled by request")
            return True

    def _retry_after_s(self) -> int:
        """Seconds until a running solve should have ended at the latest."""
        now = time.monotonic()
        remaining = [job.time_limit_s - (now - (job.started_monotonic or now)) for job in self._running.values()]
        return int(min(60, max(1, math.ceil(min(remaining, default=1.0)))))

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_writer.send_bytes(b"w")
            except (OSError, ValueError):
                pass

    # The supervisor thread -----------------------------------------------------

    def _supervise(self) -> None:
        while not self._stopping:
            try:
                self._step()
            except Exception:  # keep supervising whatever happens; log it
                log.exception("supervisor step failed")
                time.sleep(0.2)

    def _step(self) -> None:
        events = self.backend.wait(0.2, self._wake_reader)
        while self._wake_reader.poll():
            self._wake_reader.recv_bytes()
        for event in events:
            self._handle(event)
        self._watch()
        self._dispatch()

    def _handle(self, event: Event) -> None:
        job = self._running.get(event.seq)
        if job is None:
            return
        kind, payload = event.kind, event.payload
        if kind == "started":
            job.started_monotonic = time.monotonic()
            if job.status == "queued":
                job.status = "solving"
                job.started_at = time.time()
                self.store.mark_solving(job.id)
        elif kind == "progress":
            job.progress = {**payload, "elapsed_s": round(time.monotonic() - (job.started_monotonic or time.monotonic()), 3)}
            if job.status == "solving" and time.monotonic() - job.progress_saved >= PROGRESS_SAVE_INTERVAL_S:
                job.progress_saved = time.monotonic()
                self.store.save_progress(job.id, job.progress)
        elif kind == "result":
            with self._lock:
                del self._running[event.seq]
            if job.cancel_requested is not None:
                return
            outcome = payload
            status = outcome["status"]
            self._finish(
                job,
                status,
                schedule_json=outcome.get("schedule_json"),
                feasible=outcome.get("feasible"),
                minimum_budget_bytes=outcome.get("minimum_budget_bytes"),
                proven=outcome.get("proven"),
                reason=outcome.get("reason"),
                solve_seconds=outcome.get("solve_seconds"),
            )
            label = "failed" if status == "failed" else ("feasible" if outcome.get("feasible") else "infeasible")
            self.metrics.solve_seconds.labels(strategy=job.strategy).observe(outcome.get("solve_seconds") or 0.0)
            self.metrics.solves.labels(strategy=job.strategy, outcome=label).inc()
        elif kind == "lost":
            with self._lock:
                del self._running[event.seq]
            if job.cancel_requested is None:
                self._finish(job, "failed", reason=payload.get("reason", "the solve process died while solving this plan"))
                self.metrics.solves.labels(strategy=job.strategy, outcome="failed").inc()

    def _finish(self, job: Job, status: str, *, forget: bool = False, **fields) -> None:
        """Record the end of a job in one transaction (or delete its row, when forgotten), then release waiters."""
        with self._lock:
            if job.finished.is_set():
                return
            if forget:
                self.store.delete(job.id)
            elif not self.store.finish(job.id, status, progress=job.progress, **fields):
                self._not_stored(job, status, fields)
            job.status = status
            self._active.pop(job.id, None)
            job.finished.set()
            if status == "cancelled":
                self.metrics.solves.labels(strategy=job.strategy, outcome="cancelled").inc()

    def _not_stored(self, job: Job, status: str, fields: dict) -> None:
        """An outcome whose row something else already ended (another server's recovery, a hand edit): never
        dropped without a word. The row is left as it is (a plan is written once); the log says what was lost."""
        row = self.store.get(job.id)
        if row is None:
            now = "deleted"
        else:
            now = row.status + (f": {row.reason}" if row.reason else "")
        outcome = status + ("" if fields.get("feasible") is None else (", feasible" if fields["feasible"] else ", infeasible"))
        log.error(
            "plan %s ended here (%s) but was not stored: its row is no longer queued or solving (now %s). Another "
            "server on this store, or a hand edit, ended it first; this outcome is lost",
            job.id, outcome, now,
        )
        self.metrics.results_not_stored.inc()

    def _watch(self) -> None:
        """Kill solves that ignore a cancel or run far past their time limit."""
        now = time.monotonic()
        for seq, job in list(self._running.items()):
            if job.cancel_requested is not None and now - job.cancel_requested > self.settings.cancel_grace_s:
                log.warning("plan %s did not stop %.1f s after its cancel; killing its solve process", job.id, self.settings.cancel_grace_s)
                with self._lock:
                    self._running.pop(seq, None)
                    self.backend.kill(seq)
            elif job.started_monotonic is not None and now - job.started_monotonic > self._kill_after_s(job):
                self._finish(
                    job,
                    "failed",
                    reason=f"the solve ran {self._kill_after_s(job):g} s, far past its time limit of {job.time_limit_s:g} s, "
                    "and was stopped",
                )
                self.metrics.solves.labels(strategy=job.strategy, outcome="failed").inc()
                with self._lock:
                    self._running.pop(seq, None)
                    self.backend.kill(seq)

    def _kill_after_s(self, job: Job) -> float:
        return self.settings.overrun_factor * job.time_limit_s + self.settings.overrun_grace_s

    def _dispatch(self) -> None:
        with self._lock:
            while self._pending and self.backend.free > 0:
                job = self._pending.popleft()
                self._running[job.seq] = job
                if not self.backend.submit(job.seq, job.task):
                    del self._running[job.seq]
                    self._pending.appendleft(job)
                    break
            self.metrics.queue_depth.set(len(self._pending))

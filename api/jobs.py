"""The job queue: a bounded list of waiting plans and a pool of solve processes.

One supervisor thread owns the processes' pipes: it hands a waiting plan to
an idle process, records what comes back (one store transaction per result),
and kills and replaces a process that died, overran its time limit, or does
not stop after a cancel. Request threads only append, look and cancel.
"""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from api.metrics import Metrics
from api.settings import Settings
from api.solver import worker_main
from api.store import Store

log = logging.getLogger("mosos.api")

PROGRESS_SAVE_INTERVAL_S = 1.0
STARTUP_TIMEOUT_S = 120.0


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


@dataclass
class _Worker:
    index: int
    process: Any
    connection: Any
    cancel_seq: Any
    ready: bool = False
    job: Job | None = None

    @property
    def idle(self) -> bool:
        return self.ready and self.job is None


class JobQueue:
    def __init__(self, store: Store, settings: Settings, metrics: Metrics):
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.RLock()
        self._pending: collections.deque[Job] = collections.deque()
        self._active: dict[str, Job] = {}
        self._workers: list[_Worker] = []
        self._wake_reader, self._wake_writer = self._context.Pipe(duplex=False)
        self._wake_lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # Lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start the solve processes and wait until each has loaded the strategies."""
        self._workers = [self._spawn(index) for index in range(self.settings.solve_processes)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for worker in self._workers:
            while not worker.ready:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not worker.connection.poll(remaining):
                    raise RuntimeError("a solve process did not start in time")
                kind, _, payload = worker.connection.recv()
                if kind == "broken":
                    raise RuntimeError(payload["reason"])
                worker.ready = kind == "ready"
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
        for worker in self._workers:
            if worker.job is not None and worker.job.status in ("queued", "solving"):
                self._finish(worker.job, "failed", reason="the server stopped while this plan was solving")
            try:
                worker.connection.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=2)
            worker.connection.close()

    def _spawn(self, index: int) -> _Worker:
        parent_end, child_end = self._context.Pipe(duplex=True)
        cancel_seq = self._context.Value("q", -1, lock=False)
        process = self._context.Process(
            target=worker_main,
            args=(child_end, cancel_seq, list(self.settings.plugins), os.getpid(), self.settings.solver_nice),
            name=f"mosos-solver-{index}",
            daemon=True,
        )
        process.start()
        child_end.close()
        return _Worker(index=index, process=process, connection=parent_end, cancel_seq=cancel_seq)

    def _replace(self, worker: _Worker) -> None:
        """Kill a solve process and start a fresh one in its slot."""
        try:
            worker.process.kill()
            worker.process.join(timeout=5)
        except Exception:  # already gone
            pass
        worker.connection.close()
        if not self._stopping:
            self._workers[worker.index] = self._spawn(worker.index)

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
        return sum(1 for worker in self._workers if worker.ready and worker.process.is_alive())

    @property
    def running(self) -> int:
        return sum(1 for worker in self._workers if worker.job is not None)

    def submit(self, *, insert, request_hash: str, strategy: str, time_limit_s: float, task: dict[str, Any]) -> Job:
        """Queue a plan: `insert()` stores its row (under the queue lock, so a rejected plan stores nothing)."""
        with self._lock:
            if self._stopping:
                raise ServiceStopping("the server is stopping")
            free = sum(1 for worker in self._workers if worker.job is None)
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

    def cancel(self, plan_id: str) -> bool:
        """Cancel a queued or running plan; False if it is not active here."""
        with self._lock:
            job = self._active.get(plan_id)
            if job is None:
                return False
            if job in self._pending:
                self._pending.remove(job)
                self.metrics.queue_depth.set(len(self._pending))
            else:
                job.cancel_requested = time.monotonic()
                for worker in self._workers:
                    if worker.job is job:
                        worker.cancel_seq.value = job.seq
            self._finish(job, "cancelled", reason="cancelled by request")
            return True

    def _retry_after_s(self) -> int:
        """Seconds until a running solve should have ended at the latest."""
        now = time.monotonic()
        remaining = [
            worker.job.time_limit_s - (now - (worker.job.started_monotonic or now))
            for worker in self._workers
            if worker.job is not None
        ]
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
        connections = {worker.connection: worker for worker in self._workers}
        ready = multiprocessing.connection.wait([self._wake_reader, *connections], timeout=0.2)
        for connection in ready:
            if connection is self._wake_reader:
                while self._wake_reader.poll():
                    self._wake_reader.recv_bytes()
                continue
            worker = connections[connection]
            try:
                while connection.poll():
                    self._handle(worker, connection.recv())
            except (EOFError, OSError):
                self._worker_died(worker)
        self._watch()
        self._dispatch()

    def _handle(self, worker: _Worker, message) -> None:
        kind, seq, payload = message
        if kind == "ready":
            worker.ready = True
            return
        if kind == "broken":
            log.error("solve process %d cannot start: %s", worker.index, payload.get("reason"))
            return
        job = worker.job
        if job is None or job.seq != seq:
            return
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
            worker.job = None
            worker.cancel_seq.value = -1
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
                reason=outcome.get("reason"),
                solve_seconds=outcome.get("solve_seconds"),
            )
            label = "failed" if status == "failed" else ("feasible" if outcome.get("feasible") else "infeasible")
            self.metrics.solve_seconds.labels(strategy=job.strategy).observe(outcome.get("solve_seconds") or 0.0)
            self.metrics.solves.labels(strategy=job.strategy, outcome=label).inc()

    def _finish(self, job: Job, status: str, **fields) -> None:
        """Record the end of a job in one transaction, then release waiters."""
        with self._lock:
            if job.finished.is_set():
                return
            if not self.store.finish(job.id, status, progress=job.progress, **fields):
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

    def _worker_died(self, worker: _Worker) -> None:
        job = worker.job
        worker.process.join(timeout=1)
        code = worker.process.exitcode
        log.warning("solve process %d died (exit code %s); starting another", worker.index, code)
        if job is not None and job.cancel_requested is None:
            self._finish(job, "failed", reason=f"the solve process died (exit code {code}) while solving this plan")
            self.metrics.solves.labels(strategy=job.strategy, outcome="failed").inc()
        with self._lock:
            self._replace(worker)

    def _watch(self) -> None:
        """Kill solves that ignore a cancel or run far past their time limit."""
        now = time.monotonic()
        for worker in list(self._workers):
            job = worker.job
            if not worker.process.is_alive():
                self._worker_died(worker)
                continue
            if job is None:
                continue
            if job.cancel_requested is not None and now - job.cancel_requested > self.settings.cancel_grace_s:
                log.warning("plan %s did not stop %.1f s after its cancel; killing its solve process", job.id, self.settings.cancel_grace_s)
                with self._lock:
                    worker.job = None
                    self._replace(worker)
            elif job.started_monotonic is not None and now - job.started_monotonic > self._kill_after_s(job):
                self._finish(
                    job,
                    "failed",
                    reason=f"the solve ran {self._kill_after_s(job):g} s, far past its time limit of {job.time_limit_s:g} s, "
                    "and was stopped",
                )
                self.metrics.solves.labels(strategy=job.strategy, outcome="failed").inc()
                with self._lock:
                    worker.job = None
                    self._replace(worker)

    def _kill_after_s(self, job: Job) -> float:
        return self.settings.overrun_factor * job.time_limit_s + self.settings.overrun_grace_s

    def _dispatch(self) -> None:
        with self._lock:
            for worker in self._workers:
                if not self._pending:
                    break
                if worker.idle and worker.process.is_alive():
                    job = self._pending.popleft()
                    worker.job = job
                    worker.cancel_seq.value = -1
                    try:
                        worker.connection.send(job.task)
                    except (OSError, ValueError):
                        self._pending.appendleft(job)
                        worker.job = None
            self.metrics.queue_depth.set(len(self._pending))

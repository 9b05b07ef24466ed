"""The service's solves as Ray tasks (`mosos serve --backend ray`), locally or on a cluster.

The same solve as a local solve process (`api.solver.solve_task`) runs in a
Ray task that asks for as many CPUs as the plan's solver threads. The task
reports its start and progress to a `SolveControl` actor and polls it for a
cancel (`cluster.remote`); this backend turns the actor's snapshot and the
tasks' results into the events `JobQueue` handles, so the store, cache,
cancel, progress and limits are the service's own. A solve that ignores a
cancel or overruns is stopped with `ray.cancel(force=True)`, which kills its
worker process; a worker that dies fails its plan, as a local process does
(no retry: the service's rule for a crashed solve).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import time
from typing import Any

from api.backend import Event, SolveBackend
from api.settings import Settings
# Imports inside functions here are deferred for start-up time: Ray workers import the planner and the cluster's
# helpers when they start, not with the server.

log = logging.getLogger("mosos.api")

SOLVE_TARGET = "api.ray_backend:solve_on_worker"
SNAPSHOT_INTERVAL_S = 0.2
WAIT_SLICE_S = 0.05
STARTUP_TIMEOUT_S = 300.0

_worker_state: dict[str, Any] = {"plugins": None, "nice": False}


def _prepare_worker(plugins: list[str], nice: int) -> None:
    """Once per Ray worker process: the server's plugins and strategies, and the solves' lower priority."""
    from api.solver import load_plugins
    from planner.strategies import load_all

    if _worker_state["plugins"] != plugins:
        load_plugins(plugins)
        _worker_state["plugins"] = list(plugins)
    load_all()
    if nice > 0 and not _worker_state["nice"]:
        try:
            os.nice(nice)
        except OSError:
            pass
        _worker_state["nice"] = True


def warm_up(plugins: list[str], nice: int) -> int:
    """A Ray task run at start-up: the first plan does not pay for the imports, and broken plugins show at once."""
    _prepare_worker(plugins, nice)
    return os.getpid()


def solve_on_worker(task: dict, send, should_stop) -> dict:
    """Runs in a Ray task: exactly a local solve process's solve, its progress sent to the control actor."""
    from api.solver import solve_task

    try:
        _prepare_worker(task.get("plugins") or [], task.get("nice", 0))
    except Exception as error:
        return {"status": "failed", "reason": f"cannot load plugins on the Ray worker: {error}", "solve_seconds": 0.0}

    def forward(message) -> None:
        kind, _, payload = message
        if kind == "progress":
            send(payload)

    return solve_task(task, forward, should_stop)


class RayBackend(SolveBackend):
    name = "ray"

    def __init__(self, settings: Settings):
        self.settings = settings
        self._session = None
        self._ray: Any = None
        self._control: Any = None
        self._references: dict[int, Any] = {}  # seq -> the solve task's object ref
        self._started: set[int] = set()
        self._reports: dict[int, int] = {}
        self._last_snapshot = 0.0
        self._up = False

    # Lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        from cluster.remote import new_control, plain_task
        from cluster.runtime import RayUnavailable, connect_in_own_thread

        try:
            self._session = connect_in_own_thread(
                self.settings.ray_address, what="mosos serve --backend ray", log_to_driver=True
            )
        except RayUnavailable as error:
            raise RuntimeError(str(error)) from None
        ray = self._ray = self._session.ray
        largest = self._session.largest_node_cpus()
        if self.settings.max_solver_workers > largest:
            self._session.close()
            raise RuntimeError(
                f"max_solver_workers = {self.settings.max_solver_workers} solver threads per solve, but the largest "
                f"Ray node has {largest:g} CPUs: such a solve could never start"
            )
        self._control = new_control(ray)
        warm = plain_task(ray, warm_up)
        count = max(1, min(self.settings.solve_processes, int(self._session.cpus) or 1))
        references = [warm.options(num_cpus=1, max_retries=0).remote(list(self.settings.plugins), self.settings.solver_nice)
                      for _ in range(count)]
        try:
            ray.get(references, timeout=STARTUP_TIMEOUT_S)
        except Exception as error:
            self._session.close()
            text = str(error).strip().splitlines()
            raise RuntimeError(f"the Ray workers cannot solve: {text[-1] if text else type(error).__name__}") from None
        self._up = True
        log.warning("mosos serve: solves run on %s, %d at once", self._session.where, self.settings.solve_processes)

    def stop(self) -> None:
        self._up = False
        if self._ray is None:
            return
        for reference in self._references.values():
            try:
                self._ray.cancel(reference, force=True)
            except Exception:
                pass
        self._references.clear()
        try:
            self._ray.kill(self._control)
        except Exception:
            pass
        self._session.close()

    # Slots -----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.settings.solve_processes

    @property
    def ready(self) -> int:
        return self.settings.solve_processes if self._up else 0

    @property
    def free(self) -> int:
        return self.settings.solve_processes - len(self._references) if self._up else 0

    def submit(self, seq: int, task: dict[str, Any]) -> bool:
        from cluster.remote import solve_task

        if not self._up or self.free <= 0:
            return False
        task = {**task, "plugins": list(self.settings.plugins), "nice": self.settings.solver_nice}
        self._references[seq] = solve_task(self._ray).options(
            num_cpus=task.get("workers") or 1, max_retries=0, name=f"mosos-plan-{seq}"
        ).remote(SOLVE_TARGET, task, self._control, seq, True)
        return True

    def request_stop(self, seq: int) -> None:
        if seq in self._references:
            self._control.cancel.remote(seq)

    def kill(self, seq: int) -> None:
        reference = self._references.pop(seq, None)
        if reference is not None:
            self._ray.cancel(reference, force=True)  # kills the worker process; Ray starts another when needed
            self._forget(seq)

    def _forget(self, seq: int) -> None:
        self._started.discard(seq)
        self._reports.pop(seq, None)
        self._control.forget.remote([seq])

    # Events --------------------------------------------------------------------------------------

    def wait(self, timeout_s: float, wake: Any) -> list[Event]:
        deadline = time.monotonic() + timeout_s
        while True:
            events = self._snapshot_events() + self._result_events()
            if events or time.monotonic() >= deadline:
                return events
            if multiprocessing.connection.wait([wake], timeout=min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))):
                return []

    def _snapshot_events(self, force: bool = False) -> list[Event]:
        if not self._references or (not force and time.monotonic() - self._last_snapshot < SNAPSHOT_INTERVAL_S):
            return []
        self._last_snapshot = time.monotonic()
        try:
            snapshot = self._ray.get(self._control.snapshot.remote(), timeout=10)
        except Exception as error:  # the actor is gone: results still arrive, progress does not
            log.error("the Ray solve control actor does not answer: %s", error)
            return []
        events: list[Event] = []
        for seq, entry in snapshot.items():
            if seq not in self._references:
                continue
            if seq not in self._started and entry.get("attempts"):
                self._started.add(seq)
                events.append(Event("started", seq))
            reports = entry.get("reports", 0)
            if entry.get("progress") is not None and reports != self._reports.get(seq):
                self._reports[seq] = reports
                events.append(Event("progress", seq, dict(entry["progress"])))
        return events

    def _result_events(self) -> list[Event]:
        if not self._references:
            return []
        ray = self._ray
        by_reference = {reference: seq for seq, reference in self._references.items()}
        ready, _ = ray.wait(list(by_reference), num_returns=len(by_reference), timeout=0)
        events: list[Event] = []
        for reference in ready:
            seq = by_reference[reference]
            del self._references[seq]
            if seq not in self._started:
                events.append(Event("started", seq))
            try:
                events.append(Event("result", seq, ray.get(reference)))
            except ray.exceptions.TaskCancelledError:
                pass  # stopped by kill(); the queue has already moved on
            except ray.exceptions.RayError as error:
                text = str(error).strip().splitlines()
                detail = text[-1] if text else ""
                events.append(Event("lost", seq, {"reason": f"the solve process died while solving this plan "
                                                  f"(Ray: {type(error).__name__}: {detail})"}))
            self._forget(seq)
        return events

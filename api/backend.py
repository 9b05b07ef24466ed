"""Where the service's solves run: the interface, and the default, a pool of local solve processes.

`JobQueue` owns the plans (queue, store, cancel and overrun rules); a backend
only runs tasks and says what happened to them, as `Event`s. Two backends:
`LocalProcesses` here (the default: spawned processes fed through pipes) and
`api.ray_backend.RayBackend` (each solve a Ray task, locally or on a cluster).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from api.settings import Settings
from api.solver import worker_main

log = logging.getLogger("mosos.api")

STARTUP_TIMEOUT_S = 120.0


@dataclass
class Event:
    """What a backend reports about the solve of plan `seq`.

    kind: 'started' (it began solving), 'progress' (payload: the solver's latest figures), 'result'
    (payload: the outcome dict of `api.solver.solve_task`), 'lost' (the process solving it died; payload
    'reason').
    """

    kind: str
    seq: int
    payload: dict[str, Any] = field(default_factory=dict)


class SolveBackend(ABC):
    name: str = "backend"

    @abstractmethod
    def start(self) -> None:
        """Get ready to solve (raise RuntimeError, with the reason, if it cannot)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every solve and release everything; tasks still running are abandoned."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Solves that may run at once."""

    @property
    @abstractmethod
    def ready(self) -> int:
        """Solve slots started and able to solve (for /healthz)."""

    @property
    @abstractmethod
    def free(self) -> int:
        """Slots that can take a task now."""

    @abstractmethod
    def submit(self, seq: int, task: dict[str, Any]) -> bool:
        """Start solving `task` (plan `seq`) on a free slot; False if none could take it."""

    @abstractmethod
    def request_stop(self, seq: int) -> None:
        """Ask the solve of `seq` to stop (its result, if any, is ignored)."""

    @abstractmethod
    def kill(self, seq: int) -> None:
        """Stop the solve of `seq` now, whatever it is doing (kill its process; a fresh one takes the slot)."""

    @abstractmethod
    def wait(self, timeout_s: float, wake: Any) -> list[Event]:
        """Events since the last call, waiting up to `timeout_s` for one (or for `wake`, a connection, to be readable)."""


# Local solve processes -------------------------------------------------------------------


@dataclass
class _Worker:
    index: int
    process: Any
    connection: Any
    cancel_seq: Any
    ready: bool = False
    seq: int | None = None  # the plan it is solving

    @property
    def idle(self) -> bool:
        return self.ready and self.seq is None


class LocalProcesses(SolveBackend):
    """`settings.solve_processes` spawned processes, one task at a time each, fed through pipes.

    A process that dies, or is killed for ignoring a cancel or overrunning, is replaced at once.
    """

    name = "local"

    def __init__(self, settings: Settings):
        self.settings = settings
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._stopping = False

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

    def stop(self) -> None:
        self._stopping = True
        for worker in self._workers:
            try:
                worker.connection.send(None)
            except (OSError, ValueError):
                pass
        # one grace period for all of them, not one each: the stop does not grow with the number of solve processes
        grace_ends = time.monotonic() + 2
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, grace_ends - time.monotonic()))
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
        killed_by = time.monotonic() + 2
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, killed_by - time.monotonic()))
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

    @property
    def capacity(self) -> int:
        return len(self._workers)

    @property
    def ready(self) -> int:
        return sum(1 for worker in self._workers if worker.ready and worker.process.is_alive())

    @property
    def free(self) -> int:
        return sum(1 for worker in self._workers if worker.idle and worker.process.is_alive())

    def submit(self, seq: int, task: dict[str, Any]) -> bool:
        for worker in self._workers:
            if worker.idle and worker.process.is_alive():
                worker.seq = seq
                worker.cancel_seq.value = -1
                try:
                    worker.connection.send(task)
                except (OSError, ValueError):
                    worker.seq = None
                    return False
                return True
        return False

    def _solving(self, seq: int) -> _Worker | None:
        return next((worker for worker in self._workers if worker.seq == seq), None)

    def request_stop(self, seq: int) -> None:
        worker = self._solving(seq)
        if worker is not None:
            worker.cancel_seq.value = seq

    def kill(self, seq: int) -> None:
        worker = self._solving(seq)
        if worker is not None:
            worker.seq = None
            self._replace(worker)

    def wait(self, timeout_s: float, wake: Any) -> list[Event]:
        events: list[Event] = []
        connections = {worker.connection: worker for worker in self._workers}
        ready = multiprocessing.connection.wait([wake, *connections], timeout=timeout_s)
        for connection in ready:
            if connection is wake:
                continue
            worker = connections[connection]
            try:
                while connection.poll():
                    events += self._handle(worker, connection.recv())
            except (EOFError, OSError):
                events += self._died(worker)
        for worker in list(self._workers):
            if worker.connection in connections and not worker.process.is_alive():
                events += self._died(worker)
        return events

    def _handle(self, worker: _Worker, message) -> list[Event]:
        kind, seq, payload = message
        if kind == "ready":
            worker.ready = True
            return []
        if kind == "broken":
            log.error("solve process %d cannot start: %s", worker.index, payload.get("reason"))
            return []
        if worker.seq is None or worker.seq != seq:
            return []
        if kind == "result":
            worker.seq = None
            worker.cancel_seq.value = -1
        return [Event(kind, seq, payload)]

    def _died(self, worker: _Worker) -> list[Event]:
        if self._workers[worker.index] is not worker:  # already replaced in this round
            return []
        seq = worker.seq
        worker.process.join(timeout=1)
        code = worker.process.exitcode
        log.warning("solve process %d died (exit code %s); starting another", worker.index, code)
        worker.seq = None
        self._replace(worker)
        if seq is None:
            return []
        return [Event("lost", seq, {"reason": f"the solve process died (exit code {code}) while solving this plan"})]

"""What runs on the Ray workers: one solve per task, and a small actor that watches the solves.

A solve task tells the `SolveControl` actor when it starts (on which process
and node, which attempt: Ray retries a task whose worker died), and, for the
service, sends its latest progress and learns whether it was cancelled, every
`REPORT_INTERVAL_S`. The driver reads the actor's snapshot to time each solve
from its real start and to show progress; it stops a solve that ignores a
cancel or overruns its limit with `ray.cancel(force=True)`, which kills the
worker process (Ray starts another when it needs one).

The remote functions are made on first use, so importing this module does not
import Ray.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from typing import Any, Callable, Hashable
# Imports inside functions here are deferred for start-up time: Ray workers import the planner when a task runs on
# them.

REPORT_INTERVAL_S = 0.2
REPORT_TIMEOUT_S = 10.0

_remote: dict[str, Any] = {}


def probe() -> str:
    """Runs on a worker: the mosos version it imports."""
    import planner

    return planner.__version__


class SolveControl:
    """Where each solve stands, as its tasks report it; cancellations the tasks poll for."""

    def __init__(self) -> None:
        self._solves: dict[Hashable, dict[str, Any]] = {}
        self._cancelled: set[Hashable] = set()

    def started(self, key: Hashable, pid: int, node: str) -> None:
        entry = self._solves.setdefault(key, {"attempts": 0, "history": [], "progress": None, "reports": 0})
        entry["attempts"] += 1
        entry["pid"] = pid
        entry["node"] = node
        entry["progress"] = None
        entry["history"].append({"attempt": entry["attempts"], "pid": pid, "node": node, "started_at": time.time()})

    def report(self, key: Hashable, progress: dict | None) -> bool:
        entry = self._solves.get(key)
        if entry is not None and progress is not None:
            entry["progress"] = progress
            entry["reports"] += 1
        return key in self._cancelled

    def cancel(self, key: Hashable) -> None:
        self._cancelled.add(key)

    def snapshot(self) -> dict[Hashable, dict[str, Any]]:
        return self._solves

    def forget(self, keys: list) -> None:
        for key in keys:
            self._solves.pop(key, None)
            self._cancelled.discard(key)


class _Reporter:
    """A thread beside the solve: sends the latest progress, reads the cancel flag."""

    def __init__(self, control: Any, key: Hashable):
        self.control = control
        self.key = key
        self._latest: dict | None = None
        self._stop_asked = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mosos-ray-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=REPORT_TIMEOUT_S)

    def send(self, progress: dict) -> None:
        self._latest = progress

    def should_stop(self) -> bool:
        return self._stop_asked.is_set()

    def _run(self) -> None:
        import ray

        while not self._done.wait(REPORT_INTERVAL_S):
            progress, self._latest = self._latest, None
            try:
                if ray.get(self.control.report.remote(self.key, progress), timeout=REPORT_TIMEOUT_S):
                    self._stop_asked.set()
            except Exception:  # the driver and its actor are gone: nobody wants this result any more
                self._stop_asked.set()


def _resolve(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def run_solve(target: str, payload: Any, control: Any, key: Hashable, interactive: bool, *inputs: Any) -> Any:
    """The body of every solve task: `target(payload, send, should_stop, *inputs)`, named 'module:function'.

    `inputs` are objects Ray hands over resolved (a profile another task estimated, one shared copy of a
    profile file). `interactive` adds the reporter thread (progress and cancel, for the service); a sweep
    only needs the start notice.
    """
    import ray

    # Waited for: a task whose process dies right after must still count as an attempt.
    try:
        ray.get(control.started.remote(key, os.getpid(), ray.util.get_node_ip_address()), timeout=REPORT_TIMEOUT_S)
    except Exception:  # the driver is gone or slow: solving is still worth it when it is slow
        pass
    function = _resolve(target)
    if not interactive:
        return function(payload, lambda progress: None, None, *inputs)
    reporter = _Reporter(control, key)
    reporter.start()
    try:
        return function(payload, reporter.send, reporter.should_stop, *inputs)
    finally:
        reporter.close()


def probe_task(ray: Any) -> Any:
    if "probe" not in _remote:
        _remote["probe"] = ray.remote(num_cpus=0, max_retries=0)(probe)
    return _remote["probe"]


def solve_task(ray: Any) -> Any:
    """The remote solve function; callers set num_cpus (solver threads) and max_retries per call."""
    if "solve" not in _remote:
        _remote["solve"] = ray.remote(run_solve)
    return _remote["solve"]


def plain_task(ray: Any, function: Callable) -> Any:
    """Any other function as a remote one (made once per function); callers set its options per call."""
    key = f"{function.__module__}:{function.__qualname__}"
    if key not in _remote:
        _remote[key] = ray.remote(function)
    return _remote[key]


def new_control(ray: Any) -> Any:
    """A SolveControl actor for one sweep or one server; it needs no CPU of its own."""
    if "control" not in _remote:
        _remote["control"] = ray.remote(num_cpus=0, max_restarts=0)(SolveControl)
    return _remote["control"].remote()

"""Progress while CP-SAT runs: each improving solution, the bound, the gap, the time."""

from __future__ import annotations

import threading
import time
from typing import Callable

from ortools.sat.python import cp_model

from planner.schedule import relative_gap  # noqa: F401  (its home is beside SolverInfo)


def new_solver() -> cp_model.CpSolver:
    """A CP-SAT solver that leaves Ctrl-C to its caller. By default CP-SAT catches SIGINT during a solve and ends that
    solve as if its time limit had come, so a strategy of many solves (the window search, the baselines) went on to
    the next one and a command never stopped; the caller's `should_stop` (`StopWatcher`) is the one way to stop."""
    solver = cp_model.CpSolver()
    solver.parameters.catch_sigint_signal = False
    return solver


class ProgressCallback(cp_model.CpSolverSolutionCallback):
    """Counts solutions, remembers when the first came, and reports each one."""

    def __init__(self, strategy: str, to_report: Callable[[float], float], progress: Callable[[dict], None] | None,
                 should_stop: Callable[[], bool] | None):
        super().__init__()
        self.strategy = strategy
        self.to_report = to_report
        self.progress = progress
        self.should_stop = should_stop
        self.started = time.monotonic()
        self.solutions = 0
        self.first_solution_s: float | None = None
        self.best_solution_s: float | None = None

    def on_solution_callback(self) -> None:
        now = time.monotonic() - self.started
        self.solutions += 1
        if self.first_solution_s is None:
            self.first_solution_s = now
        self.best_solution_s = now
        objective = self.to_report(self.objective_value)
        bound = self.to_report(self.best_objective_bound)
        if self.progress is not None:
            self.progress(
                {
                    "strategy": self.strategy,
                    "objective": objective,
                    "bound": bound,
                    "gap": relative_gap(objective, bound),
                    "solutions": self.solutions,
                    "elapsed_s": now,
                }
            )
        if self.should_stop is not None and self.should_stop():
            self.stop_search()


class StopWatcher:
    """Polls `should_stop` while the solver runs and stops it (the service's cancel button)."""

    def __init__(self, solver: cp_model.CpSolver, should_stop: Callable[[], bool] | None, period_s: float = 0.1):
        self.solver = solver
        self.should_stop = should_stop
        self.period_s = period_s
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self.done.wait(self.period_s):
            if self.should_stop():
                # again every period until the solve ends: CP-SAT drops a stop asked before its solve has begun
                # (`stop_search` reaches only a solve in progress), and that solve then ran to its time limit
                self.solver.stop_search()

    def __enter__(self):
        if self.should_stop is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.thread is not None:
            self.thread.join()

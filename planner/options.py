"""How long and how a strategy may work: the options every phase of a plan shares (the ground floor of planner/)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable


@dataclass
class SolveOptions:
    """How long and how a strategy may work.

    `deadline` (a `time.monotonic()` instant) is the one clock every phase of a
    call shares: heuristics, simulations, inner CP-SAT solves, the joint model,
    the minimum-budget search. `plan()` sets it once from `time_limit_s`; a
    strategy called directly starts it at its own start (`started()`).
    `time_limit_s` stays the nominal length, which with one worker is also the
    budget of the CP-SAT solves in deterministic time. A seeded run with one
    worker repeats exactly when no phase reaches its wall-clock share of the
    deadline (the reordering, the greedy pass and the heuristics stop at theirs):
    on an idle machine; under load a phase cut short may give another plan.
    """

    time_limit_s: float = 60.0
    workers: int | None = None
    seed: int = 0
    progress: Callable[[dict], None] | None = field(default=None, repr=False)
    # Stops a running solve early (the service's cancel); returns True to stop.
    should_stop: Callable[[], bool] | None = field(default=None, repr=False)
    deadline: float | None = None
    # False when the caller only wants a plan (mosos running its baselines): a strategy that finds none
    # raises InfeasibleBudget at once instead of searching for the smallest budget it could meet.
    explain_infeasible: bool = True
    # Where a caller gives a list: a strategy that makes other plans on its way (mosos' baselines and heuristics)
    # appends them, (name, schedule), each within the same budget: plan() takes the fastest whose buffers place
    # within the budget where the strategy's own plan's do not.
    candidates: list | None = field(default=None, repr=False)

    def started(self) -> "SolveOptions":
        """These options with a deadline: the one given, else `time_limit_s` from now."""
        if self.deadline is not None:
            return self
        return replace(self, deadline=time.monotonic() + self.time_limit_s)

    def remaining_s(self) -> float:
        """Seconds left before the deadline (negative once past it; infinite without one)."""
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def stopped(self) -> bool:
        return self.should_stop is not None and bool(self.should_stop())

    def out_of_time(self, margin_s: float = 0.0) -> bool:
        """The deadline is less than `margin_s` away, or the caller asked to stop."""
        return self.remaining_s() <= margin_s or self.stopped()

    def within(self, seconds: float) -> "SolveOptions":
        """A phase's options: at most `seconds` from now, never past this deadline; its nominal limit is `seconds`."""
        own = self.started()
        deadline = min(own.deadline, time.monotonic() + max(0.0, seconds))
        return replace(own, deadline=deadline, time_limit_s=max(1e-3, seconds))

    def quiet(self) -> "SolveOptions":
        return replace(self, progress=None)

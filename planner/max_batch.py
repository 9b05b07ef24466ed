"""The largest batch whose plan fits a memory budget, per strategy, and the batch with the best throughput.

`max_batch(profile_for_batch, budget_bytes, ...)` takes a function that makes
the training step's profile at any batch size (the estimator for a named GPU,
a user's model estimated for a named GPU, or profiles measured at a few
batches and scaled: see `models.batch_profiles` and `executor.measure.batch_profiles`)
and, for each strategy, searches the batch sizes:

- a batch *fits* when the strategy's plan (checked by the simulator, as every
  plan) fits the budget and its simulated step is within the overhead limit
  over that batch's lower bound (keep-all at the fastest implementations,
  simulated; `max_overhead` 0.1 = 10 % over it; "forward" = at most one extra
  forward pass, Checkmate's ceiling; None = no limit);
- before any solve, the batches are bounded above by the floor every plan
  needs (fixed memory plus the largest node with its inputs and smallest
  workspace, or plus the optimizer step's temporaries,
  `planner.budget.minimum_budget_bytes`): a batch above that bound
  cannot fit whatever the strategy, so it is never solved;
- the search tries batch 1 (2 when no profile can be made at 1, as for batch
  norm over a single value), then doubles (2, 4, 8, ...) while the batch fits,
  then bisects between the largest batch that fits and the smallest that does
  not. That is correct when fitting is monotone in the batch (true of every
  heuristic here, whose memory grows linearly with the batch; a solver under a
  time limit or an overhead limit need not be). Every batch evaluated is kept
  and checked: a batch that does not fit below one that does is reported as a
  monotonicity violation. The largest batch reported always has a certified
  plan; "largest" is what monotonicity adds.
- the best throughput (samples per second of simulated step time) is the best
  among the batches evaluated, after `throughput_probes` more evaluations
  that bisect towards the best one's neighbours (a local search: the curve
  need not be unimodal).

The time limit bounds the whole call: each strategy gets an equal share of
what is left when it starts (so what a fast heuristic leaves over goes to the
solvers after it), and each solve gets its strategy's remaining share divided
by the evaluations its search still expects, rounded down to a step of a
fixed ladder (so that the same question asks the same solves, which the
service's plan cache recognizes), 0.2 s at least, and is stopped at its limit
through `should_stop`. When less than 0.2 s of a share is left the search
stops and says so: the largest batch then is the largest one found, with the
bracket left open.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence, Union

from pydantic import BaseModel, Field

from planner.budget import describe_minimum, minimum_budget_bytes
from planner.errors import BudgetError, InfeasibleBudget, MososError
from planner.planning import plan, strategy_names
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import simulate
from planner.strategies import load_all
from planner.strategies.keep_all import keep_all_schedule
from planner.units import MAX_SIZE_BYTES, format_bytes

DEFAULT_STRATEGIES = ("checkpoint-all", "chen-sqrt", "recompute-only", "mosos")
DEFAULT_BATCH_LIMIT = 65536
MAX_BATCH_LIMIT = 1 << 24
DEFAULT_THROUGHPUT_PROBES = 6
MIN_SOLVE_S = 0.2  # below this a solve is not worth starting: the search stops and says the time ran out
STOP_GRACE_S = 0.25  # a solve is asked to stop this long after its own limit
TIME_LADDER_S = (0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60, 80, 100, 120, 150, 200,
             250, 300, 400, 500, 600, 800, 1000, 1200, 1500, 2000, 2500, 3000, 3600)  # steps at most 1.5x apart

OverheadLimit = Union[float, Literal["forward"], None]
Outcome = Literal["fits", "over-overhead", "infeasible", "below-floor", "error"]


class MaxBatchError(MososError):
    """Bad arguments to the batch search."""


class Solve(Protocol):
    """What solves one probe: `planner.plan`, or the service's queue. Returns a certified schedule or raises
    InfeasibleBudget / BudgetError (no plan) or MososError (the strategy cannot run)."""

    def __call__(
        self, profile: GraphProfile, budget_bytes: int, *, strategy: str, time_limit_s: float, workers: int | None,
        seed: int, should_stop: Callable[[], bool] | None,
    ) -> Schedule: ...


def _plan_solve(profile, budget_bytes, *, strategy, time_limit_s, workers, seed, should_stop):
    return plan(profile, budget_bytes, strategy=strategy, time_limit_s=time_limit_s, workers=workers, seed=seed,
                should_stop=should_stop)


class BatchProbe(BaseModel):
    """One batch size evaluated for one strategy."""

    batch_size: int
    outcome: Outcome = Field(description="fits: within the budget and the overhead limit; over-overhead: a plan "
                             "fits the budget but is too slow; infeasible: no plan within the budget; below-floor: the "
                             "budget is below what any plan needs (not solved); error: the profile or the strategy failed")
    step_time_ms: float | None = None
    lower_bound_ms: float | None = Field(default=None, description="keep-all at the fastest implementations, simulated")
    overhead: float | None = Field(default=None, description="step time / lower bound - 1")
    overhead_limit: float | None = Field(default=None, description="the limit at this batch, as a fraction")
    peak_memory_bytes: int | None = None
    throughput_samples_per_s: float | None = None
    minimum_budget_bytes: int | None = Field(default=None, description="the smallest budget the strategy meets here, "
                                             "when it found no plan")
    proven: bool | None = Field(default=None, description="for infeasible: the solver proved it (False: none found "
                                "within the time limit; None: a heuristic, whose one plan does not fit)")
    solver_status: str | None = None
    time_limit_s: float | None = Field(default=None, description="the limit this solve was given")
    wall_time_s: float = 0.0
    reason: str | None = None
    schedule: Schedule | None = Field(default=None, exclude=True, repr=False)

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"


class StrategyMaxBatch(BaseModel):
    strategy: str
    max_batch_size: int | None = Field(description="the largest batch found that fits; None: none fits")
    first_failing_batch_size: int | None = Field(
        default=None, description="the smallest batch above max_batch_size evaluated and found not to fit")
    complete: bool = Field(description="the search closed its bracket (first failing = max + 1, or the max is the "
                           "largest batch any plan could fit or the batch limit) within its time, and no solver's time "
                           "limit left the first failing batch open (see unsettled_next)")
    stopped_by: str | None = Field(default=None, description="why the search stopped early, if it did")
    at_max: BatchProbe | None = None
    best_throughput_batch_size: int | None = None
    best_throughput_samples_per_s: float | None = None
    monotone: bool = True
    violations: list[str] = Field(default_factory=list)
    reason: str | None = Field(default=None, description="when no batch fits: why, with the smallest budget for the "
                               "smallest batch")
    first_batch_minimum_budget_bytes: int | None = Field(
        default=None, description="when no batch fits: the smallest budget known to fit the smallest batch")
    time_share_s: float = 0.0
    wall_time_s: float = 0.0
    probes: list[BatchProbe] = Field(default_factory=list)

    @property
    def schedule(self) -> Schedule | None:
        """The certified plan at the largest batch (Python API only; not in the JSON)."""
        return self.at_max.schedule if self.at_max is not None else None

    def unsettled_next(self) -> BatchProbe | None:
        """The first failing batch's probe if a solver left it open (no proof, or a plan not proven optimal):
        with more time the largest batch may be larger."""
        probe = next((p for p in self.probes if p.batch_size == self.first_failing_batch_size), None)
        return probe if probe is not None and _unsettled(probe) else None


def _unsettled(probe: BatchProbe) -> bool:
    """A failing probe a solver's time limit left open: no plan found without a proof, or too slow a plan not proven
    optimal."""
    if probe.outcome == "infeasible":
        return probe.proven is False
    return probe.outcome == "over-overhead" and probe.solver_status not in (None, "OPTIMAL")


class MaxBatchResult(BaseModel):
    budget_bytes: int
    max_overhead: float | str | None
    overhead_description: str
    batch_limit: int
    floor_batch_size: int = Field(description="the largest batch whose floor (fixed memory plus the largest node, or "
                                  "plus the optimizer step's temporaries) fits the budget: no strategy can fit more")
    floor_reason: str
    time_limit_s: float
    wall_time_s: float
    time_split: str
    profile_name: str = Field(description="the profile at the smallest batch")
    smallest_batch_size: int = Field(default=1, description="where the search starts: 1, or 2 when no profile can "
                                     "be made at batch 1 (see smallest_batch_reason)")
    smallest_batch_reason: str | None = None
    strategies: list[StrategyMaxBatch]
    best_throughput: dict | None = Field(default=None, description="strategy, batch_size, samples_per_s")
    stopped: bool = Field(default=False, description="a stop request (cancel) ended the search early")


def describe_overhead(limit: OverheadLimit) -> str:
    if limit is None:
        return "no overhead limit"
    if limit == "forward":
        return "at most one extra forward pass over the lower bound (Checkmate's ceiling)"
    return f"at most {100 * limit:g}% over the lower bound"


def check_overhead(limit) -> OverheadLimit:
    if limit is None or limit == "forward":
        return limit
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not math.isfinite(limit) or limit < 0:
        raise MaxBatchError(
            f"the overhead limit is a fraction of the lower bound (0.1 for 10%), 'forward' or none, not {limit!r}")
    return float(limit)


def parse_overhead(text: str) -> OverheadLimit:
    """'10%' or '0.1' (a fraction of the lower bound), 'forward' (one extra forward pass) or 'none'."""
    value = str(text).strip().lower()
    if value in ("none", "off", "no", "unlimited"):
        return None
    if value in ("forward", "fwd", "one-forward"):
        return "forward"
    try:
        number = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise MaxBatchError(
            f"cannot read {text!r} as an overhead limit: write a percentage (10%), a fraction (0.1), 'forward' "
            "(at most one extra forward pass) or 'none'"
        ) from None
    if not value.endswith("%") and number > 1:
        raise MaxBatchError(
            f"{text!r} as an overhead limit is {number:g} times the lower bound ({100 * number:g}%), most likely a "
            f"percentage without its sign: write {value}% for {value} percent, or {100 * number:g}% if you meant it")
    return check_overhead(number)


def _quantized(limit_s: float) -> float:
    """The largest ladder step at or below `limit_s`, or the smallest solve (`MIN_SOLVE_S`) below the first step:
    a fixed value, so that the same question asks the same solves (and finds them in a store) run after run."""
    fitting = [step for step in TIME_LADDER_S if step <= limit_s + 1e-9]
    return float(fitting[-1]) if fitting else MIN_SOLVE_S


class _OutOfTime(Exception):
    pass


@dataclass
class _Batches:
    """Profiles, lower bounds and floors per batch, made once and shared by every strategy."""

    profile_for_batch: Callable[[int], GraphProfile]
    profiles: dict[int, GraphProfile] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    lower_bounds: dict[int, tuple[float, float]] = field(default_factory=dict)
    measuring_refusals: dict[tuple[int, int], str | None] = field(default_factory=dict)

    def profile(self, batch: int) -> GraphProfile:
        if batch in self.errors:
            raise MososError(self.errors[batch])
        if batch not in self.profiles:
            try:
                made = self.profile_for_batch(batch)
            except MososError as error:
                self.errors[batch] = f"the profile at batch {batch} cannot be made: {error}"
                raise MososError(self.errors[batch]) from None
            if not isinstance(made, GraphProfile):
                raise MaxBatchError(f"profile_for_batch({batch}) returned a {type(made).__name__}, not a GraphProfile")
            self.profiles[batch] = made
        return self.profiles[batch]

    def bounds(self, batch: int) -> tuple[float, float]:
        """(lower bound, fastest forward time) at `batch`, in ms."""
        if batch not in self.lower_bounds:
            profile = self.profile(batch)
            lower = simulate(profile, keep_all_schedule(profile), keep_timeline=False).step_time_ms
            forward = sum(node.fastest.time_ms for node in profile.nodes if node.kind == "forward")
            self.lower_bounds[batch] = (lower, forward)
        return self.lower_bounds[batch]

    def below_floor(self, batch: int, budget: int) -> str | None:
        """Why no plan of any strategy fits at `batch` (None if some might). A `profile_for_batch` that measures
        may also say why a batch cannot be measured within the budget (`below_measuring_floor(batch, budget)`):
        a batch whose plan fits but whose step cannot be measured first is no answer."""
        try:
            floor = minimum_budget_bytes(self.profile(batch))
        except MososError as error:
            return str(error)
        if floor > budget:
            return f"the budget is below what any plan needs at batch {batch}: {describe_minimum(self.profile(batch))}"
        measuring_floor = getattr(self.profile_for_batch, "below_measuring_floor", None)
        if callable(measuring_floor):
            key = (batch, budget)
            if key not in self.measuring_refusals:
                self.measuring_refusals[key] = measuring_floor(batch, budget)
            return self.measuring_refusals[key]
        return None


def floor_batch(batches: _Batches, budget: int, batch_limit: int, smallest: int = 1) -> tuple[int, str]:
    """The largest batch <= batch_limit whose floor fits the budget (0 if none), and what stops the next one.

    Floors grow with the batch, so exponential then binary search finds it in about 2 log2(answer) profiles.
    """
    reason = batches.below_floor(smallest, budget)
    if reason is not None:
        return 0, reason
    low, high = smallest, None
    batch = 2 * smallest
    while batch <= batch_limit:
        if batches.below_floor(batch, budget) is None:
            low, batch = batch, batch * 2
        else:
            high = batch
            break
    if high is None:
        if low == batch_limit or batches.below_floor(batch_limit, budget) is None:
            return batch_limit, f"the batch limit ({batch_limit})"
        high = batch_limit
    while high - low > 1:
        middle = (low + high) // 2
        if batches.below_floor(middle, budget) is None:
            low = middle
        else:
            high = middle
    return low, batches.below_floor(high, budget) or ""


class _StrategySearch:
    """Exponential then binary search of one strategy's largest batch, then the throughput refinement."""

    def __init__(self, strategy: str, batches: _Batches, budget: int, overhead: OverheadLimit, ceiling: int,
                 batch_limit: int, smallest: int, throughput_probes: int, deadline: float, solve: Solve, workers: int | None, seed: int,
                 should_stop: Callable[[], bool] | None, progress: Callable[[dict], None] | None):
        self.strategy = strategy
        self.batches = batches
        self.budget = budget
        self.overhead = overhead
        self.ceiling = ceiling  # the floor's largest batch: nothing above it can fit
        self.batch_limit = batch_limit
        self.smallest = smallest  # 1, or 2 when batch 1 cannot be profiled
        self.throughput_probes = throughput_probes
        self.deadline = deadline
        self.solve = solve
        self.workers = workers
        self.seed = seed
        self.should_stop = should_stop
        self.progress = progress
        self.probes: dict[int, BatchProbe] = {}
        self.low: int | None = None  # largest batch seen to fit
        self.high: int | None = None  # smallest batch above `low` seen not to fit
        self.phase = "exponential"
        self.refined = 0  # throughput refinements made
        self.stopped_by: str | None = None
        self.started = time.monotonic()

    # One evaluation ---------------------------------------------------------------------------

    def expected_remaining(self) -> int:
        """Evaluations the search still expects, for splitting the time (an estimate, never below 1)."""
        top = max(self.ceiling, 2)
        if self.phase == "exponential":
            current = max(self.low or 1, 1)
            remaining = max(1, math.ceil(math.log2(top / current))) + max(1, math.ceil(math.log2(current + 1)))
        elif self.phase == "bisection":
            width = (self.high or top) - (self.low or 0)
            remaining = max(1, math.ceil(math.log2(max(width, 2))))
        else:
            return max(1, self.throughput_probes - self.refined)
        return remaining + self.throughput_probes

    def fits(self, batch: int) -> bool:
        if batch not in self.probes:
            self.probes[batch] = self._evaluate(batch)
        return self.probes[batch].fits

    def _evaluate(self, batch: int) -> BatchProbe:
        if self.should_stop is not None and self.should_stop():
            self.stopped_by = "stopped on request"
            raise _OutOfTime
        started = time.monotonic()
        if self.deadline - started < MIN_SOLVE_S:
            self._out_of_time(started)
        floor = self.batches.below_floor(batch, self.budget)
        if floor is not None:
            return self._report(BatchProbe(batch_size=batch, outcome="below-floor", reason=floor, proven=True))
        lower_ms, forward_ms = self.batches.bounds(batch)
        profile = self.batches.profile(batch)
        now = time.monotonic()  # making the profile and its lower bound took time too
        remaining = self.deadline - now
        if remaining < MIN_SOLVE_S:
            self._out_of_time(now)
        limit = min(max(_quantized(remaining / self.expected_remaining()), MIN_SOLVE_S), remaining)
        stop_at = now + limit + STOP_GRACE_S

        def stop() -> bool:
            return time.monotonic() > stop_at or bool(self.should_stop and self.should_stop())

        probe = BatchProbe(batch_size=batch, outcome="error", lower_bound_ms=lower_ms, time_limit_s=limit)
        probe.overhead_limit = self._limit_fraction(lower_ms, forward_ms)
        try:
            schedule = self.solve(profile, self.budget, strategy=self.strategy, time_limit_s=limit,
                                  workers=self.workers, seed=self.seed, should_stop=stop)
        except InfeasibleBudget as error:
            probe.outcome, probe.reason = "infeasible", str(error)
            probe.minimum_budget_bytes, probe.proven = error.minimum_budget_bytes, error.proven
        except BudgetError as error:  # below what any plan needs: the floor check above makes this rare
            probe.outcome, probe.reason, probe.proven = "infeasible", str(error), True
            probe.minimum_budget_bytes = error.minimum_budget_bytes
        except MososError as error:
            probe.reason = str(error)
        else:
            summary = schedule.summary
            assert summary is not None, "every strategy returns a certified schedule"
            probe.schedule = schedule
            probe.step_time_ms = summary.predicted_step_time_ms
            probe.peak_memory_bytes = summary.peak_memory_bytes
            probe.overhead = summary.predicted_step_time_ms / lower_ms - 1 if lower_ms > 0 else 0.0
            probe.throughput_samples_per_s = 1000.0 * batch / summary.predicted_step_time_ms if summary.predicted_step_time_ms > 0 else None
            probe.solver_status = summary.solver.status if summary.solver is not None else None
            if summary.peak_memory_bytes > self.budget:  # never trust a solve blindly: the simulator's peak decides
                probe.outcome = "infeasible"
                probe.reason = (f"its plan peaks at {summary.peak_memory_bytes} bytes "
                                f"({format_bytes(summary.peak_memory_bytes)}), above the budget")
            elif probe.overhead_limit is not None and probe.overhead > probe.overhead_limit + 1e-9:
                probe.outcome = "over-overhead"
                probe.reason = (f"its plan is {100 * probe.overhead:.1f}% over the lower bound, above the limit of "
                                f"{100 * probe.overhead_limit:.1f}%")
            else:
                probe.outcome = "fits"
        if not probe.fits and self.should_stop is not None and self.should_stop():
            # cut short by the caller's stop (a cancel), not answered: not a failing batch, and not kept as one
            self.stopped_by = "stopped on request"
            raise _OutOfTime
        probe.wall_time_s = time.monotonic() - started
        return self._report(probe)

    def _out_of_time(self, now: float):
        self.stopped_by = f"the time limit ran out ({max(self.deadline - now, 0):.2f} s of this strategy's share left)"
        raise _OutOfTime

    def _limit_fraction(self, lower_ms: float, forward_ms: float) -> float | None:
        if self.overhead is None:
            return None
        if self.overhead == "forward":
            return forward_ms / lower_ms if lower_ms > 0 else 0.0
        return float(self.overhead)

    def _report(self, probe: BatchProbe) -> BatchProbe:
        if self.progress is not None:
            fitting = [b for b, p in self.probes.items() if p.fits] + ([probe.batch_size] if probe.fits else [])
            self.progress({
                "strategy": self.strategy, "phase": self.phase, "batch_size": probe.batch_size,
                "outcome": probe.outcome, "largest_fitting": max(fitting, default=None),
                "evaluations": len(self.probes) + 1, "expected_remaining": self.expected_remaining() - 1,
                "elapsed_s": time.monotonic() - self.started,
            })
        return probe

    # The searches ----------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._largest()
            self.phase = "throughput"
            self._refine_throughput()
        except _OutOfTime:
            pass

    def _largest(self) -> None:
        if self.ceiling < 1:
            return
        if not self.fits(self.smallest):
            self.high = self.smallest
            return
        self.low = self.smallest
        batch = 2 * self.smallest
        while batch <= self.ceiling:
            if self.fits(batch):
                self.low, batch = batch, batch * 2
            else:
                self.high = batch
                break
        if self.high is None:
            if self.low == self.ceiling:
                return
            if self.fits(self.ceiling):
                self.low = self.ceiling
                return
            self.high = self.ceiling
        self.phase = "bisection"
        while self.high - self.low > 1:
            middle = (self.low + self.high) // 2
            if self.fits(middle):
                self.low = middle
            else:
                self.high = middle

    def _refine_throughput(self) -> None:
        """Bisect the wider of the two gaps beside the best batch so far (the upper one on a tie).

        Throughput usually rises with the batch while the plan stays at its lower bound and falls once it has to
        recompute or stall, so the best batch sits at that knee; halving the gaps beside the best closes in on it.
        """
        for _ in range(self.throughput_probes):
            best = self._best_throughput()
            if best is None or self.low is None:
                return
            inside = sorted(b for b in self.probes if b <= self.low)
            at = inside.index(best)
            neighbours = [inside[i] for i in (at - 1, at + 1) if 0 <= i < len(inside) and abs(inside[i] - best) > 1]
            if not neighbours:
                return
            wider = max(neighbours, key=lambda b: (abs(b - best), b))
            self.fits((best + wider) // 2)
            self.refined += 1

    def _best_throughput(self) -> int | None:
        fitting = [p for p in self.probes.values() if p.fits and p.throughput_samples_per_s is not None]
        if not fitting:
            return None
        return max(fitting, key=lambda p: (p.throughput_samples_per_s, -p.batch_size)).batch_size

    # The answer ---------------------------------------------------------------------------------------

    def result(self, share_s: float) -> StrategyMaxBatch:
        probes = [self.probes[b] for b in sorted(self.probes)]
        fitting = [p for p in probes if p.fits]
        largest = max((p.batch_size for p in fitting), default=None)
        violations = [
            f"batch {p.batch_size} does not fit ({p.outcome}: {p.reason}) although batch {largest} does"
            for p in probes if largest is not None and p.batch_size < largest and not p.fits
        ]
        failing_above = [p.batch_size for p in probes if not p.fits and (largest is None or p.batch_size > largest)]
        if self.ceiling < self.batch_limit:  # known not to fit without a solve: its floor is above the budget
            failing_above.append(self.ceiling + 1)
        first_failing = min(failing_above, default=None)
        settled = first_failing is None or first_failing not in self.probes or not _unsettled(self.probes[first_failing])
        complete = self.stopped_by is None and settled and (
            (largest is not None and (largest == self.batch_limit or first_failing == largest + 1))
            or (largest is None and first_failing == self.smallest)
        )
        best = self._best_throughput()
        at_max = self.probes.get(largest) if largest is not None else None
        answer = StrategyMaxBatch(
            strategy=self.strategy, max_batch_size=largest, first_failing_batch_size=first_failing, complete=complete,
            stopped_by=self.stopped_by, at_max=at_max, best_throughput_batch_size=best,
            best_throughput_samples_per_s=self.probes[best].throughput_samples_per_s if best is not None else None,
            monotone=not violations, violations=violations, time_share_s=share_s,
            wall_time_s=time.monotonic() - self.started, probes=probes,
        )
        if largest is None:
            answer.reason, answer.first_batch_minimum_budget_bytes = self._why_none()
        return answer

    def _why_none(self) -> tuple[str, int | None]:
        smallest = self.smallest
        first = self.probes.get(smallest)
        if first is None:
            if self.ceiling < 1:
                floor = self.batches.below_floor(smallest, self.budget) or f"batch {smallest} is above the batch limit"
                return f"no batch fits: {floor}", _floor_bytes(self.batches, smallest)
            return (f"no batch found in time: the search stopped before batch {smallest} was solved "
                    f"({self.stopped_by}); more time may find one"), None
        if first.outcome == "below-floor":
            return f"no batch fits: {first.reason}", _floor_bytes(self.batches, smallest)
        if first.outcome == "infeasible" and first.proven is False:
            return (f"no batch found to fit: batch {smallest} was not solved within its {first.time_limit_s:g} s "
                    f"({first.reason}); more time may find a plan"), first.minimum_budget_bytes
        if first.outcome == "infeasible":
            minimum = first.minimum_budget_bytes
            need = (f"; batch {smallest} needs {minimum} bytes ({format_bytes(minimum)}) with this strategy"
                    if minimum else "")
            return f"no batch fits the budget of {self.budget} bytes ({format_bytes(self.budget)}){need}", minimum
        if first.outcome == "over-overhead":
            profile = self.batches.profile(smallest)
            peak = simulate(profile, keep_all_schedule(profile), keep_timeline=False).peak_memory_bytes
            return (f"no batch fits within the overhead limit: at batch {smallest} {first.reason}; keep-all runs batch "
                    f"{smallest} at the lower bound in {peak} bytes ({format_bytes(peak)})"), peak
        return f"no batch fits: batch {smallest} failed: {first.reason}", None


def _floor_bytes(batches: _Batches, batch: int) -> int | None:
    try:
        return minimum_budget_bytes(batches.profile(batch))
    except MososError:
        return None


def max_batch(
    profile_for_batch: Callable[[int], GraphProfile],
    budget_bytes: int | None = None,
    *,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    max_overhead: OverheadLimit = 0.1,
    time_limit_s: float = 120.0,
    workers: int | None = None,
    seed: int = 0,
    batch_limit: int = DEFAULT_BATCH_LIMIT,
    throughput_probes: int = DEFAULT_THROUGHPUT_PROBES,
    solve: Solve | None = None,
    progress: Callable[[dict], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> MaxBatchResult:
    """For each strategy, the largest batch whose plan fits `budget_bytes` within `max_overhead`, and the best
    throughput; `budget_bytes` None: the device memory of the batch-1 profile. See the module's docstring."""
    started = time.monotonic()
    overhead = check_overhead(max_overhead)
    if not (isinstance(time_limit_s, numbers.Real) and math.isfinite(time_limit_s) and time_limit_s > 0):
        raise MaxBatchError(f"the time limit must be a positive number of seconds, not {time_limit_s!r}")
    if isinstance(batch_limit, bool) or not isinstance(batch_limit, numbers.Integral) or not 1 <= batch_limit <= MAX_BATCH_LIMIT:
        raise MaxBatchError(f"the batch limit must be a whole number from 1 to {MAX_BATCH_LIMIT}, not {batch_limit!r}")
    if isinstance(throughput_probes, bool) or not isinstance(throughput_probes, numbers.Integral) or throughput_probes < 0:
        raise MaxBatchError(f"throughput_probes must be a whole number, 0 or more, not {throughput_probes!r}")
    if workers is not None and workers < 1:
        raise MaxBatchError(f"workers must be at least 1, got {workers}")
    names = list(dict.fromkeys(strategies))
    if not names:
        raise MaxBatchError("give at least one strategy")
    registry = load_all()
    unknown = [name for name in names if name not in registry]
    if unknown:
        raise MaxBatchError(f"unknown strategy {unknown[0]!r}; known: {', '.join(strategy_names())}")
    batches = _Batches(profile_for_batch)
    smallest, smallest_note = 1, None
    try:
        first = batches.profile(1)
    except MososError as error:  # e.g. batch norm over a single value per channel: training needs 2 samples or more
        try:
            first = batches.profile(2)
        except MososError:
            raise error from None  # a workload that cannot make batch 1 nor 2 is the caller's error
        smallest, smallest_note = 2, str(error)
    budget = first.hardware.memory_capacity_bytes if budget_bytes is None else budget_bytes
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or not 0 < budget <= MAX_SIZE_BYTES:
        raise BudgetError(f"the budget is a whole number of bytes from 1 to {MAX_SIZE_BYTES}, not {budget!r}")
    for name in names:
        if registry[name].needs_transfers and not first.hardware.can_transfer:
            raise MaxBatchError(f"strategy {name!r} offloads tensors to host memory, but profile {first.name!r} has no "
                                "transfer bandwidth; leave it out or give the profile a bandwidth")
        if not registry[name].uses_budget and name != "keep-all":
            raise MaxBatchError(f"strategy {name!r} plans without a budget, so it has no largest batch to find")
    ceiling, floor_reason = floor_batch(batches, int(budget), int(batch_limit), smallest)
    deadline = started + float(time_limit_s)
    results: list[StrategyMaxBatch] = []
    stopped = False
    for index, name in enumerate(names):
        now = time.monotonic()
        share = max(0.0, (deadline - now) / (len(names) - index))
        search = _StrategySearch(name, batches, int(budget), overhead, ceiling, int(batch_limit), smallest,
                                 int(throughput_probes), now + share,
                                 solve or _plan_solve, workers, seed, should_stop, progress)
        if stopped:
            search.stopped_by = "stopped on request"
        else:
            search.run()
        stopped = stopped or search.stopped_by == "stopped on request"
        results.append(search.result(share))
    best = None
    for answer in results:
        if answer.best_throughput_samples_per_s is not None and (
            best is None or answer.best_throughput_samples_per_s > best["samples_per_s"]
        ):
            best = {"strategy": answer.strategy, "batch_size": answer.best_throughput_batch_size,
                    "samples_per_s": answer.best_throughput_samples_per_s}
    return MaxBatchResult(
        budget_bytes=int(budget), max_overhead=overhead, overhead_description=describe_overhead(overhead),
        batch_limit=int(batch_limit), floor_batch_size=ceiling, floor_reason=floor_reason,
        time_limit_s=float(time_limit_s), wall_time_s=time.monotonic() - started,
        time_split=(("1 strategy with the whole time" if len(names) == 1 else
                     f"{len(names)} strategies in turn, each with an equal share of the time left when it starts")
                    + "; each solve gets its strategy's remaining share over the evaluations its search still expects, "
                    "rounded down to a ladder step, and is stopped at that limit"),
        profile_name=first.name, smallest_batch_size=smallest, smallest_batch_reason=smallest_note, strategies=results,
        best_throughput=best, stopped=stopped,
    )

"""Large-neighbourhood search on the joint model: how it scales to graphs of thousands of nodes.

CP-SAT on the whole model of a 1,000-node graph spends its minute in presolve
and the first solution, and with two workers its own neighbourhood search
hardly starts. Here the search keeps an incumbent solution of the model and,
until the deadline, improves one window at a time: a run of consecutive
stages (the tensors made there, their inputs and the nodes that read them) is
free, every other tensor's copies, offload and algorithm are fixed to the
incumbent's. The window's model is built on its own (`create_variables` with a
`FixedPart`): fixed copies are constants, fixed intervals in the memory and
transfer constraints, and no constraint between two fixed tensors is written,
so a window costs what it frees, not what the graph has (a few hundredths of a
second to build on a 1,000-node graph instead of seconds for the whole model).
CP-SAT starts from the incumbent (hinted) and a better answer replaces it.
Windows go where the incumbent pays (recomputations, charged prefetch waits,
slower algorithms) more often than elsewhere; their size grows while CP-SAT
proves windows optimal in time and shrinks when it cannot.

The incumbent starts as the fastest plan the model can express: a baseline's
or the greedy plan, read into model values and checked window by window
(chunks of the graph free in turn, the plan's decisions fixed: every constraint
touching a chunk is written in its window, so all chunks feasible means the
plan satisfies the whole model); a chunk the plan violates is repaired by
solving it. With no such plan, the whole model is solved for a first solution.
On small graphs the whole model also gets the first half of the time, where
CP-SAT often proves optimality outright.

Every answer is a solution of the full model, so the plan is the model's own;
it is certified by the simulator like any other. The bound reported is the
best valid one known: the whole model's CP-SAT bound when it was solved, the
trivial one and the budget's peak-instant bound (`planner.bounds`).

With one worker the search is deterministic: windows come from a seeded
generator and each window gets a deterministic time, the total bounded by the
nominal time limit (the wall deadline is a safety net that breaks
repeatability only when it cuts).
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from planner.builder import certify
from planner.cpsat.callback import StopWatcher, new_solver, relative_gap
from planner.cpsat.constraints import ALL_FAMILIES
from planner.cpsat.data import TIME_UNITS_PER_MS, BuildTimeout, Features, ModelData, ModelExtensions, build_data
from planner.cpsat.extract import Solution, SolvedCopy, build_schedule, read_solution
from planner.cpsat.hints import add_hint, complete_hint, extensions_of, schedule_to_solution
from planner.cpsat.objective import set_objective
from planner.cpsat.solve import SolveOutcome, build_model, finish_margin_s, known_bound_ms
from planner.cpsat.variables import FixedPart, create_variables
from planner.errors import ScheduleRejected
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule, SolverInfo
from planner.simulator import simulate

# Graphs up to this many nodes (the MO-SOS experiment's VGG19 and U-Net, ~100) get the whole model first, for
# half of the time: CP-SAT proves them optimal in seconds. On ResNet-50 (351 nodes) it spent 18 s for 0.04%.
WHOLE_MODEL_NODES = 150
WHOLE_MODEL_SHARE = 0.5
WINDOWS_SHARE = 0.8  # of the nominal limit, for the windows' deterministic time with one worker (checks, builds)
FIRST_WINDOW_S = 0.5  # time for one window at first (deterministic time with one worker)
LONGEST_WINDOW_S = 4.0
MIN_WINDOW_S = 0.05
COSTLY_WINDOW_SHARE = 0.7  # windows centred on a tensor where the incumbent pays, the rest anywhere
TWO_WINDOW_SHARE = 0.5  # neighbourhoods made of two windows far apart
# Tensors per window when checking a plan against the model: its decisions are fixed, so even a large window is
# a quick feasibility question, and each window costs a model build over the fixed rest (VGG-416: 28 windows of
# 60 took 19 s on a loaded machine).
CHECK_CHUNK = 400
CHECK_S = 1.0  # (deterministic) time a chunk's check may take: a feasibility question, answered in milliseconds
REPAIR_SIZE = 6  # a failing chunk is halved down to this many tensors before it is solved anew
HINT_ATTEMPTS = 4
log = logging.getLogger(__name__)


def tensor_costs(data: ModelData, solution: Solution) -> list[int]:
    """Objective units per tensor: its computations at their implementations' times, its charged prefetch waits."""
    costs = [0] * data.n
    for copy in solution.copies:
        if copy.kind == "prefetch":
            costs[copy.tensor] += data.prefetch_units[copy.tensor] if copy.early else 0
        else:
            costs[copy.tensor] += data.impls[copy.tensor][copy.implementation].time_units
    return costs


@dataclass
class Incumbent:
    solution: Solution
    costs: list[int]
    source: str  # where it started: a baseline's name, or "cp-sat"

    @property
    def objective_units(self) -> int:
        return sum(self.costs)


@dataclass
class SearchStats:
    started: float = field(default_factory=time.monotonic)
    first_solution_s: float | None = None
    best_solution_s: float | None = None
    windows: int = 0
    improvements: int = 0
    bound_units: float | None = None  # the whole model's bound from CP-SAT, when it ran
    known_units: float = 0.0  # the bound known without solving (trivial, peak-instant)
    proven: bool = False


def _fitting(profile: GraphProfile, budget_bytes: int, hints: list[tuple[str, Schedule]]) -> list[tuple[str, Schedule]]:
    """The hint plans that fit the budget, fastest first (their certified summaries when they have them)."""
    timed = []
    for position, (name, schedule) in enumerate(hints):
        summary = schedule.summary
        if summary is not None and summary.peak_memory_bytes <= budget_bytes:
            step = summary.predicted_step_time_ms
        else:
            try:
                step = simulate(profile, schedule, budget_bytes, keep_timeline=False).step_time_ms
            except ScheduleRejected:
                continue
        timed.append((step, position, name, schedule))
    return [(name, schedule) for _, _, name, schedule in sorted(timed, key=lambda item: item[:2])]


class Windows:
    """Builds and solves windows of the model around an incumbent."""

    def __init__(self, data: ModelData, options: SolveOptions, stats: SearchStats):
        self.data = data
        self.options = options
        self.stats = stats
        self.margin_s = finish_margin_s(data.n)

    def solve(self, solution: Solution, free: set[int], time_s: float, check_only: bool = False):
        """(status, the merged solution or None, the free part's objective units) of one window.

        `check_only`: the free tensors' decisions are fixed to `solution` too; the answer says whether the
        model accepts them (and fills in what the plan does not say, such as which copy serves which read).
        """
        data = self.data
        by_tensor: dict[int, list[SolvedCopy]] = defaultdict(list)
        for copy in solution.copies:
            by_tensor[copy.tensor].append(copy)
        fixed = FixedPart(
            {j: by_tensor[j] for j in range(data.n) if j not in free},
            {j: stage for j, stage in solution.offload_stage.items() if j not in free},
        )
        model = cp_model.CpModel()
        variables = create_variables(model, data, fixed)
        for add_family in ALL_FAMILIES:
            add_family(model, data, variables)
        set_objective(model, data, variables)
        add_hint(model, data, variables, solution)
        # with one worker the deterministic time bounds the window and the deadline is only a safety net: a wall
        # cap near the window's time would cut some runs and not others, and the search would not repeat
        wall_s = max(0.01, min(time_s if (self.options.workers or 2) != 1 else float("inf"),
                               self.options.remaining_s() - self.margin_s))
        if check_only:
            values = complete_hint(model, time_s, self.options.seed, wall_s, keep_objective=True)
            if values is None:
                return cp_model.INFEASIBLE, None, None
            value = lambda variable: values[variable.index]  # noqa: E731
            status, objective = cp_model.FEASIBLE, None
        else:
            solver = new_solver()
            parameters = solver.parameters
            workers = self.options.workers or 2
            parameters.num_workers = workers
            parameters.random_seed = self.options.seed + self.stats.windows
            parameters.cp_model_probing_level = 0
            parameters.symmetry_level = 0
            parameters.log_search_progress = False
            if workers == 1:
                parameters.max_deterministic_time = time_s
            parameters.max_time_in_seconds = wall_s
            with StopWatcher(solver, self.options.should_stop):  # a cancel stops the window's solve too
                status = solver.solve(model)
            self.stats.windows += 1
            if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                return status, None, None
            value = solver.value
            objective = round(solver.objective_value)
        free_part = read_solution(data, variables, value, free_only=True)
        merged = Solution(
            copies=[c for c in solution.copies if c.tensor not in free] + free_part.copies,
            offload_stage={**{j: s for j, s in solution.offload_stage.items() if j not in free}, **free_part.offload_stage},
        )
        return status, merged, objective


def check_against_model(windows: Windows, solution: Solution, time_s: float) -> Solution | None:
    """`solution` completed and checked chunk by chunk; a violated chunk repaired by solving it; None if not.

    A chunk that fails is halved until the part the model rejects is small (a few tensors), and only that
    part is solved anew: the rest of the plan stays as it was.
    """
    n = windows.data.n
    pending = [range(first, min(n, first + CHECK_CHUNK)) for first in range(0, n, CHECK_CHUNK)]
    while pending:
        if windows.options.out_of_time(windows.margin_s):
            return None
        chunk = pending.pop(0)
        status, checked, _ = windows.solve(solution, set(chunk), time_s, check_only=True)
        log.debug("check of tensors %d-%d: %s", chunk.start, chunk.stop, "ok" if checked is not None else "rejected")
        if checked is None and len(chunk) > REPAIR_SIZE:
            middle = len(chunk) // 2
            pending[:0] = [chunk[:middle], chunk[middle:]]
            continue
        if checked is None:
            status, checked, _ = windows.solve(solution, set(chunk), max(time_s, 1.0))
            if checked is None:
                return None
        solution = checked
    return solution


class WindowSearch:
    def __init__(self, windows: Windows, incumbent: Incumbent, report, deterministic_budget_s: float):
        self.windows = windows
        self.data = windows.data
        self.options = windows.options
        self.stats = windows.stats
        self.incumbent = incumbent
        self.report = report
        self.rng = random.Random(self.options.seed)
        self.window = max(4, min(self.data.n, 24))
        self.window_s = FIRST_WINDOW_S
        self.deterministic_left_s = deterministic_budget_s

    def costly_tensors(self) -> list[int]:
        """Tensors whose cost is above their fastest single computation: where a better plan can gain."""
        data = self.data
        return [j for j, cost in enumerate(self.incumbent.costs) if cost > min(impl.time_units for impl in data.impls[j])]

    def neighbourhood(self, costly: list[int]) -> set[int]:
        """One window of stages, or two far apart of half the size each (memory freed in one pays for the
        other: the budget is shared by the whole step, so the best trades are often between distant layers)."""
        n = self.data.n
        parts = 2 if self.rng.random() < TWO_WINDOW_SHARE else 1
        size = max(2, self.window // parts)
        free: set[int] = set()
        for _ in range(parts):
            if costly and self.rng.random() < COSTLY_WINDOW_SHARE:
                centre = self.rng.choice(costly)
                first = max(0, min(n - size, centre - size // 2))
            else:
                first = self.rng.randrange(max(1, n - size + 1))
            seeds = range(first, min(n, first + size))
            free.update(seeds)
            for j in seeds:
                free.update(self.data.users[j])
                free.update(self.data.inputs[j])
        return free

    def improve_once(self) -> bool:
        free = self.neighbourhood(self.costly_tensors())
        time_s = self.window_s
        started = time.monotonic()
        status, solution, objective = self.windows.solve(self.incumbent.solution, free, time_s)
        self.deterministic_left_s -= time_s if (self.options.workers or 2) == 1 else 0.0
        improved = False
        if solution is not None:
            before = sum(self.incumbent.costs[j] for j in free)
            if objective < before:
                costs = tensor_costs(self.data, solution)
                if sum(costs) < self.incumbent.objective_units:
                    self.incumbent = Incumbent(solution, costs, self.incumbent.source)
                    self.stats.improvements += 1
                    self.stats.best_solution_s = time.monotonic() - self.stats.started
                    improved = True
                    self.report(self.incumbent)
        log.debug("window %d: %d stages, %d tensors free, %.2f s, %s in %.2f s, objective %d%s",
                  self.stats.windows, self.window, len(free), time_s, status, time.monotonic() - started,
                  self.incumbent.objective_units, " (improved)" if improved else "")
        # bigger windows while CP-SAT proves them in time, smaller (and longer) when it cannot
        if status == cp_model.OPTIMAL:
            self.window = min(self.data.n, max(self.window + 1, int(self.window * 1.5)))
        else:
            self.window = max(4, int(self.window / 1.5))
            self.window_s = min(LONGEST_WINDOW_S, self.window_s * 1.2)
        return improved

    def run(self) -> Incumbent:
        while not self.options.out_of_time(self.windows.margin_s + MIN_WINDOW_S):
            if self.deterministic_left_s <= 0 and (self.options.workers or 2) == 1:
                break
            bound = max(self.stats.known_units, self.stats.bound_units or 0)
            if self.incumbent.objective_units <= bound + 1e-6:
                self.stats.proven = True
                break
            try:
                self.improve_once()
            except BuildTimeout:  # the deadline came while a window was being built
                break
        return self.incumbent


def solve_with_windows(
    profile: GraphProfile,
    budget_bytes: int,
    features: Features,
    options: SolveOptions,
    strategy: str,
    hints: list[tuple[str, Schedule]] = (),
    time_limit_s: float | None = None,
) -> tuple[SolveOutcome, str | None]:
    """The joint model solved by window search until the options' deadline; (outcome, name of the starting plan).

    `hints` are (name, plan) pairs; the fastest the model can express (in the profile's order) starts the
    search, the model extended with the copies and copy stages the top few use. `time_limit_s` is the
    nominal search time (the deterministic budget with one worker).
    """
    options = options.started()
    stats = SearchStats()
    limit = time_limit_s or options.time_limit_s
    data0 = build_data(profile, budget_bytes, features)
    candidates = []
    extensions = ModelExtensions()
    for name, schedule in _fitting(profile, budget_bytes, list(hints))[:HINT_ATTEMPTS]:
        try:
            solution = schedule_to_solution(data0, schedule)
        except (KeyError, IndexError, StopIteration, ValueError):  # a plan the model cannot express
            continue
        candidates.append((name, solution))
        extensions.merge(extensions_of(data0, solution))
    data = build_data(profile, budget_bytes, features, extensions)
    data.deadline = options.deadline - finish_margin_s(data.n)
    scale = data.time_units_to_ms
    windows = Windows(data, options, stats)
    margin = windows.margin_s
    known_ms = known_bound_ms(data, options.deadline - margin)
    stats.known_units = known_ms * TIME_UNITS_PER_MS

    def best_bound_ms() -> float:
        return known_ms if stats.bound_units is None else max(known_ms, scale(stats.bound_units))

    def report(incumbent: Incumbent) -> None:
        if options.progress is None:
            return
        objective = scale(incumbent.objective_units)
        bound = min(objective, best_bound_ms())
        options.progress({
            "strategy": strategy, "objective": objective, "bound": bound, "gap": relative_gap(objective, bound),
            "solutions": stats.improvements + 1, "elapsed_s": time.monotonic() - stats.started,
        })

    def accept(solution: Solution, source: str) -> Incumbent:
        incumbent = Incumbent(solution, tensor_costs(data, solution), source)
        if stats.first_solution_s is None:
            stats.first_solution_s = time.monotonic() - stats.started
        stats.best_solution_s = time.monotonic() - stats.started
        report(incumbent)
        return incumbent

    # 1. the fastest plan the model can express, checked (and completed) window by window
    incumbent = None
    try:
        for name, solution in candidates:
            if options.out_of_time(margin):
                break
            log.debug("checking the plan of %s against the model", name)
            checked = check_against_model(windows, solution, CHECK_S)
            if checked is not None:
                incumbent = accept(checked, name)
                break
        # 2. on small graphs, or with nothing to start from, the whole model
        whole = data.n <= WHOLE_MODEL_NODES or incumbent is None
        whole_s = min(WHOLE_MODEL_SHARE * limit, options.remaining_s() - margin)
        status_name = "UNKNOWN"
        if whole and whole_s > 0.05:
            status, solution, bound_units = _solve_whole(profile, budget_bytes, features, options, data, extensions,
                                                        incumbent, whole_s)
            status_name = status
            stats.bound_units = bound_units
            if status == "INFEASIBLE":
                info = _info(data, features, options, stats, "INFEASIBLE", None, None, None)
                return SolveOutcome(None, info, data), None
            if solution is not None:
                costs = tensor_costs(data, solution)
                if incumbent is None or sum(costs) < incumbent.objective_units:
                    incumbent = accept(solution, incumbent.source if incumbent is not None else "cp-sat")
                if status == "OPTIMAL":
                    stats.proven = True
        if incumbent is None:
            info = _info(data, features, options, stats, status_name, None, None, None)
            return SolveOutcome(None, info, data), None
        # 3. windows until the deadline
        if not stats.proven:
            # with one worker the windows' total (deterministic) time is a function of the inputs only
            deterministic = WINDOWS_SHARE * limit * (1 - WHOLE_MODEL_SHARE if whole else 1)
            incumbent = WindowSearch(windows, incumbent, report, deterministic).run()
    except BuildTimeout:
        if incumbent is None:
            info = _info(data, features, options, stats, "UNKNOWN", None, None,
                         "the time limit came while building the model")
            return SolveOutcome(None, info, data), None
    objective = scale(incumbent.objective_units)
    bound = min(best_bound_ms(), objective)
    status = "OPTIMAL" if stats.proven or objective <= bound else "FEASIBLE"
    note = f"window search: {stats.windows} windows, {stats.improvements} improvements, started from {incumbent.source}"
    info = _info(data, features, options, stats, status, objective, bound, note)
    schedule = certify(profile, build_schedule(data, incumbent.solution), strategy, info)
    return SolveOutcome(schedule, info, data, objective), incumbent.source


def _solve_whole(profile, budget_bytes, features, options: SolveOptions, data: ModelData, extensions,
                 incumbent: Incumbent | None, time_s: float):
    """(status, solution or None, CP-SAT's bound in units or None) of the whole model, hinted with the incumbent."""
    built = build_model(profile, budget_bytes, features, options.deadline, extensions)
    if incumbent is not None:
        add_hint(built.model, built.data, built.variables, incumbent.solution)
    solver = new_solver()
    parameters = solver.parameters
    workers = options.workers or 2
    parameters.num_workers = workers
    parameters.random_seed = options.seed
    parameters.cp_model_probing_level = 0
    parameters.symmetry_level = 0
    parameters.log_search_progress = False
    wall_s = max(0.01, options.remaining_s() - finish_margin_s(data.n))
    if workers == 1:
        parameters.max_deterministic_time = time_s
        parameters.max_time_in_seconds = wall_s  # a safety net only (see Windows.solve)
    else:
        parameters.max_time_in_seconds = max(0.01, min(time_s, wall_s))
    with StopWatcher(solver, options.should_stop):
        status = solver.solve(built.model)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return name, None, None
    solution = read_solution(built.data, built.variables, solver.value)
    return name, solution, solver.best_objective_bound


def _info(data, features: Features, options: SolveOptions, stats: SearchStats, status: str, objective, bound,
          note: str | None) -> SolverInfo:
    encoding = replace(features, transfers=data.transfers).describe()
    if note:
        encoding += f"; {note}"
    return SolverInfo(
        status=status, objective=objective, bound=bound, gap=relative_gap(objective, bound),
        wall_time_s=time.monotonic() - stats.started, time_to_first_solution_s=stats.first_solution_s,
        workers=options.workers or 2, seed=options.seed, encoding=encoding,
    )

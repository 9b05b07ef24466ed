"""The driver: build the model, warm-start it, solve it, and turn the answer into a certified schedule."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from planner.bounds import order_bound_ms
from planner.builder import PlannerBug, certify
from planner.cpsat.callback import ProgressCallback, StopWatcher, new_solver, relative_gap
from planner.cpsat.constraints import ALL_FAMILIES
from planner.cpsat.data import BuildTimeout, Features, ModelData, ModelExtensions, build_data
from planner.cpsat.extract import build_schedule, read_solution
from planner.cpsat.hints import add_hint, complete_hint, schedule_to_solution
from planner.cpsat.objective import set_objective
from planner.cpsat.variables import Variables, create_variables
from planner.errors import ScheduleRejected
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule, SolverInfo
from planner.simulator import simulate


@dataclass
class SolveOutcome:
    schedule: Schedule | None  # certified, or None when no solution was found
    info: SolverInfo
    data: ModelData
    objective_value: float | None = None  # model units: ms, or bytes when minimizing memory


# Wall time kept back after CP-SAT stops, for reading its solution, building the schedule and certifying it
# in the simulator: a base plus a cost per node (measured on 1,000-5,000-node graphs on the 2-core development
# machine: about 0.3 ms a node under load, so 5000 nodes take ~1.5 s). See `finish_margin_s`.
FINISH_BASE_S = 0.1
FINISH_PER_NODE_S = 3e-4


def finish_margin_s(nodes: int) -> float:
    """Seconds a solve keeps back before its deadline for extraction and certification of a `nodes`-node plan."""
    return FINISH_BASE_S + FINISH_PER_NODE_S * nodes


def solver_parameters(options: SolveOptions, time_limit_s: float, wall_limit_s: float | None = None) -> cp_model.CpSolver:
    """One worker + a seed gives the same answer every time: a deterministic time limit then governs.

    `wall_limit_s` caps the wall-clock time whatever the worker count (what is left of the caller's deadline);
    with one worker a run cut by it is no longer guaranteed to repeat exactly.
    """
    solver = new_solver()
    workers = options.workers or 2
    parameters = solver.parameters
    parameters.num_workers = workers
    parameters.random_seed = options.seed
    parameters.interleave_search = False
    parameters.log_search_progress = False
    # Presolve probing costs seconds on the joint model and buys little here.
    parameters.cp_model_probing_level = 0
    parameters.symmetry_level = 0
    if workers == 1:
        parameters.max_deterministic_time = time_limit_s
        parameters.max_time_in_seconds = 3 * time_limit_s + 5  # a safety net on a loaded machine
    else:
        parameters.max_time_in_seconds = time_limit_s
    if wall_limit_s is not None:
        parameters.max_time_in_seconds = max(0.01, min(parameters.max_time_in_seconds, wall_limit_s))
    return solver


def _status_name(solver: cp_model.CpSolver, status) -> str:
    return solver.status_name(status)


def _not_solved(data: ModelData, features: Features, options: SolveOptions, started: float, why: str) -> SolveOutcome:
    info = SolverInfo(
        status="UNKNOWN", wall_time_s=time.monotonic() - started, workers=options.workers or 2, seed=options.seed,
        encoding=replace(features, transfers=data.transfers).describe() + f"; {why}",
    )
    return SolveOutcome(None, info, data)


@dataclass
class BuiltModel:
    data: ModelData
    model: cp_model.CpModel
    variables: Variables


def build_model(
    profile: GraphProfile, budget_bytes: int | None, features: Features, deadline: float | None = None,
    extra: "ModelExtensions | None" = None,
) -> BuiltModel:
    """The model with every constraint family and the objective; BuildTimeout (with `.data`) if `deadline`
    (time.monotonic(), less the finish margin) comes first. `extra`: what hint plans need beyond `features`."""
    data = build_data(profile, budget_bytes, features, extra)
    if deadline is not None:
        data.deadline = deadline - finish_margin_s(data.n)
    model = cp_model.CpModel()
    try:
        variables = create_variables(model, data)
        for add_family in ALL_FAMILIES:
            add_family(model, data, variables)
    except BuildTimeout as timeout:
        timeout.data = data
        raise
    set_objective(model, data, variables)
    return BuiltModel(data, model, variables)


def solve_model(
    profile: GraphProfile,
    budget_bytes: int | None,
    features: Features,
    options: SolveOptions,
    strategy: str,
    hints: list[Schedule] = (),
    time_limit_s: float | None = None,
    deadline: float | None = None,
) -> SolveOutcome:
    """Build, warm-start and solve the model; the answer is certified.

    `options.deadline` (or `deadline`, whichever is sooner; time.monotonic()) caps the wall clock of the
    whole call, model building, extraction and certification included: CP-SAT gets what is left minus
    `finish_margin_s`. `time_limit_s` (default `options.time_limit_s`) is the nominal search time, the
    deterministic budget with one worker.
    """
    started = time.monotonic()
    options = options.started()
    if deadline is not None and deadline < options.deadline:
        options = replace(options, deadline=deadline)
    try:
        built = build_model(profile, budget_bytes, features, options.deadline)
    except BuildTimeout as timeout:
        return _not_solved(timeout.data, features, options, started, "the time limit came while building the model")
    data, model, variables = built.data, built.model, built.variables
    limit = time_limit_s or options.time_limit_s
    _warm_start(model, data, variables, hints, limit, options)
    wall_limit = options.remaining_s() - finish_margin_s(data.n)
    if wall_limit <= 0.01:
        return _not_solved(data, features, options, started, "no time left to solve the model")
    solver = solver_parameters(options, limit, wall_limit)
    if features.minimize_memory:
        scale = lambda units: units * data.memory_unit_bytes + profile.fixed_bytes  # noqa: E731
    else:
        scale = data.time_units_to_ms
    callback = ProgressCallback(strategy, scale, options.progress, options.should_stop)
    with StopWatcher(solver, options.should_stop):
        status = solver.solve(model, callback)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    objective = scale(solver.objective_value) if found else None
    bound = scale(solver.best_objective_bound) if found else None
    if bound is not None and not features.minimize_memory:
        # CP-SAT's own bound may be weaker than every node once at its fastest, or than what the budget forces
        bound = min(objective, max(bound, known_bound_ms(data, options.deadline)))
    info = SolverInfo(
        status=_status_name(solver, status),
        objective=objective,
        bound=bound,
        gap=relative_gap(objective, bound),
        wall_time_s=time.monotonic() - started,
        time_to_first_solution_s=callback.first_solution_s,
        workers=solver.parameters.num_workers,
        seed=options.seed,
        encoding=replace(features, transfers=data.transfers).describe(),  # no bandwidth: no transfers
    )
    if not found:
        return SolveOutcome(None, info, data)
    solution = read_solution(data, variables, solver.value)
    schedule = certify(profile, build_schedule(data, solution), strategy, info)
    return SolveOutcome(schedule, info, data, objective)


def known_bound_ms(data: ModelData, deadline: float | None = None) -> float:
    """The best valid lower bound on the model's objective known without solving: the trivial one, and the
    peak-instant bound of the budget (`planner.bounds`; model plans follow the profile's order)."""
    bound = trivial_bound_ms(data)
    if data.budget_bytes is not None and not data.features.minimize_memory:
        bound = max(bound, order_bound_ms(data.profile, data.budget_bytes, data.transfers, deadline))
    return bound


def trivial_bound_ms(data: ModelData) -> float:
    """Every node computed once with its fastest implementation: no plan of the model is faster (model units)."""
    return data.time_units_to_ms(sum(min(impl.time_units for impl in impls) for impls in data.impls))


def _fitting_hints(data: ModelData, hints) -> list[Schedule]:
    """The hint schedules that fit the budget, fastest first."""
    timed = []
    for position, schedule in enumerate(hints):
        try:
            result = simulate(data.profile, schedule, data.budget_bytes, keep_timeline=False)
        except ScheduleRejected:
            continue
        timed.append((result.step_time_ms, position, schedule))
    return [schedule for _, _, schedule in sorted(timed, key=lambda item: item[:2])]


def _warm_start(
    model, data: ModelData, variables, hints, limit_s: float, options: SolveOptions, attempts: int = 4
) -> list[int] | None:
    """Hint the fastest plan that the model can express, completed to a full assignment (returned).

    A plan the model cannot express (a baseline that stalls on transfers, say)
    would be a misleading partial hint, so it is dropped and the next one tried.
    """
    for schedule in _fitting_hints(data, hints)[:attempts]:
        if options.out_of_time(finish_margin_s(data.n)):
            break
        try:
            solution = schedule_to_solution(data, schedule)
        except (KeyError, IndexError, StopIteration, ValueError):  # a plan the model cannot express
            continue
        add_hint(model, data, variables, solution)
        wall_s = max(0.01, 0.5 * (options.remaining_s() - finish_margin_s(data.n)))
        values = complete_hint(model, min(2.0, 0.05 * limit_s), options.seed, wall_s)
        if values is not None:
            return values
        model.clear_hints()
    return None


__all__ = ["SolveOutcome", "solve_model", "PlannerBug"]

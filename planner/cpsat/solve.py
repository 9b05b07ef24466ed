"""The driver: build the model, warm-start it, solve it, and turn the answer into a certified schedule."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from planner.builder import PlannerBug, certify
from planner.cpsat.callback import ProgressCallback, StopWatcher, relative_gap
from planner.cpsat.constraints import ALL_FAMILIES
from planner.cpsat.data import Features, ModelData, build_data
from planner.cpsat.extract import build_schedule, read_solution
from planner.cpsat.hints import add_hint, complete_hint, schedule_to_solution
from planner.cpsat.objective import set_objective
from planner.cpsat.variables import create_variables
from planner.errors import ScheduleRejected
from planner.profile import GraphProfile
from planner.schedule import Schedule, SolverInfo
from planner.simulator import simulate
from planner.strategies import SolveOptions


@dataclass
class SolveOutcome:
    schedule: Schedule | None  # certified, or None when no solution was found
    info: SolverInfo
    data: ModelData
    objective_value: float | None = None  # model units: ms, or bytes when minimizing memory


def solver_parameters(options: SolveOptions, time_limit_s: float, wall_limit_s: float | None = None) -> cp_model.CpSolver:
    """One worker + a seed gives the same answer every time: a deterministic time limit then governs.

    `wall_limit_s` caps the wall-clock time whatever the worker count (a caller's total budget, such as
    mosos's); with one worker a run cut by it is no longer guaranteed to repeat exactly.
    """
    solver = cp_model.CpSolver()
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
    """`deadline` (time.monotonic()) caps the wall clock of the whole call, model building included."""
    started = time.monotonic()
    data = build_data(profile, budget_bytes, features)
    model = cp_model.CpModel()
    variables = create_variables(model, data)
    for add_family in ALL_FAMILIES:
        add_family(model, data, variables)
    set_objective(model, data, variables)
    limit = time_limit_s or options.time_limit_s
    _warm_start(model, data, variables, hints, limit, options.seed)
    wall_limit = None if deadline is None else deadline - time.monotonic()
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


def _warm_start(model, data: ModelData, variables, hints, limit_s: float, seed: int, attempts: int = 4) -> bool:
    """Hint the fastest plan that the model can express, completed to a full assignment.

    A plan the model cannot express (a baseline that stalls on transfers, say)
    would be a misleading partial hint, so it is dropped and the next one tried.
    """
    for schedule in _fitting_hints(data, hints)[:attempts]:
        try:
            solution = schedule_to_solution(data, schedule)
        except (KeyError, IndexError, StopIteration):
            continue
        add_hint(model, data, variables, solution)
        if complete_hint(model, min(2.0, 0.05 * limit_s), seed):
            return True
        model.clear_hints()
    return False


__all__ = ["SolveOutcome", "solve_model", "PlannerBug"]

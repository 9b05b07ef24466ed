"""What every CP-SAT strategy does around the solve: pick the best certified plan, or explain infeasibility."""

from __future__ import annotations

from dataclasses import replace

from planner.bounds import keep_all_bound_ms, order_bound_ms
from planner.builder import certify
from planner.cpsat.callback import relative_gap
from planner.cpsat.data import Features
from planner.cpsat.lns import solve_with_windows
from planner.cpsat.reorder import in_profile_order
from planner.cpsat.solve import SolveOutcome, finish_margin_s, solve_model
from planner.errors import InfeasibleBudget, ScheduleRejected
from planner.minimum import minimum_budget
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule, SolverInfo
from planner.simulator import simulate
from planner.units import format_bytes


def fits(profile: GraphProfile, schedule: Schedule | None, budget_bytes: int | None) -> float | None:
    """Simulated step time of `schedule` within the budget, or None if it does not fit or is invalid."""
    if schedule is None:
        return None
    summary = schedule.summary  # a certified plan: the simulator's figures are there already
    if summary is not None and (budget_bytes is None or summary.peak_memory_bytes <= budget_bytes):
        return summary.predicted_step_time_ms
    try:
        return simulate(profile, schedule, budget_bytes, keep_timeline=False).step_time_ms
    except ScheduleRejected:
        return None


def best_plan(profile: GraphProfile, budget_bytes: int | None, candidates: list[tuple[str, Schedule | None]]):
    """(name, schedule, step time) of the fastest candidate that fits; the earlier one wins ties."""
    best = None
    for name, schedule in candidates:
        step = fits(profile, schedule, budget_bytes)
        if step is not None and (best is None or step < best[2] - 1e-9):
            best = (name, schedule, step)
    return best


def infeasible(
    profile: GraphProfile, budget_bytes: int, features: Features, options: SolveOptions, strategy: str, status: str,
    time_limit_s: float | None = None,
):
    """Search the smallest budget the strategy can meet; return a plan if that search found one within the budget."""
    minimum = minimum_budget(profile, features, options, strategy, time_limit_s=time_limit_s)
    if minimum.schedule is not None and fits(profile, minimum.schedule, budget_bytes) is not None:
        return minimum.schedule.model_copy(update={"budget_bytes": budget_bytes})
    if status == "INFEASIBLE":
        # the model fixes the compute order and bounds recomputations: a plan outside it may still fit (BERT of the
        # frontier at 108 MiB fitted the greedy pass's plan, measured within that budget)
        reason = "none of the solver model's plans fits (proven; another compute order or more recomputations may)"
    else:
        reason = f"no plan found in {options.time_limit_s:g} s ({status})"
    raise InfeasibleBudget(
        f"strategy {strategy!r}: no plan within {budget_bytes} bytes ({format_bytes(budget_bytes)}), {reason}; "
        + minimum.describe(),
        minimum_budget_bytes=minimum.budget_bytes,
        proven=status == "INFEASIBLE",
    )


def plan_with_model(
    profile: GraphProfile,
    budget_bytes: int,
    options: SolveOptions,
    strategy: str,
    features: Features,
    hints: list[Schedule] = (),
    others: list[tuple[str, Schedule | None]] = (),
    time_limit_s: float | None = None,
    explain_infeasible: bool = True,
    fallbacks: list[tuple[str, Schedule | None]] = (),
    deadline: float | None = None,
    windows: bool = False,
) -> tuple[Schedule | None, SolverInfo, str | None]:
    """Solve the model; return (uncertified best plan, solver info, which plan won).

    `others` compete with the CP-SAT plan; `fallbacks` are used only when
    neither it nor `others` gives a plan. With nothing that fits: search the smallest feasible budget and raise
    InfeasibleBudget, or return (None, info, None) if `explain_infeasible` is off. `options.deadline` (or
    `deadline` when sooner; time.monotonic()) caps the solve's wall clock; the minimum-budget search gets
    what is left of the options' deadline.
    """
    options = options.started()
    if deadline is not None and deadline < options.deadline:
        options = replace(options, deadline=deadline)
    solving = options
    if explain_infeasible and features.recompute and not any(s is not None for _, s in [*others, *fallbacks]):
        # with no plan in hand, a little time is kept back for the smallest budget's greedy bisection, should the
        # solve find none
        solving = replace(options, deadline=options.deadline - min(2.0, 0.1 * options.time_limit_s))
    if solving.out_of_time(finish_margin_s(len(profile.nodes))):
        # what the phases before it took left less than building, reading and certifying a model takes (0.4 s on
        # 2,000 nodes before CP-SAT runs at all): the plans in hand compete without it, within the limit
        outcome = _not_solved(features, options)
    elif windows:
        named = [(name, s) for name, s in others if s is not None and any(s is h for h in hints)]
        named += [("hint", h) for h in hints if not any(h is s for _, s in named)]
        outcome, _ = solve_with_windows(
            profile, budget_bytes, features, solving, strategy, hints=named, time_limit_s=time_limit_s
        )
    else:
        outcome = solve_model(
            profile, budget_bytes, features, solving, strategy, hints=list(hints), time_limit_s=time_limit_s,
        )
    best = best_plan(profile, budget_bytes, [("cp-sat", outcome.schedule)] + list(others))
    if best is None:
        best = best_plan(profile, budget_bytes, list(fallbacks))
    info = outcome.info
    if best is None:
        if not explain_infeasible:
            return None, info, None
        search_s = min(30.0, options.time_limit_s)  # nominal (deterministic with one worker); the deadline caps it
        schedule = infeasible(profile, budget_bytes, features, options, strategy, info.status, search_s)
        note = f"{info.encoding}; plan from the memory-minimizing search"
        return schedule, info.model_copy(update={"encoding": note}), "cp-sat (memory-minimizing)"
    name, schedule, step = best
    encoding = info.encoding
    if name != "cp-sat":
        # The plan that won lies outside what the model proved (another compute order, more recomputations,
        # deliberate stalls): the model's status, objective and bound go in the note; the plan's own figures
        # are its simulated step against the best bound valid for it.
        alone = info.status
        if info.objective is not None:
            alone += f", objective {info.objective:.6g}, bound {info.bound:.6g}"
        encoding = f"{info.encoding}; best plan: {name}; the model alone: {alone}"
        bound = min(step, plan_bound_ms(profile, budget_bytes, schedule, features, options))
        status = "OPTIMAL" if step <= bound + 1e-9 * max(1.0, step) else "FEASIBLE"
        info = info.model_copy(update={"status": status, "objective": step, "bound": bound,
                                       "gap": relative_gap(step, bound)})
    schedule = schedule.model_copy(update={"budget_bytes": budget_bytes})
    return schedule, info.model_copy(update={"encoding": encoding}), name


def _not_solved(features: Features, options: SolveOptions) -> SolveOutcome:
    info = SolverInfo(status="UNKNOWN", objective=None, bound=None, gap=None, wall_time_s=0.0,
                      time_to_first_solution_s=None, workers=options.workers or 2, seed=options.seed,
                      encoding=f"{features.describe()}; not solved: no time was left for the model")
    return SolveOutcome(None, info, None)


def plan_bound_ms(profile: GraphProfile, budget_bytes: int, schedule: Schedule, features: Features,
                  options: SolveOptions) -> float:
    """A lower bound for the strategy's problem that holds for `schedule`: the budget's peak-instant bound when
    the plan computes in the profile's order (with transfers if the strategy may move tensors: a bound that
    only holds for plans that do not would overstate how good a plan is), else the trivial one."""
    if not in_profile_order(profile, schedule):
        return keep_all_bound_ms(profile)
    moves = any(op.op in ("offload", "prefetch") for stage in schedule.stages for op in stage.operations)
    transfers = moves or (features.transfers and profile.hardware.can_transfer)  # moves implies it, kept for safety
    return order_bound_ms(profile, budget_bytes, transfers, options.deadline)


def certified(profile: GraphProfile, schedule: Schedule, strategy: str, info: SolverInfo) -> Schedule:
    return certify(profile, schedule, strategy, info)

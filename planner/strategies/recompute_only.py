"""recompute-only: the optimal plan that only frees and recomputes, fastest implementation everywhere.

The problem Checkmate (MLSys 2020) and Moccasin (ICML 2023) solve, and the
natural strategy for imported Checkmate graphs. CP-SAT on the interval model
(`planner.cpsat`) with transfers and algorithm choice switched off, started
from a greedy evict-and-recompute plan. A plan in a memory-aware compute order
(`planner.cpsat.reorder`) competes with the model's: the model keeps the
profile's order, and another order may need far less memory.
"""

from __future__ import annotations

import time
from dataclasses import replace

from planner.builder import certify
from planner.cpsat.data import Features
from planner.cpsat.greedy import greedy_recompute_schedule
from planner.cpsat.reorder import reordered_schedule
from planner.cpsat.run import plan_with_model
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule, SolverInfo
from planner.strategies import strategy

# The most of a strategy's time limit that one heuristic pass (greedy, reordering) may take before the solve.
HEURISTIC_SHARE = 0.2


def phase_deadline(options: SolveOptions, share: float) -> float:
    """When a phase allowed `share` of the time limit must stop: that much from now, never past the deadline."""
    options = options.started()
    return min(options.deadline, time.monotonic() + share * options.time_limit_s)


def greedy_phase(profile: GraphProfile, budget_bytes: int, options: SolveOptions, share: float,
                 implementation: str = "fastest") -> Schedule | None:
    """The greedy evict-and-recompute plan within `share` of the time limit, or longer, to the deadline, until its
    first plan (a strategy left with no plan that fits fails where a slower one would have done)."""
    return greedy_recompute_schedule(profile, budget_bytes, deadline=phase_deadline(options, share),
                                     first_plan_deadline=options.started().deadline, implementation=implementation)


RECOMPUTE_ONLY = Features(recompute=True, transfers=False, implementations="fastest", max_recomputes=2)


def at_lower_bound(profile: GraphProfile, schedule: Schedule | None) -> bool:
    """A plan computing every node once, with its fastest implementation, and moving nothing: none can be faster."""
    return (
        schedule is not None
        and len(schedule.compute_order) == len(profile.nodes)
        and all(
            op.implementation == profile.node_by_id[op.node].fastest.name
            for stage in schedule.stages for op in stage.operations if op.op == "compute"
        )
        and not any(op.op in ("offload", "prefetch", "wait") for stage in schedule.stages for op in stage.operations)
    )


def certify_lower_bound(
    profile: GraphProfile, schedule: Schedule, strategy_name: str, options: SolveOptions, started: float
) -> Schedule:
    """Return a lower-bound plan as proven optimal, without a solve."""
    lower_bound_ms = sum(node.fastest.time_ms for node in profile.nodes)
    elapsed = time.monotonic() - started
    info = SolverInfo(
        status="OPTIMAL", objective=lower_bound_ms, bound=lower_bound_ms, gap=0.0, wall_time_s=elapsed,
        time_to_first_solution_s=elapsed, workers=options.workers, seed=options.seed,
        encoding="memory-aware order: keep-all fits, every node once at its fastest (no solve needed)",
    )
    return certify(profile, schedule, strategy_name, info)


def recompute_only_plan(
    profile: GraphProfile, budget_bytes: int, options: SolveOptions, time_limit_s: float | None = None,
    explain_infeasible: bool = True, deadline: float | None = None, greedy: Schedule | None | bool = False,
    reordered: Schedule | None | bool = False,
) -> Schedule | None:
    """`options.deadline` (or `deadline` when sooner) caps the wall clock; `greedy`, `reordered`: those plans if
    the caller has them. The heuristic passes get at most `HEURISTIC_SHARE` of the time each."""
    started = time.monotonic()
    options = options.started()
    if deadline is not None and deadline < options.deadline:
        options = replace(options, deadline=deadline)
    if reordered is False:
        reordered = reordered_schedule(profile, budget_bytes, deadline=phase_deadline(options, HEURISTIC_SHARE))
    if at_lower_bound(profile, reordered):
        return certify_lower_bound(profile, reordered, "recompute-only", options, started)
    if greedy is False:
        greedy = greedy_phase(profile, budget_bytes, options, HEURISTIC_SHARE)
    schedule, info, _ = plan_with_model(
        profile, budget_bytes, options, "recompute-only", RECOMPUTE_ONLY,
        hints=[s for s in (greedy,) if s is not None],
        others=[("greedy evict-and-recompute", greedy), ("memory-aware order", reordered)],
        time_limit_s=time_limit_s, explain_infeasible=explain_infeasible,
    )
    return None if schedule is None else certify(profile, schedule, "recompute-only", info)


@strategy(
    "recompute-only",
    "optimal plan that only recomputes, fastest implementation everywhere (Checkmate/Moccasin problem, CP-SAT)",
)
def plan_recompute_only(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return recompute_only_plan(profile, budget_bytes, options)

"""The window search (planner/cpsat/lns.py): its answers are solutions of the whole model, it checks plans against
the model faithfully, it expresses what heuristic plans do, it never loses its starting plan, it repeats with one
worker."""

from __future__ import annotations

import collections

import pytest

from planner.budget import budget_from_ratio, minimum_budget_bytes
from planner.cpsat.data import build_data
from planner.cpsat.extract import Solution, SolvedCopy
from planner.cpsat.greedy import greedy_recompute_schedule
from planner.cpsat.hints import extensions_of, schedule_to_solution
from planner.cpsat.lns import SearchStats, Windows, check_against_model, solve_with_windows, tensor_costs
from planner.cpsat.solve import solve_model
from planner.random_layered import random_training_profile
from planner.simulator import simulate
from planner.strategies import SolveOptions
from planner.strategies.mosos import MOSOS
from planner.strategies.recompute_only import RECOMPUTE_ONLY
from tests.test_cpsat_profiles import small_cnn

ONE = SolveOptions(time_limit_s=10.0, workers=1, seed=0)


def windows_for(profile, budget, features, plan):
    data0 = build_data(profile, budget, features)
    solution = schedule_to_solution(data0, plan)
    data = build_data(profile, budget, features, extensions_of(data0, solution))
    return Windows(data, ONE.started(), SearchStats()), solution


def test_the_models_own_answer_passes_the_check_with_its_objective():
    profile = small_cnn(layers=6)
    budget = budget_from_ratio(profile, 0.7)
    outcome = solve_model(profile, budget, MOSOS, ONE, "test")
    windows, solution = windows_for(profile, budget, MOSOS, outcome.schedule)
    checked = check_against_model(windows, solution, 2.0)
    assert checked is not None
    assert sum(tensor_costs(windows.data, checked)) / 1000 == pytest.approx(outcome.info.objective)


def test_a_plan_that_breaks_the_model_is_rejected_where_it_breaks():
    """Free a tensor before its last reader in the plan read back: the window holding them refuses it."""
    profile = small_cnn(layers=6, bandwidth_gb_per_s=None)
    budget = budget_from_ratio(profile, 0.9)
    outcome = solve_model(profile, budget, RECOMPUTE_ONLY, ONE, "test")
    windows, solution = windows_for(profile, budget, RECOMPUTE_ONLY, outcome.schedule)
    data = windows.data
    victim = data.ids.index("f2")  # read by b2, b3 in backward
    broken = Solution(
        copies=[SolvedCopy(c.tensor, c.kind, c.rank, c.stage, c.start, c.start if c.tensor == victim else c.end,
                           c.implementation, c.early) if c.kind == "original" else c for c in solution.copies
                if not (c.tensor == victim and c.kind != "original")],
        offload_stage=dict(solution.offload_stage),
    )
    _, rejected, _ = windows.solve(broken, {victim}, 2.0, check_only=True)
    assert rejected is None
    _, accepted, _ = windows.solve(solution, {victim}, 2.0, check_only=True)
    assert accepted is not None


def test_the_model_expresses_a_greedy_plan_that_recomputes_five_times():
    """More recomputations than the features allow: the model grows those copies for that tensor only."""
    profile = small_cnn(layers=12, bandwidth_gb_per_s=None)
    budget = max(budget_from_ratio(profile, 0.5), minimum_budget_bytes(profile))
    greedy = greedy_recompute_schedule(profile, budget)
    assert max(collections.Counter(greedy.compute_order).values()) > 1 + RECOMPUTE_ONLY.max_recomputes
    windows, solution = windows_for(profile, budget, RECOMPUTE_ONLY, greedy)
    checked = check_against_model(windows, solution, 2.0)
    assert checked is not None
    assert sum(tensor_costs(windows.data, checked)) / 1000 == pytest.approx(
        simulate(profile, greedy, keep_timeline=False).step_time_ms
    )


@pytest.fixture(scope="module")
def generated():
    return random_training_profile(150, seed=5)  # 301 nodes: window search without the whole model first


def test_the_window_search_never_returns_worse_than_its_start(generated):
    budget = budget_from_ratio(generated, 0.6)
    greedy = greedy_recompute_schedule(generated, budget)
    start = simulate(generated, greedy, budget, keep_timeline=False).step_time_ms
    options = SolveOptions(time_limit_s=4.0, workers=2, seed=0)
    outcome, source = solve_with_windows(generated, budget, MOSOS, options, "test", hints=[("greedy", greedy)])
    assert source == "greedy"
    assert outcome.schedule.summary.predicted_step_time_ms <= start + 1e-6
    assert "window search" in outcome.info.encoding
    assert outcome.info.bound <= outcome.info.objective
    assert simulate(generated, outcome.schedule, budget, keep_timeline=False).peak_memory_bytes <= budget


def test_one_worker_window_searches_repeat_exactly(generated):
    budget = budget_from_ratio(generated, 0.6)
    greedy = greedy_recompute_schedule(generated, budget)
    runs = []
    for _ in range(2):
        # a nominal 2 s (the deterministic budget) inside a generous wall deadline that never cuts
        options = SolveOptions(time_limit_s=60.0, workers=1, seed=3)
        outcome, _ = solve_with_windows(generated, budget, MOSOS, options, "test", hints=[("greedy", greedy)],
                                        time_limit_s=2.0)
        runs.append(outcome.schedule)
    assert runs[0].stages == runs[1].stages

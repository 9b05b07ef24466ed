"""The peak-instant lower bound (planner/bounds.py): never above any plan in the profile's order, above the trivial one
where the budget forces work, and what the strategies report against."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.bounds import keep_all_bound_ms, order_bound_ms, peak_instant_bound_ms
from planner.budget import budget_from_ratio, minimum_budget_bytes
from planner.cpsat.greedy import greedy_recompute_schedule
from planner.cpsat.reorder import in_profile_order
from planner.errors import MososError
from planner.planning import plan
from planner.profile import load_profile
from planner.simulator import simulate
from planner.strategies import SolveOptions
from planner.strategies.mosos import _baseline_functions
from planner.strategies.keep_all import keep_all_peak_bytes
from tests.strategies_hypothesis import residual_profiles, training_profiles
from tests.conftest import make_profile, node
from tests.test_cpsat_profiles import small_cnn

PROFILES = Path(__file__).resolve().parents[1] / "models" / "profiles"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=training_profiles(max_forward=7), ratio=st.floats(0.3, 1.0))
def test_no_plan_in_the_profiles_order_is_faster_than_the_bound(profile, ratio):
    """Every heuristic's plan and the greedy plan that fit, moving tensors or not, take at least the bound."""
    budget = max(minimum_budget_bytes(profile), int(keep_all_peak_bytes(profile) * ratio))
    with_transfers = peak_instant_bound_ms(profile, budget, transfers=True)
    without = peak_instant_bound_ms(profile, budget, transfers=False)
    assert keep_all_bound_ms(profile) <= with_transfers <= without
    for result in _fitting_plans(profile, budget, with_solver=False):
        bound = with_transfers if result.offloaded_bytes > 0 else without
        assert result.step_time_ms >= bound - 1e-6 * max(1.0, bound)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=training_profiles(max_forward=5), ratio=st.floats(0.4, 0.95))
def test_solver_plans_are_never_faster_than_the_bound(profile, ratio):
    budget = max(minimum_budget_bytes(profile), int(keep_all_peak_bytes(profile) * ratio))
    for strategy in ("recompute-only", "mosos"):
        try:
            schedule = plan(profile, budget, strategy=strategy, time_limit_s=2.0, workers=1)
        except MososError:
            continue
        solver = schedule.summary.solver
        if not in_profile_order(profile, schedule):
            continue
        bound = order_bound_ms(profile, budget, transfers=strategy == "mosos")
        assert schedule.summary.predicted_step_time_ms >= bound - 1e-6 * max(1.0, bound)
        assert solver.bound is None or solver.bound >= keep_all_bound_ms(profile) - 1e-3


def _fitting_plans(profile, budget, with_solver=True):
    """Every baseline's plan, the greedy one and (`with_solver`) a short mosos solve, simulated, where they fit
    and keep the profile's order."""
    plans = []
    for function in _baseline_functions().values():
        try:
            plans.append(function(profile, budget, SolveOptions(time_limit_s=5, explain_infeasible=False)))
        except MososError:
            continue
    greedy = greedy_recompute_schedule(profile, budget)
    plans += [greedy] if greedy is not None else []
    if with_solver:
        try:
            plans.append(plan(profile, budget, strategy="mosos", time_limit_s=2.0, workers=1))
        except MososError:
            pass
    for schedule in plans:
        result = simulate(profile, schedule, keep_timeline=False)
        if result.peak_memory_bytes <= budget and in_profile_order(profile, schedule):
            yield result


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=residual_profiles(), ratio=st.floats(0.3, 0.95))
def test_dead_inputs_never_lift_the_bound_above_a_plan(profile, ratio):
    """Residual blocks, where the cheapest tensors to recompute (the relus) need inputs that died in the forward:
    the program that charges for bringing those back stays below every plan that fits, and never below the
    knapsack alone."""
    budget = max(minimum_budget_bytes(profile), int(keep_all_peak_bytes(profile) * ratio))
    knapsack = peak_instant_bound_ms(profile, budget, dead_inputs=False)
    with_transfers = peak_instant_bound_ms(profile, budget)
    without = peak_instant_bound_ms(profile, budget, transfers=False)
    assert with_transfers >= knapsack - 1e-9
    for result in _fitting_plans(profile, budget):
        bound = with_transfers if result.offloaded_bytes > 0 else without
        assert result.step_time_ms >= bound - 1e-6 * max(1.0, bound)


@pytest.mark.parametrize("bandwidth_gb_per_s", [None, 0.1])
def test_recomputing_a_relu_pays_for_the_sum_it_reads(bandwidth_gb_per_s):
    """One residual block; at the peak (the head's backward) the relu's output is the cheapest tensor to give up
    (1 ms for 4 MB), but the sum it reads died in the forward, and so did the bn's output under the sum: bringing
    the relu back costs relu + add + bn = 5 ms, less than the stem or the conv (6 ms each). The knapsack alone
    took the relu's inputs for free (1 ms; its 1.5 ms comes from a later moment). A slow link moves some bytes."""
    mb = 1_000_000
    profile = make_profile([
        node("stem", output_bytes=4 * mb, time_ms=6.0),
        node("conv", inputs=["stem"], output_bytes=4 * mb, time_ms=6.0),
        node("bn", inputs=["conv"], output_bytes=4 * mb, time_ms=2.0),
        node("add", inputs=["bn", "stem"], output_bytes=4 * mb, time_ms=2.0),
        node("relu", inputs=["add"], output_bytes=4 * mb, time_ms=1.0),
        node("head", inputs=["relu"], output_bytes=4 * mb, time_ms=5.0),
        node("loss", kind="loss", inputs=["head"], output_bytes=10, time_ms=0.1),
        node("head:bwd", kind="backward", inputs=["loss", "head"], output_bytes=6 * mb, time_ms=5.0,
             forward_node="head"),
        node("relu:bwd", kind="backward", inputs=["head:bwd", "relu"], output_bytes=1 * mb, time_ms=1.0,
             forward_node="relu"),
        node("bn:bwd", kind="backward", inputs=["relu:bwd", "conv"], output_bytes=4 * mb, time_ms=2.0,
             forward_node="bn"),
        node("conv:bwd", kind="backward", inputs=["bn:bwd", "stem"], output_bytes=4 * mb, time_ms=5.0,
             forward_node="conv"),
    ], d2h=bandwidth_gb_per_s, h2d=bandwidth_gb_per_s)
    assert keep_all_peak_bytes(profile) == 22 * mb + 10  # at head:bwd: loss, head, its output, stem, conv, relu
    budget = keep_all_peak_bytes(profile) - 4 * mb
    trivial = keep_all_bound_ms(profile)
    knapsack = peak_instant_bound_ms(profile, budget, dead_inputs=False)
    bound = peak_instant_bound_ms(profile, budget)
    if bandwidth_gb_per_s is None:
        assert knapsack == pytest.approx(trivial + 1.5)
        assert bound == pytest.approx(trivial + 5.0, rel=1e-5)
    else:  # 0.46 and 2.10 ms when written
        assert bound > knapsack + 1.0
    # and no plan beats it
    for result in _fitting_plans(profile, budget):
        assert result.step_time_ms >= bound - 1e-6 * bound
    optimal = plan(profile, budget, strategy="recompute-only", time_limit_s=10.0, workers=1)
    assert optimal.summary.solver.status == "OPTIMAL"
    # 6 ms: the stem or the conv again (the relu's chain would need the bn and the sum resident at once later)
    assert optimal.summary.predicted_step_time_ms == pytest.approx(trivial + 6.0)
    assert optimal.summary.predicted_step_time_ms >= peak_instant_bound_ms(profile, budget, transfers=False)


def test_the_bound_sees_what_a_tight_budget_forces():
    """A chain whose activations cannot all stay: some must be recomputed or moved, and the link is slow."""
    profile = small_cnn(layers=8, bandwidth_gb_per_s=0.05)
    budget = budget_from_ratio(profile, 0.5)
    assert peak_instant_bound_ms(profile, budget) > keep_all_bound_ms(profile) + 1.0
    # with no link at all every byte that does not fit is recomputed: at least as costly
    assert peak_instant_bound_ms(profile, budget, transfers=False) >= peak_instant_bound_ms(profile, budget)
    # and at the keep-all peak nothing is forced
    assert peak_instant_bound_ms(profile, keep_all_peak_bytes(profile)) == keep_all_bound_ms(profile)


def test_shipped_transformer_bound_at_0_6_is_above_the_trivial_one():
    path = PROFILES / "transformer-b64-h100.json"
    if not path.exists():
        pytest.skip("profile absent")
    profile = load_profile(path)
    bound = order_bound_ms(profile, budget_from_ratio(profile, 0.6))
    assert bound > 1.03 * keep_all_bound_ms(profile)  # 624.8 against 598.5 ms when written


def test_mosos_reports_a_bound_never_below_the_trivial_one_and_a_baseline_at_it_as_optimal():
    profile = small_cnn(layers=6)
    budget = budget_from_ratio(profile, 0.7)
    schedule = plan(profile, budget, strategy="mosos", time_limit_s=5.0, workers=1)
    solver = schedule.summary.solver
    assert solver.bound >= keep_all_bound_ms(profile) - 1e-9
    assert solver.bound <= schedule.summary.predicted_step_time_ms + 1e-6 or solver.objective >= solver.bound

"""Every heuristic baseline, on random small training graphs: a plan the simulator accepts within the budget,
or InfeasibleBudget with a smallest budget at which it really does plan."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.attribute_plans import NoTransferBandwidth
from planner.budget import minimum_budget_bytes
from planner.planning import InfeasibleBudget, plan
from planner.profile import parse_profile
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_peak_bytes
from tests.strategies_hypothesis import training_profiles
from tests.test_baselines import BASELINES, OFFLOADING

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def conv_profiles(draw):
    """Random training graphs where some forward nodes (and their backward) are convolutions."""
    profile = draw(training_profiles(max_forward=7, with_bandwidth=draw(st.booleans())))
    data = profile.model_dump(mode="json")
    convs = {n["id"] for n in data["nodes"] if n["kind"] == "forward" and draw(st.booleans())}
    for n in data["nodes"]:
        if n["id"] in convs or n.get("forward_node") in convs:
            n["op_type"] = "conv2d"
    return parse_profile(data)


def check(profile, schedule, budget, strategy):
    assert schedule.summary.strategy == strategy
    result = simulate(profile, schedule, budget_bytes=budget, keep_timeline=False)
    assert result.peak_memory_bytes <= budget
    assert result.step_time_ms == pytest.approx(schedule.summary.predicted_step_time_ms)


@SETTINGS
@given(conv_profiles(), st.floats(0.0, 1.0), st.sampled_from(BASELINES))
def test_every_baseline_plans_within_the_budget_or_says_how_much_it_needs(profile, fraction, strategy):
    floor = minimum_budget_bytes(profile)
    budget = floor + int((max(keep_all_peak_bytes(profile), floor) - floor) * fraction)
    if strategy in OFFLOADING and not profile.hardware.can_transfer:
        with pytest.raises(NoTransferBandwidth):
            plan(profile, budget, strategy=strategy)
        return
    try:
        schedule = plan(profile, budget, strategy=strategy)
    except InfeasibleBudget as error:
        minimum = error.minimum_budget_bytes
        assert minimum is not None and minimum > budget
        check(profile, plan(profile, minimum, strategy=strategy), minimum, strategy)
    else:
        check(profile, schedule, budget, strategy)

"""Properties of the keep-all plan and of the simulator's rejections on random profiles."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings

from planner.budget import minimum_budget_bytes
from planner.errors import ScheduleRejected
from planner.schedule import Free
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_schedule
from tests.strategies_hypothesis import training_profiles

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(training_profiles())
def test_keep_all_validates_and_costs_the_sum_of_node_times(profile):
    result = simulate(profile, keep_all_schedule(profile))
    expected = sum(node.fastest.time_ms for node in profile.nodes)
    assert result.step_time_ms == pytest.approx(expected, rel=1e-12, abs=1e-9)
    assert result.stall_time_ms == pytest.approx(0.0, abs=1e-9)
    assert result.peak_memory_bytes >= profile.fixed_bytes + max(node.size_bytes for node in profile.nodes)
    assert result.peak_memory_bytes >= minimum_budget_bytes(profile)
    assert result.memory_timeline[-1].used_bytes == profile.fixed_bytes


@PROPERTY_SETTINGS
@given(training_profiles())
def test_one_byte_under_the_peak_is_rejected_and_the_peak_is_accepted(profile):
    schedule = keep_all_schedule(profile)
    peak = simulate(profile, schedule).peak_memory_bytes
    assume(peak > 0)
    assert simulate(profile, schedule, budget_bytes=peak).peak_memory_bytes == peak
    with pytest.raises(ScheduleRejected) as caught:
        simulate(profile, schedule, budget_bytes=peak - 1)
    assert caught.value.over_budget_bytes == 1
    assert "1 bytes over the budget" in str(caught.value)


@PROPERTY_SETTINGS
@given(training_profiles())
def test_an_input_freed_too_early_is_rejected(profile):
    schedule = keep_all_schedule(profile)
    # Take the last reader of some tensor and move that tensor's free to just before the reader's compute.
    reader_stage = next(s for s in reversed(schedule.stages) if profile.node_by_id[s.node].inputs)
    tensor = profile.node_by_id[reader_stage.node].inputs[0]
    for stage in schedule.stages:
        stage.operations = [op for op in stage.operations if not (isinstance(op, Free) and op.tensor == tensor)]
    reader_stage.operations.insert(0, Free(tensor=tensor))
    with pytest.raises(ScheduleRejected) as caught:
        simulate(profile, schedule)
    assert caught.value.tensor == tensor
    assert f"reads {tensor!r}, which is not on the device" in str(caught.value)
    assert caught.value.stage == reader_stage.index

"""The simulator on a hand-worked case: every figure is computed by hand in the comments."""

from __future__ import annotations

import json

import pytest

from planner.builder import ScheduleBuilder
from planner.errors import ScheduleRejected
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_schedule


def offload_schedule(profile, early_free: bool = False):
    """a is offloaded after it is computed and prefetched back for b:bwd."""
    builder = ScheduleBuilder(profile)
    builder.stage("a").compute("a").offload("a")  # compute 0-1; d2h 1-3
    if early_free:
        builder.free("a")  # issued at 1, released when the copy ends at 3
    builder.stage("b").compute("b")  # compute 1-4, workspace 5e5 until 4
    if not early_free:
        builder.free("a")  # released at 4
    builder.stage("loss").prefetch("a")  # buffer from 4; h2d 4-6
    builder.compute("loss").free("b")  # compute 4-5; b released at 5
    builder.stage("b:bwd").wait("a", "prefetch")  # compute stream idle 5-6: 1 ms stall
    builder.compute("b:bwd").free("loss").free("a")  # compute 6-8
    builder.stage("a:bwd").compute("a:bwd").free("b:bwd").free("a:bwd")  # compute 8-9
    return builder.build(budget_bytes=None)


def test_hand_worked_offload_and_prefetch(offload_profile):
    result = simulate(offload_profile, offload_schedule(offload_profile))
    assert result.step_time_ms == 9.0
    assert result.stall_time_ms == 1.0
    assert result.compute_busy_ms == 8.0
    assert result.d2h_busy_ms == 2.0 and result.h2d_busy_ms == 2.0
    # At t=1: fixed 100 + a 2e6 + b 1e6 + b's workspace 5e5.
    assert result.peak_memory_bytes == 3_500_100
    assert result.peak_time_ms == 1.0
    assert result.offloaded_bytes == 2_000_000 and result.prefetched_bytes == 2_000_000
    assert result.recompute_time_ms == 0.0
    # At t=4, in program order: b's workspace and a are released, a's prefetch buffer and loss allocated.
    at_four = [p.used_bytes for p in result.memory_timeline if p.time_ms == 4.0]
    assert at_four == [3_000_100, 1_000_100, 3_000_100, 3_000_110]


def test_free_during_offload_waits_for_the_copy(offload_profile):
    """A free issued while the offload runs releases only when the copy ends."""
    builder = ScheduleBuilder(offload_profile)
    builder.stage("a").compute("a")  # 0-1
    builder.stage("b").compute("b").offload("a").free("a")  # compute 1-4; d2h 4-6; a released at 6
    builder.stage("loss").compute("loss").free("b")  # 4-5
    builder.stage("b:bwd").prefetch("a").wait("a", "prefetch")  # buffer at 5; h2d 6-8; stall 5-8
    builder.compute("b:bwd").free("loss").free("a")  # 8-10
    builder.stage("a:bwd").compute("a:bwd").free("b:bwd").free("a:bwd")  # 10-11
    result = simulate(offload_profile, builder.build(None))
    assert result.step_time_ms == 11.0 and result.stall_time_ms == 3.0
    # From 5 to 6 both a's device copy (still being read) and its prefetch buffer are held.
    used = {p.time_ms: p.used_bytes for p in result.memory_timeline}
    assert used[5.0] == 100 + 2_000_000 + 10 + 2_000_000
    assert used[6.0] == 100 + 10 + 2_000_000


def test_one_byte_over_budget_names_the_operation(offload_profile):
    schedule = offload_schedule(offload_profile)
    with pytest.raises(ScheduleRejected) as caught:
        simulate(offload_profile, schedule, budget_bytes=3_500_099)
    rejection = caught.value
    assert rejection.over_budget_bytes == 1
    assert rejection.stage == 1 and rejection.tensor == "b"
    assert rejection.path is not None and rejection.path.startswith("stages[1].operations[")
    assert "1 bytes over the budget" in str(rejection)
    assert simulate(offload_profile, schedule, budget_bytes=3_500_100).peak_memory_bytes == 3_500_100


def test_reading_a_prefetch_without_waiting_is_rejected(offload_profile):
    schedule = offload_schedule(offload_profile)
    stage = schedule.stages[3]
    stage.operations = [op for op in stage.operations if op.op != "wait"]
    with pytest.raises(ScheduleRejected, match="before waiting for its prefetch") as caught:
        simulate(offload_profile, schedule)
    # Where in the document: the JSON path of the compute that reads too early, by position in the file.
    [position] = [k for k, op in enumerate(stage.operations) if op.op == "compute"]
    assert caught.value.path == f"stages[3].operations[{position}]"
    assert str(caught.value).startswith(f"schedule rejected at stages[3].operations[{position}] (")
    assert caught.value.as_dict()["path"] == caught.value.path


def test_prefetch_without_offload_is_rejected(offload_profile):
    builder = ScheduleBuilder(offload_profile)
    builder.stage("a").compute("a").prefetch("a")
    with pytest.raises(ScheduleRejected, match="never offloaded"):
        simulate(offload_profile, builder.build(None))


def test_recomputation_is_counted(offload_profile):
    builder = ScheduleBuilder(offload_profile)
    builder.stage("a").compute("a")
    builder.stage("b").compute("b").free("a")
    builder.stage("loss").compute("loss").free("b")
    builder.stage("b:bwd").compute("a").compute("b:bwd").free("loss").free("a")
    builder.stage("a:bwd").compute("a:bwd").free("b:bwd").free("a:bwd")
    result = simulate(offload_profile, builder.build(None))
    assert result.recompute_time_ms == 1.0
    assert result.step_time_ms == 9.0 and result.stall_time_ms == 0.0


def test_the_first_violation_is_reported_even_when_a_later_operation_is_malformed(offload_profile):
    """Over the budget at stage 1, a free of a tensor the profile does not have at the last stage: the budget is
    the first violation (before, the malformed free hid it)."""
    from planner.schedule import Schedule

    schedule = offload_schedule(offload_profile)
    document = schedule.model_dump(mode="json")
    document["stages"][-1]["operations"].append({"op": "free", "tensor": "ghost"})
    malformed = Schedule.model_validate(document)
    with pytest.raises(ScheduleRejected) as caught:
        simulate(offload_profile, malformed, budget_bytes=3_500_099)
    assert caught.value.over_budget_bytes == 1 and caught.value.stage == 1
    with pytest.raises(ScheduleRejected, match="'ghost' is not a node"):  # within the budget: the malformed free
        simulate(offload_profile, malformed, budget_bytes=3_500_100)
    truncated = schedule.model_copy(update={"stages": schedule.stages[:-1], "compute_order": schedule.compute_order[:-1]})
    with pytest.raises(ScheduleRejected) as caught:
        simulate(offload_profile, truncated, budget_bytes=3_500_099)
    assert caught.value.over_budget_bytes == 1


def test_missing_node_and_order_mismatch(offload_profile):
    schedule = keep_all_schedule(offload_profile)
    truncated = schedule.model_copy(update={"stages": schedule.stages[:-1], "compute_order": schedule.compute_order[:-1]})
    with pytest.raises(ScheduleRejected, match="never computed"):
        simulate(offload_profile, truncated)
    reordered = schedule.model_copy(update={"compute_order": list(reversed(schedule.compute_order))})
    with pytest.raises(ScheduleRejected, match="compute_order disagrees with the operations at position 0: the operations compute 'a' "
                       "there, compute_order lists 'a:bwd'"):
        simulate(offload_profile, reordered)


def test_stages_are_numbered_in_order(offload_profile):
    from planner.errors import ScheduleError
    from planner.schedule import parse_schedule

    document = json.loads(keep_all_schedule(offload_profile).to_json())
    document["stages"][2]["index"] = 92
    with pytest.raises(ScheduleError, match=r"stages: stages are numbered 0, 1, 2, ... in order, but the stage at "
                                            r"position 2 has index 92"):
        parse_schedule(document, "s.json")


def test_schedule_for_another_profile_is_refused(offload_profile):
    schedule = keep_all_schedule(offload_profile).model_copy(update={"profile_digest": "0" * 64})
    with pytest.raises(ScheduleRejected, match="made for another profile"):
        simulate(offload_profile, schedule)


def test_unknown_implementation_is_named(offload_profile):
    schedule = keep_all_schedule(offload_profile)
    schedule.stages[0].operations[0].implementation = "winograd"
    with pytest.raises(ScheduleRejected, match="has no implementation 'winograd'"):
        simulate(offload_profile, schedule)


def test_no_bandwidth_means_no_offload(offload_profile):
    data = offload_profile.model_dump()
    data["hardware"]["d2h_bandwidth_gb_per_s"] = None
    from planner.profile import parse_profile

    profile = parse_profile(data)
    builder = ScheduleBuilder(profile)
    builder.stage("a").compute("a").offload("a")
    with pytest.raises(ScheduleRejected, match="no device-to-host bandwidth"):
        simulate(profile, builder.build(None), check_digest=False)


def test_transfer_latency_is_added(offload_profile):
    data = offload_profile.model_dump()
    data["hardware"]["transfer_latency_ms"] = 0.5
    from planner.profile import parse_profile

    profile = parse_profile(data)
    result = simulate(profile, offload_schedule(profile))
    # h2d now runs 4-6.5, so b:bwd waits from 5 to 6.5.
    assert result.stall_time_ms == 1.5 and result.step_time_ms == 9.5

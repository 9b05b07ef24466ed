"""Which consecutive computations run as one compiled region: the schedule's events and its peak decide."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from executor.engine.regions import live_bytes_before, regions


@dataclass(frozen=True)
class Op:
    kind: str
    group: int
    implementation: str = "default"


def compute(group: int) -> Op:
    return Op("compute", group)


def free(group: int) -> Op:
    return Op("free", group)


def no_workspace(group: int, implementation: str) -> int:
    return 0


def everyone(k: int) -> bool:
    return True


def test_a_chain_of_computations_is_one_region_up_to_the_first_event_that_needs_a_tensor():
    operations = [compute(0), compute(1), free(0), compute(2), Op("offload", 2), compute(3), compute(4)]
    sizes = [10, 10, 10, 10, 10]
    # the peak of this schedule is 40 (0..3 with 0 freed, then 4): a region of 0, 1, 2 holds 30 at most
    assert regions(operations, everyone, sizes, no_workspace) == [(0, 4), (5, 7)]


def test_a_region_that_would_hold_more_than_the_schedule_peak_is_cut():
    # 0 is freed after 1: the schedule holds 20 at most; one region of all three would hold 30 until it returns
    operations = [compute(0), compute(1), free(0), compute(2), free(1)]
    sizes = [10, 10, 10]
    assert live_bytes_before(operations, sizes, no_workspace)[1] == 20
    assert regions(operations, everyone, sizes, no_workspace) == [(0, 2)]


def test_workspace_counts_in_the_bound():
    operations = [compute(0), compute(1), free(0), compute(2)]
    sizes = [10, 10, 1]
    workspace = {0: 0, 1: 0, 2: 15}
    # peak: 10 + 1 + 15 = 26 at computation 2 (0 freed); 0, 1, 2 together would need 10+10+1 + 15
    assert regions(operations, everyone, sizes, lambda g, i: workspace[g]) == [(0, 2)]


def test_computations_that_cannot_join_break_runs_and_single_computations_are_no_region():
    operations = [compute(0), compute(1), compute(2), compute(3), compute(4)]
    sizes = [1] * 5
    assert regions(operations, lambda k: k != 2, sizes, no_workspace) == [(0, 2), (3, 5)]
    assert regions(operations, lambda k: k % 2 == 0, sizes, no_workspace) == []


def test_regions_stay_inside_one_layer_and_inside_the_bounds():
    operations = [compute(g) for g in range(6)]
    sizes = [1] * 6
    layers = {0: "h.0", 1: "h.0", 2: "h.0", 3: "h.1", 4: "h.1", 5: None}
    assert regions(operations, everyone, sizes, no_workspace, layer_of=layers.get) == [(0, 3), (3, 5)]
    assert regions(operations, everyone, sizes, no_workspace, bounds=[(0, 2), (2, 6)]) == [(0, 2), (2, 6)]


def test_a_node_computed_twice_in_a_run_starts_a_new_region():
    operations = [compute(0), compute(1), free(0), compute(0), compute(2)]
    sizes = [1, 1, 1]
    found = regions(operations, everyone, sizes, no_workspace)
    assert found == [(0, 2), (3, 5)]


def test_a_node_freed_and_computed_again_inside_a_run_starts_a_new_region():
    """Its earlier outputs are freed inside the run, then it is recomputed (a recompute-heavy plan's backward): one
    region would make the new outputs in its call, and the free after the call would drop them (a batch norm's
    recomputation, whose statistics' copy then read None)."""
    operations = [compute(0), compute(1), compute(2), free(0), compute(3), compute(0), compute(4)]
    sizes = [1] * 5
    # the first computation of 0 is no region's (a random node, say)
    assert regions(operations, lambda k: k != 0, sizes, no_workspace) == [(1, 5), (5, 7)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=30),
       st.lists(st.integers(1, 100), min_size=6, max_size=6), st.integers(1, 6))
def test_no_region_holds_more_than_the_schedule_peak(steps, sizes, max_nodes):
    """Any schedule of computations and frees: every region starts and ends with a computation, has two or more,
    no node twice, and its worst case (live at its start plus all it computes) is within the schedule's peak."""
    operations, on_device = [], set()
    for group, then_free in steps:
        if group not in on_device:
            operations.append(compute(group))
            on_device.add(group)
        if then_free and on_device:
            victim = sorted(on_device)[group % len(on_device)]
            operations.append(free(victim))
            on_device.discard(victim)
    before, peak = live_bytes_before(operations, sizes, no_workspace)
    found = regions(operations, everyone, sizes, no_workspace, max_nodes=max_nodes)
    previous_end = 0
    for start, end in found:
        assert start >= previous_end
        previous_end = end
        run = operations[start:end]
        assert run[0].kind == "compute" and run[-1].kind == "compute"
        groups = [op.group for op in run if op.kind == "compute"]
        assert 2 <= len(groups) <= max_nodes and len(set(groups)) == len(groups)
        assert all(op.kind in ("compute", "free") for op in run)
        freed = {op.group for op in run if op.kind == "free"}
        assert all(op.group not in freed for k, op in enumerate(run) if op.kind == "compute"
                   and any(o.kind == "free" and o.group == op.group for o in run[:k])), run
        assert before[start] + sum(sizes[g] for g in groups) <= peak

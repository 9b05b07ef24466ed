"""Auto algorithm choice against a brute force that reads the simulator's memory timeline."""

from __future__ import annotations

import pytest
from tests.conftest import make_profile, node

from planner.auto_algorithms import apply_auto
from planner.builder import ScheduleBuilder
from planner.schedule import Compute
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_schedule

MB = 1_000_000


def conv(name, inputs, output_bytes, algorithms, kind="forward", **extra):
    """A node with several (name, time_ms, workspace_bytes) algorithms."""
    return node(
        name,
        kind=kind,
        inputs=inputs,
        output_bytes=output_bytes,
        op_type="conv",
        implementations=[{"name": a, "time_ms": t, "workspace_bytes": w} for a, t, w in algorithms],
        **extra,
    )


ALGORITHMS = [("fft", 1.0, 6 * MB), ("gemm", 2.0, 2 * MB), ("direct", 4.0, 0)]


@pytest.fixture
def tiny():
    return make_profile(
        [
            node("x", output_bytes=2 * MB, time_ms=0.5),
            conv("c1", ["x"], 3 * MB, ALGORITHMS),
            conv("c2", ["c1"], 2 * MB, ALGORITHMS),
            node("loss", kind="loss", inputs=["c2"], output_bytes=10, time_ms=0.1),
            conv("c2:bwd", ["loss", "c1"], 3 * MB, ALGORITHMS, kind="backward", forward_node="c2"),
            conv("c1:bwd", ["c2:bwd", "x"], 2 * MB, ALGORITHMS, kind="backward", forward_node="c1"),
        ],
        fixed_bytes=1 * MB,
        d2h=1.0,
        h2d=1.0,
    )


def offloading_schedule(profile):
    """x is offloaded after c1 starts being needed no more in forward, freed when the copy ends, prefetched back."""
    b = ScheduleBuilder(profile)
    b.stage("x").compute("x")
    b.stage("c1").compute("c1").offload("x").free("x")  # copy 2 ms after c1 ends; release delayed
    b.stage("c2").compute("c2")
    b.stage("loss").compute("loss").free("c2")
    b.stage("c2:bwd").prefetch("x").compute("c2:bwd").free("loss").free("c1")
    b.stage("c1:bwd").wait("x", "prefetch").compute("c1:bwd").free("c2:bwd").free("x").free("c1:bwd")
    return b.build(None)


def peak_during(result, start_ms, end_ms):
    """Largest memory use at any instant in [start, end) according to the simulator's timeline."""
    before = [p.used_bytes for p in result.memory_timeline if p.time_ms < start_ms]
    inside = [p.used_bytes for p in result.memory_timeline if start_ms <= p.time_ms < end_ms]
    return max(inside + before[-1:])


def with_choices(schedule, choices):
    """The schedule with the first len(choices) computes using those implementations."""
    remaining = list(choices)
    stages = []
    for stage in schedule.stages:
        operations = []
        for op in stage.operations:
            if isinstance(op, Compute) and remaining:
                op = Compute(node=op.node, implementation=remaining.pop(0))
            operations.append(op)
        stages.append(stage.model_copy(update={"operations": operations}))
    return schedule.model_copy(update={"stages": stages})


def brute_force_auto(profile, schedule, budget):
    """For each compute in turn, try every implementation with the earlier choices fixed and keep the
    fastest whose run stays within the budget, as measured on the simulator's timeline."""
    computes = [op for _, _, op in schedule.operations() if isinstance(op, Compute)]
    chosen: list[str] = []
    for k, op in enumerate(computes):
        node_ = profile.node_by_id[op.node]
        fitting = []
        for impl in node_.implementations:
            result = simulate(profile, with_choices(schedule, chosen + [impl.name]), budget_bytes=None)
            span = [s for s in result.spans if s.stream == "compute" and not s.label.startswith("stall")][k]
            if peak_during(result, span.start_ms, span.end_ms) <= budget:
                fitting.append(impl)
        best = min(fitting, key=lambda i: (i.time_ms, i.workspace_bytes)) if fitting else node_.smallest_workspace
        chosen.append(best.name)
    return chosen


def chosen_implementations(schedule):
    return [op.implementation for _, _, op in schedule.operations() if isinstance(op, Compute)]


@pytest.mark.parametrize("make_schedule", [keep_all_schedule, offloading_schedule])
def test_matches_brute_force_at_every_budget(tiny, make_schedule):
    schedule = make_schedule(tiny)
    seen = set()
    for budget in range(8 * MB, 20 * MB, MB // 4):
        auto = apply_auto(tiny, schedule, budget)
        choice = chosen_implementations(auto)
        assert choice == brute_force_auto(tiny, schedule, budget), budget
        seen.add(tuple(choice))
    assert len(seen) > 3  # the budgets really exercise different choices


def test_fits_when_the_smallest_workspaces_fit(tiny):
    schedule = offloading_schedule(tiny)
    for budget in range(8 * MB, 20 * MB, MB // 2):
        smallest = with_choices(schedule, [tiny.node_by_id[n].smallest_workspace.name for n in schedule.compute_order])
        try:
            simulate(tiny, smallest, budget_bytes=budget, keep_timeline=False)
        except Exception:
            continue
        auto = apply_auto(tiny, schedule, budget)
        result = simulate(tiny, auto, keep_timeline=False)
        assert result.peak_memory_bytes <= budget
        assert result.compute_busy_ms <= simulate(tiny, smallest, keep_timeline=False).compute_busy_ms


def test_no_budget_means_fastest(tiny):
    auto = apply_auto(tiny, keep_all_schedule(tiny), None)
    assert set(chosen_implementations(auto)) >= {"fft"}
    assert all(
        impl == tiny.node_by_id[n].fastest.name for n, impl in zip(auto.compute_order, chosen_implementations(auto))
    )


def test_too_small_keeps_smallest_workspace_so_the_simulator_reports_it(tiny):
    auto = apply_auto(tiny, keep_all_schedule(tiny), 3 * MB)
    assert all(
        impl == tiny.node_by_id[n].smallest_workspace.name
        for n, impl in zip(auto.compute_order, chosen_implementations(auto))
    )
    assert auto.summary is None and auto.budget_bytes == 3 * MB

"""checkpoint-all: keeps exactly what each node's own backward reads, recomputes the rest, and the simulator agrees.

(The baselines' shared checks, minimum budgets and determinism included, run it too: see test_baselines.BASELINES.)
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.attribute_plans import GraphFacts
from planner.budget import minimum_budget_bytes
from planner.planning import InfeasibleBudget, plan
from planner.schedule import Offload, Prefetch
from planner.simulator import simulate
from planner.strategies.checkpoint_all import checkpoint_attributes
from planner.strategies.keep_all import keep_all_peak_bytes
from tests.conftest import make_profile, node
from tests.strategies_hypothesis import training_profiles
from tests.test_baselines import conv_net, skip_net

MB = 1_000_000


def recomputed(schedule) -> set[str]:
    return {n for n in schedule.compute_order if schedule.compute_order.count(n) > 1}


def test_on_a_conv_relu_chain_conv_outputs_read_only_by_the_next_conv_backward_are_recomputed():
    # conv_net: l0 conv, l1 conv, l2 relu, l3 conv, ...; a conv's backward reads its input, a relu's its output.
    profile = conv_net(layers=9)
    attributes = checkpoint_attributes(profile)
    # l0 (a conv) is read by l1's backward only: not its own, so recomputed; l2 (a relu) is read by its own backward.
    assert attributes["l0"] == "recompute" and attributes["l2"] == "keep" and attributes["x"] == "recompute"
    peak = keep_all_peak_bytes(profile)
    schedule = plan(profile, peak, strategy="checkpoint-all")
    result = simulate(profile, schedule, budget_bytes=peak, keep_timeline=False)
    assert result.peak_memory_bytes < peak  # the recomputed tensors are not held across the step
    assert result.offloaded_bytes == 0 and result.recompute_time_ms > 0
    assert recomputed(schedule) == {t for t, a in attributes.items() if a == "recompute"}
    assert not any(isinstance(op, (Offload, Prefetch)) for stage in schedule.stages for op in stage.operations)


def test_what_stays_between_forward_and_backward_is_only_what_own_backwards_read():
    """At the first backward node, the forward tensors on the device are exactly the checkpoints."""
    profile = skip_net()
    schedule = plan(profile, keep_all_peak_bytes(profile), strategy="checkpoint-all")
    facts = GraphFacts(profile)
    own = {t for t, a in checkpoint_attributes(profile, facts).items() if a == "keep"}
    first_backward = next(s for s in schedule.stages if profile.node_by_id[s.node].kind == "backward")
    resident = set()
    for stage in schedule.stages:
        if stage is first_backward:
            break
        for op in stage.operations:
            if op.op == "compute":
                resident.add(op.node)
            elif op.op == "free":
                resident.discard(op.tensor)
    forward_resident = {t for t in resident if profile.node_by_id[t].kind == "forward"}
    assert forward_resident == own


def test_without_forward_node_links_everything_backward_reads_is_kept():
    profile = make_profile(
        [
            node("a", output_bytes=2 * MB),
            node("b", inputs=["a"], output_bytes=MB),
            node("loss", kind="loss", inputs=["b"], output_bytes=10),
            node("b:bwd", kind="backward", inputs=["loss", "a"], output_bytes=MB),
            node("a:bwd", kind="backward", inputs=["b:bwd"], output_bytes=2 * MB),
        ]
    )
    assert checkpoint_attributes(profile) == {"a": "keep"}
    schedule = plan(profile, keep_all_peak_bytes(profile), strategy="checkpoint-all")
    assert schedule.summary.peak_memory_bytes == keep_all_peak_bytes(profile)
    assert schedule.summary.recompute_time_ms == 0


def test_a_budget_below_its_plan_says_the_smallest_it_meets():
    profile = conv_net()
    fits = plan(profile, keep_all_peak_bytes(profile), strategy="checkpoint-all").summary.peak_memory_bytes
    with pytest.raises(InfeasibleBudget) as caught:
        plan(profile, fits // 2, strategy="checkpoint-all")
    minimum = caught.value.minimum_budget_bytes
    assert minimum is not None and fits // 2 < minimum <= fits
    assert plan(profile, minimum, strategy="checkpoint-all").summary.peak_memory_bytes <= minimum


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(training_profiles(max_forward=7), st.floats(0.0, 1.0))
def test_random_graphs_plan_validly_and_recompute_only_non_checkpoints(profile, fraction):
    attributes = checkpoint_attributes(profile)
    floor = minimum_budget_bytes(profile)
    budget = floor + int((max(keep_all_peak_bytes(profile), floor) - floor) * fraction)
    try:
        schedule = plan(profile, budget, strategy="checkpoint-all")
    except InfeasibleBudget as error:
        assert error.minimum_budget_bytes > budget
        schedule = plan(profile, error.minimum_budget_bytes, strategy="checkpoint-all")
    result = simulate(profile, schedule, keep_timeline=False)
    assert result.peak_memory_bytes <= schedule.budget_bytes
    assert result.offloaded_bytes == 0 and result.stall_time_ms == 0
    kept = {t for t, a in attributes.items() if a == "keep"}
    assert not recomputed(schedule) & kept  # a checkpoint is never recomputed


@pytest.mark.torch
def test_on_the_estimated_vgg19_it_is_keep_all():
    """Every tensor a VGG backward reads is a ReLU, pooling or dropout output that its own backward reads."""
    pytest.importorskip("torch")
    from models.estimator import estimate

    profile = estimate("vgg19", 2, "v100")
    peak = keep_all_peak_bytes(profile)
    schedule = plan(profile, peak, strategy="checkpoint-all")
    assert schedule.summary.peak_memory_bytes == peak
    assert schedule.summary.recompute_time_ms < 1e-3 * schedule.summary.predicted_step_time_ms

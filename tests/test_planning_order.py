"""What every plan's order keeps beyond the data's edges (planner.cpsat.reorder.order_pairs, checked by the
simulator): the nodes that draw random numbers first run in the order they draw, else each draws other numbers than
the step (transformers' Funnel draws its positional dropout after the embeddings' and from constants alone, and the
memory-aware order computed it first: the replay refused the plan); and no backward node runs before the loss (a
backward node made of constants was ordered first: the replay's forward part then never computed the loss)."""

from __future__ import annotations

import json

import pytest

from planner.builder import ScheduleBuilder
from planner.cpsat.reorder import memory_aware_order
from planner.errors import ScheduleRejected
from planner.planning import plan
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_peak_bytes
from tests.conftest import make_profile, node


def _profile():
    return make_profile([
        node("x", output_bytes=1000),
        node("a", inputs=["x"], output_bytes=1_000_000, draws_random=True),  # draws first, and grows memory most
        node("p", output_bytes=1_000_000),  # from constants alone, as Funnel's positional encoding is: made and
        # freed before `a`, the peak would be lower
        node("b", inputs=["p"], output_bytes=10, draws_random=True),
        node("c", inputs=["a", "b"], output_bytes=1000),
        node("loss", kind="loss", inputs=["c"], output_bytes=4),
        node("zeros:bwd", kind="backward", output_bytes=10),  # reads nothing: ready from the start
        node("c:bwd", kind="backward", inputs=["loss", "zeros:bwd", "a"], output_bytes=1000, forward_node="c"),
        node("a:bwd", kind="backward", inputs=["c:bwd", "x"], output_bytes=1000, forward_node="a"),
    ])


def _in_order(profile, order):
    builder = ScheduleBuilder(profile)
    for node_id in order:
        builder.stage(node_id).compute(node_id)
    return builder.build(None)


def test_the_memory_aware_order_draws_in_the_steps_order_and_starts_the_backward_at_the_loss():
    profile = _profile()
    order, _ = memory_aware_order(profile)
    assert order.index("a") < order.index("b")
    assert all(order.index(backward) > order.index("loss") for backward in ("zeros:bwd", "c:bwd", "a:bwd"))


@pytest.mark.parametrize("order, said", [
    (["p", "b", "x", "a", "c", "loss", "zeros:bwd", "c:bwd", "a:bwd"],
     "'b' draws random numbers before 'a', which draws first in the step"),
    (["zeros:bwd", "x", "a", "p", "b", "c", "loss", "c:bwd", "a:bwd"],
     "backward node 'zeros:bwd' is computed before the loss 'loss'"),
])
def test_the_simulator_rejects_a_plan_in_another_order(order, said):
    profile = _profile()
    with pytest.raises(ScheduleRejected, match=said):
        simulate(profile, _in_order(profile, order))
    simulate(profile, _in_order(profile, profile.order))  # the listed order keeps both


@pytest.mark.parametrize("strategy", ["mosos", "recompute-only", "keep-all"])
def test_plans_keep_the_order(strategy):
    profile = _profile()
    schedule = plan(profile, keep_all_peak_bytes(profile), strategy=strategy, time_limit_s=5, workers=1)
    simulate(profile, schedule)  # rejects a plan in another order
    computed = [stage.node for stage in schedule.stages if stage.node is not None]
    assert computed.index("a") < computed.index("b")


def test_a_profile_with_no_random_node_is_written_as_before():
    """The field is left out where false: older profiles keep their digests, and the schedules made for them."""
    profile = _profile()
    written = json.loads(profile.to_json())
    assert [n["id"] for n in written["nodes"] if "draws_random" in n] == ["a", "b"]
    plain = make_profile([node("x"), node("loss", kind="loss", inputs=["x"])])
    assert "draws_random" not in plain.to_json()


@pytest.mark.parametrize("value", [0, 1, "true", None])
def test_draws_random_is_a_boolean(value):
    from planner.errors import ProfileError

    with pytest.raises(ProfileError, match=r"nodes\[0\]\.draws_random: must be true or false, not "):
        make_profile([node("a", draws_random=value), node("loss", kind="loss", inputs=["a"])])

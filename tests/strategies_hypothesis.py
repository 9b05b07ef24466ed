"""Hypothesis strategies for random valid training-graph profiles."""

from __future__ import annotations

from hypothesis import strategies as st

from tests.conftest import make_profile, node


@st.composite
def training_profiles(draw, max_forward: int = 8, with_bandwidth: bool = True):
    """A forward DAG, a loss, and one backward node per forward node reading what a real backward reads."""
    forward_count = draw(st.integers(1, max_forward))
    sizes = st.integers(0, 5_000_000)
    times = st.floats(0.0, 50.0, allow_nan=False, allow_infinity=False)

    def implementations():
        count = draw(st.integers(1, 3))
        return [
            {"name": f"algo{i}", "time_ms": draw(times), "workspace_bytes": draw(st.integers(0, 3_000_000))}
            for i in range(count)
        ]

    nodes = []
    for i in range(forward_count):
        earlier = [f"f{j}" for j in range(i)]
        inputs = draw(st.lists(st.sampled_from(earlier), max_size=3, unique=True)) if earlier else []
        if earlier and not inputs:
            inputs = [earlier[-1]]
        nodes.append(node(f"f{i}", inputs=inputs, output_bytes=draw(sizes), implementations=implementations()))
    nodes.append(node("loss", kind="loss", inputs=[f"f{forward_count - 1}"], output_bytes=draw(st.integers(0, 100)), time_ms=draw(times)))
    previous = "loss"
    for i in reversed(range(forward_count)):
        forward_inputs = nodes[i]["inputs"] or [f"f{i}"]
        inputs = [previous] + forward_inputs[:2]
        nodes.append(
            node(f"f{i}:bwd", kind="backward", inputs=inputs, output_bytes=draw(sizes), forward_node=f"f{i}", implementations=implementations())
        )
        previous = f"f{i}:bwd"
    bandwidth = draw(st.floats(0.5, 50.0)) if with_bandwidth else None
    return make_profile(nodes, fixed_bytes=draw(st.integers(0, 10_000_000)), d2h=bandwidth, h2d=bandwidth)

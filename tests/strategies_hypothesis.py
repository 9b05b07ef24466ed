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


@st.composite
def residual_profiles(draw, max_blocks: int = 4, with_bandwidth: bool = True):
    """Residual blocks as a ResNet's: conv -> bn -> add(shortcut) -> relu, with the backward reading what
    PyTorch's does (conv: its input; bn: its input; relu: its output; add: nothing), so the sum and the bn's
    output die in the forward: recomputing a relu means recomputing them first."""
    blocks = draw(st.integers(1, max_blocks))
    sizes = st.integers(1, 4_000_000)

    def timed(name, kind, inputs, **extra):
        return node(name, kind=kind, inputs=inputs, output_bytes=draw(sizes), time_ms=draw(st.floats(0.1, 20.0)), **extra)

    nodes = [timed("stem", "forward", [])]
    previous = "stem"
    for b in range(blocks):
        conv, bn, add, relu = f"conv{b}", f"bn{b}", f"add{b}", f"relu{b}"
        nodes += [timed(conv, "forward", [previous]), timed(bn, "forward", [conv]),
                  timed(add, "forward", [bn, previous]), timed(relu, "forward", [add])]
        previous = relu
    nodes.append(timed("loss", "loss", [previous]))
    gradient = "loss"
    for b in reversed(range(blocks)):
        conv, bn, relu = f"conv{b}", f"bn{b}", f"relu{b}"
        block_input = f"relu{b - 1}" if b else "stem"
        nodes += [
            timed(f"{relu}:bwd", "backward", [gradient, relu], forward_node=relu),
            timed(f"{bn}:bwd", "backward", [f"{relu}:bwd", conv], forward_node=bn),
            timed(f"{conv}:bwd", "backward", [f"{bn}:bwd", block_input], forward_node=conv),
        ]
        gradient = f"{conv}:bwd"
    nodes.append(timed("stem:bwd", "backward", [gradient]))
    bandwidth = draw(st.sampled_from([0.002, 0.01, 0.05, 1.0, 10.0])) if with_bandwidth else None  # slow: recompute too
    return make_profile(nodes, fixed_bytes=draw(st.integers(0, 2_000_000)), d2h=bandwidth, h2d=bandwidth)

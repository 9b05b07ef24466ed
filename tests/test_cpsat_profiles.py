"""Small hand-made profiles with several algorithms per convolution, shared by the CP-SAT tests (no tests here)."""

from __future__ import annotations

from tests.conftest import make_profile, node


def conv_implementations(time_ms: float, workspace_bytes: int) -> list[dict]:
    """A fast algorithm with a big workspace, a middle one, and a slow one with none (like cuDNN's)."""
    return [
        {"name": "fast", "time_ms": time_ms, "workspace_bytes": workspace_bytes},
        {"name": "mid", "time_ms": time_ms * 1.5, "workspace_bytes": workspace_bytes // 4},
        {"name": "slow", "time_ms": time_ms * 3, "workspace_bytes": 0},
    ]


def small_cnn(layers: int = 6, size_bytes: int = 1_000_000, bandwidth_gb_per_s: float | None = 2.0):
    """A chain of convolutions, a loss, and the backward chain reading the forward activations."""
    nodes, previous = [], None
    for i in range(layers):
        nodes.append(
            node(f"f{i}", inputs=[previous] if previous else [], output_bytes=size_bytes,
                 implementations=conv_implementations(2.0, size_bytes))
        )
        previous = f"f{i}"
    nodes.append(node("loss", kind="loss", inputs=[previous], output_bytes=16, time_ms=0.5))
    gradient = "loss"
    for i in reversed(range(layers)):
        inputs = [gradient] + ([f"f{i - 1}"] if i > 0 else []) + [f"f{i}"]
        nodes.append(
            node(f"b{i}", kind="backward", inputs=inputs, output_bytes=size_bytes, forward_node=f"f{i}",
                 implementations=conv_implementations(3.0, size_bytes))
        )
        gradient = f"b{i}"
    return make_profile(nodes, fixed_bytes=500_000, d2h=bandwidth_gb_per_s, h2d=bandwidth_gb_per_s)


def branchy(bandwidth_gb_per_s: float | None = 4.0):
    """A residual-style graph: a skip connection and a node read by three others."""
    impls = conv_implementations
    nodes = [
        node("a", output_bytes=800_000, implementations=impls(1.0, 400_000)),
        node("b", inputs=["a"], output_bytes=600_000, implementations=impls(2.0, 600_000)),
        node("c", inputs=["b"], output_bytes=600_000, time_ms=0.5),
        node("d", inputs=["a", "c"], output_bytes=800_000, implementations=impls(1.5, 300_000)),
        node("loss", kind="loss", inputs=["d"], output_bytes=8, time_ms=0.2),
        node("d:bwd", kind="backward", inputs=["loss", "a", "c"], output_bytes=800_000, forward_node="d",
             implementations=impls(2.0, 500_000)),
        node("c:bwd", kind="backward", inputs=["d:bwd", "b"], output_bytes=600_000, forward_node="c", time_ms=0.6),
        node("b:bwd", kind="backward", inputs=["c:bwd", "a", "b"], output_bytes=600_000, forward_node="b",
             implementations=impls(2.5, 600_000)),
        node("a:bwd", kind="backward", inputs=["b:bwd", "d:bwd", "a"], output_bytes=800_000, forward_node="a",
             implementations=impls(1.5, 200_000)),
    ]
    return make_profile(nodes, fixed_bytes=100_000, d2h=bandwidth_gb_per_s, h2d=bandwidth_gb_per_s)

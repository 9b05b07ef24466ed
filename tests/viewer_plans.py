"""Plans for the viewer's tests and benchmark: a small hand-made one and a long synthetic one, both with every
kind of operation (compute, recompute, offload, prefetch, stall), both certified by the simulator."""

from __future__ import annotations

from planner.builder import ScheduleBuilder, certify
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import simulate
from tests.conftest import make_profile, node


def handmade_plan() -> tuple[GraphProfile, Schedule]:
    """Five nodes; `a` offloaded and prefetched (the wait stalls 2 ms), `b` recomputed with another algorithm.

    Compute: a 0-1, b[slow] 1-6, loss 6-7, stall 7-9, b[fast] 9-12, b:bwd 12-14, a:bwd 14-15.
    Copies: offload a 1-3, prefetch a 7-9 (2 MB at 1 GB/s).
    """
    profile = make_profile(
        [
            node("a", output_bytes=2_000_000, time_ms=1.0),
            node("b", inputs=["a"], output_bytes=1_000_000, implementations=[
                {"name": "fast", "time_ms": 3.0, "workspace_bytes": 500_000},
                {"name": "slow", "time_ms": 5.0, "workspace_bytes": 0},
            ]),
            node("loss", kind="loss", inputs=["b"], output_bytes=10, time_ms=1.0),
            node("b:bwd", kind="backward", inputs=["loss", "a", "b"], output_bytes=1_000_000, time_ms=2.0,
                 forward_node="b"),
            node("a:bwd", kind="backward", inputs=["b:bwd"], output_bytes=2_000_000, time_ms=1.0),
        ],
        fixed_bytes=100,
        d2h=1.0,
        h2d=1.0,
    )
    builder = ScheduleBuilder(profile)
    builder.stage("a").compute("a").offload("a")
    builder.stage("b").compute("b", "slow").wait("a", "offload").free("a")
    builder.stage("loss").compute("loss").free("b").prefetch("a").wait("a", "prefetch").compute("b", "fast")
    builder.stage("b:bwd").compute("b:bwd").free("loss").free("b").free("a")
    builder.stage("a:bwd").compute("a:bwd").free("b:bwd")
    return profile, certify(profile, builder.build(10_000_000), "handmade")


def _kind(layer: int, layers: int) -> str:
    if layer == layers - 1 or layer % 3 == 0:
        return "keep"
    return "offload" if layer % 3 == 1 else "recompute"


def long_plan(layers: int = 1000, name: str = "synthetic chain") -> tuple[GraphProfile, Schedule]:
    """2 * layers + 1 nodes: a chain whose layers are kept, offloaded (prefetched two layers ahead) or recomputed
    in turn; every 7th layer runs its slower, workspace-free algorithm; some copies outlast the compute and stall.
    """
    nodes = []
    for layer in range(layers):
        time_ms = 0.4 + 0.3 * ((layer * 7) % 5)
        size_bytes = 3_000_000 + 1_000_000 * ((layer * 3) % 4)
        nodes.append(node(
            f"f{layer}", inputs=[f"f{layer - 1}"] if layer else [], output_bytes=size_bytes, name=f"layer{layer} (conv)",
            op_type="conv2d", implementations=[
                {"name": "fast", "time_ms": time_ms, "workspace_bytes": 2_000_000},
                {"name": "lean", "time_ms": time_ms * 1.4, "workspace_bytes": 0},
            ],
        ))
    nodes.append(node("loss", kind="loss", inputs=[f"f{layers - 1}"], output_bytes=1000, time_ms=0.1))
    for layer in reversed(range(layers)):
        upstream = "loss" if layer == layers - 1 else f"b{layer + 1}"
        nodes.append(node(
            f"b{layer}", kind="backward", inputs=[upstream, f"f{layer}"], output_bytes=nodes[layer]["output_bytes"],
            time_ms=0.9, name=f"layer{layer} (conv backward)", op_type="conv2d_backward", forward_node=f"f{layer}",
        ))
    profile = make_profile(nodes, fixed_bytes=500_000_000, d2h=8.0, h2d=8.0, latency_ms=0.01, name=name)
    builder = ScheduleBuilder(profile)
    for layer in range(layers):
        builder.stage(f"f{layer}").compute(f"f{layer}", "lean" if layer % 7 == 0 else "fast")
        if layer:
            previous = _kind(layer - 1, layers)
            if previous == "offload":
                builder.wait(f"f{layer - 1}", "offload").free(f"f{layer - 1}")
            elif previous == "recompute":
                builder.free(f"f{layer - 1}")
        if _kind(layer, layers) == "offload":
            builder.offload(f"f{layer}")
    builder.stage("loss").compute("loss")
    prefetched: set[int] = set()
    waited: set[int] = set()

    def prefetch(layer: int) -> None:
        if layer >= 0 and _kind(layer, layers) == "offload" and layer not in prefetched:
            builder.prefetch(f"f{layer}")
            prefetched.add(layer)

    def ready(layer: int) -> None:
        prefetch(layer)
        if _kind(layer, layers) == "offload" and layer not in waited:
            builder.wait(f"f{layer}", "prefetch")
            waited.add(layer)

    for layer in reversed(range(layers)):
        builder.stage(f"b{layer}")
        prefetch(layer - 2)
        if _kind(layer, layers) == "recompute":
            ready(layer - 1)
            builder.compute(f"f{layer}")
        ready(layer)
        builder.compute(f"b{layer}")
        builder.free("loss" if layer == layers - 1 else f"b{layer + 1}").free(f"f{layer}")
    unbounded = builder.build(None)
    peak = simulate(profile, unbounded, keep_timeline=False).peak_memory_bytes
    return profile, certify(profile, unbounded.model_copy(update={"budget_bytes": int(peak * 1.05)}), "synthetic")

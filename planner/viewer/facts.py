"""What the viewer shows, read off the simulator's replay of a schedule (never the planner's own objective).

A node's decision follows from what the replay did with its tensor: offloaded (at
least one offload span), recomputed (computed more than once), both, or kept. The
algorithm it ran is the implementation of its compute spans, set against the
profile's fastest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.profile import GraphProfile
from planner.simulator import STREAMS, SimulationResult, Span

SPAN_KINDS = ("compute", "recompute", "offload", "prefetch", "stall")
DECISIONS = ("keep", "offload", "recompute", "offload + recompute")


@dataclass
class NodeFacts:
    """One row of the decision table."""

    position: int  # in the profile's execution order
    id: str
    label: str
    kind: str  # forward, loss, backward
    op_type: str
    size_bytes: int
    fastest: str
    fastest_time_ms: float
    fastest_workspace_bytes: int
    computations: int = 0
    offloads: int = 0
    prefetches: int = 0
    implementations: list[str] = field(default_factory=list)  # chosen, in order of first use
    time_ms: float = 0.0  # of the first computation's implementation
    workspace_bytes: int = 0
    first_start_ms: float | None = None

    @property
    def decision(self) -> str:
        if self.offloads and self.computations > 1:
            return "offload + recompute"
        if self.offloads:
            return "offload"
        if self.computations > 1:
            return "recompute"
        return "keep"

    @property
    def slower_than_fastest_ms(self) -> float:
        return self.time_ms - self.fastest_time_ms

    @property
    def algorithm_changed(self) -> bool:
        return any(name != self.fastest for name in self.implementations)


@dataclass
class PlanFacts:
    profile: GraphProfile
    result: SimulationResult
    nodes: list[NodeFacts]
    node_index: dict[str, int]
    spans: dict[str, list[Span]]  # per stream, by start time

    @property
    def domain_ms(self) -> float:
        """The time axis' extent: the step, or 1 ms for a step that takes no time."""
        return self.result.step_time_ms if self.result.step_time_ms > 0 else 1.0

    def count(self, kind: str) -> int:
        return sum(1 for spans in self.spans.values() for span in spans if span.kind == kind)

    def total_ms(self, kind: str) -> float:
        return sum(span.end_ms - span.start_ms for spans in self.spans.values() for span in spans if span.kind == kind)

    def decisions(self) -> dict[str, int]:
        counts = dict.fromkeys(DECISIONS, 0)
        for node in self.nodes:
            counts[node.decision] += 1
        return counts


def plan_facts(profile: GraphProfile, result: SimulationResult) -> PlanFacts:
    if not result.memory_timeline:
        raise ValueError("the viewer needs a replay with its timeline (simulate(..., keep_timeline=True))")
    nodes: list[NodeFacts] = []
    for position, node_id in enumerate(profile.order):
        node = profile.node_by_id[node_id]
        fastest = node.fastest
        nodes.append(
            NodeFacts(
                position=position,
                id=node.id,
                label=node.label,
                kind=node.kind,
                op_type=node.op_type,
                size_bytes=node.size_bytes,
                fastest=fastest.name,
                fastest_time_ms=fastest.time_ms,
                fastest_workspace_bytes=fastest.workspace_bytes,
            )
        )
    node_index = {node.id: index for index, node in enumerate(nodes)}
    spans: dict[str, list[Span]] = {stream: [] for stream in STREAMS}
    for span in result.spans:
        spans[span.stream].append(span)
        facts = nodes[node_index[span.node]]
        if span.kind in ("compute", "recompute"):
            if facts.computations == 0:
                implementation = profile.node_by_id[span.node].implementation(span.implementation)
                facts.time_ms = implementation.time_ms
                facts.workspace_bytes = implementation.workspace_bytes
                facts.first_start_ms = span.start_ms
            facts.computations += 1
            if span.implementation not in facts.implementations:
                facts.implementations.append(span.implementation)
        elif span.kind == "offload":
            facts.offloads += 1
        elif span.kind == "prefetch":
            facts.prefetches += 1
    for stream_spans in spans.values():
        stream_spans.sort(key=lambda span: span.start_ms)
    return PlanFacts(profile=profile, result=result, nodes=nodes, node_index=node_index, spans=spans)

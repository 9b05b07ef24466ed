"""Measured against planned: what the first planned steps took, beside what the simulator said they would.

A profile's node times come from the measuring pass; the planned step runs
the same operations in another order, with other neighbours in the cache,
recomputations and frees between them. The first steps of a PlannedModule
are timed node by node (executor.engine.runtime.TimedStepRuntime); where the whole
step is more than `REPLAN_OFF` off the simulated one, the module re-plans once
on a profile whose node times are the measured ones, so that the plan is made
for the step that runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.profile import GraphProfile, parse_profile
from planner.schedule import Compute, Schedule
from planner.units import format_bytes

if TYPE_CHECKING:
    from executor.engine.compiled_nodes import CompiledNodes
    from executor.engine.device_memory import HeldRecord

REPLAN_OFF = 0.10
SHOWN_NODES = 10


@dataclass
class NodeDifference:
    node_id: str
    implementation: str
    measured_ms: float
    profiled_ms: float

    @property
    def difference_ms(self) -> float:
        return self.measured_ms - self.profiled_ms


@dataclass
class StepReport:
    strategy: str
    steps_timed: int
    measured_step_time_ms: float  # the least over the timed steps (the first may run cold)
    simulated_step_time_ms: float
    measured_peak_bytes: int | None  # the ledger's (CPU) or torch.cuda.max_memory_allocated (GPU)
    simulated_peak_bytes: int
    budget_bytes: int | None
    nodes: list[NodeDifference]  # every computed node, largest absolute difference first
    replanned: bool = False
    replan_step_time_ms: float | None = None  # the new plan's simulated step
    replan_failed: str | None = None  # why re-planning found no plan (the current one stays: it fits the budget)
    replan_kept: bool = False  # off, but its plan came from the cache and decides the rounding: not re-planned
    history: list["StepReport"] = field(default_factory=list)  # reports before a re-plan
    compiled: "CompiledNodes | None" = None  # compile=True: the nodes run as kernels, the eager ones and why
    # what the device held in every step so far (reserved segments, outside the allocator) against the budget; None
    # where nothing reads a device (the CPU, whose ledger is what a step holds)
    held: "HeldRecord | None" = None

    @property
    def ratio(self) -> float:
        return self.measured_step_time_ms / self.simulated_step_time_ms if self.simulated_step_time_ms else float("inf")

    @property
    def off(self) -> bool:
        return abs(self.ratio - 1) > REPLAN_OFF

    def describe(self) -> str:
        lines = []
        for earlier in self.history:
            lines.append(earlier.describe())
            lines.append("")
        peak = (f"measured peak {format_bytes(self.measured_peak_bytes)}, " if self.measured_peak_bytes is not None
                else "")
        budget = f" of the budget {format_bytes(self.budget_bytes)}" if self.budget_bytes is not None else ""
        lines.append(f"{self.strategy}: measured step {self.measured_step_time_ms:.2f} ms, simulated "
                     f"{self.simulated_step_time_ms:.2f} ms (ratio {self.ratio:.3f}, over {self.steps_timed} timed "
                     f"steps); {peak}simulated peak {format_bytes(self.simulated_peak_bytes)}{budget}")
        if self.replanned:
            lines.append(f"more than {REPLAN_OFF:.0%} off: re-planned on the measured node times (new plan's "
                         f"simulated step {self.replan_step_time_ms:.2f} ms)")
        if self.replan_failed:
            lines.append(f"more than {REPLAN_OFF:.0%} off, but re-planning on the measured node times found no plan, "
                         f"so the current one stays (it fits the budget): {self.replan_failed}")
        if self.replan_kept:
            lines.append(f"more than {REPLAN_OFF:.0%} off, but the plan came from the cache and its picks decide the "
                         "rounding (compiled kernels, convolution algorithms): kept as it is, so runs sharing it run "
                         "the same bits")
        if self.held is not None:
            lines.append(self.held.describe())
        if self.compiled is not None:
            lines.append(f"compiled: {self.compiled.describe()}")
            for node_id, reason in self.compiled.eager.items():
                if reason.startswith("Inductor refused"):
                    lines.append(f"  eager {node_id}: {reason}")
        lines.append("nodes that differ most (measured / profiled ms):")
        for node in self.nodes[:SHOWN_NODES]:
            lines.append(f"  {node.node_id} [{node.implementation}]: {node.measured_ms:.3f} / {node.profiled_ms:.3f} "
                         f"({node.difference_ms:+.3f})")
        return "\n".join(lines)


def implementations_run(schedule: Schedule) -> dict[str, str]:
    return {op.node: op.implementation for _, _, op in schedule.operations() if isinstance(op, Compute)}


def node_differences(profile: GraphProfile, schedule: Schedule, measured_ms: dict[str, float]) -> list[NodeDifference]:
    nodes = profile.node_by_id
    differences = []
    for node_id, implementation in implementations_run(schedule).items():
        if node_id not in measured_ms:
            continue
        profiled = next(i.time_ms for i in nodes[node_id].implementations if i.name == implementation)
        differences.append(NodeDifference(node_id, implementation, measured_ms[node_id], profiled))
    return sorted(differences, key=lambda d: -abs(d.difference_ms))


def measured_profile(profile: GraphProfile, schedule: Schedule, measured_ms: dict[str, float]) -> GraphProfile:
    """`profile` with the time of each node's implementation that ran replaced by what the planned step measured
    (the others scaled by the same factor, so their order against it stays as measured)."""
    ran = implementations_run(schedule)
    document = profile.model_dump(mode="json")
    for node in document["nodes"]:
        implementation = ran.get(node["id"])
        if implementation is None or node["id"] not in measured_ms:
            continue
        before = next(i["time_ms"] for i in node["implementations"] if i["name"] == implementation)
        factor = measured_ms[node["id"]] / before if before > 0 else 1.0
        for entry in node["implementations"]:
            entry["time_ms"] = measured_ms[node["id"]] if entry["name"] == implementation else entry["time_ms"] * factor
    provenance = document["provenance"]
    provenance["notes"] = ((provenance.get("notes") or "") + "; node times re-measured on the planned step "
                           f"({profile.name})").lstrip("; ")

    return parse_profile(document, "re-measured profile")


__all__ = ["REPLAN_OFF", "StepReport", "NodeDifference", "measured_profile", "node_differences"]

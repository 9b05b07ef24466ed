"""keep-all: the fastest implementation everywhere, each tensor freed after its last use."""

from __future__ import annotations

from planner.builder import ScheduleBuilder, certify
from planner.errors import InfeasibleBudget
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import simulate
from planner.strategies import strategy
from planner.units import format_bytes


def keep_all_schedule(profile: GraphProfile, budget_bytes: int | None = None) -> Schedule:
    builder = ScheduleBuilder(profile)
    last_reader = {node_id: node_id for node_id in profile.order}
    for node_id in profile.order:
        for source in profile.node_by_id[node_id].inputs:
            last_reader[source] = node_id
    freed_after: dict[str, list[str]] = {node_id: [] for node_id in profile.order}
    for tensor, reader in last_reader.items():
        freed_after[reader].append(tensor)
    for node_id in profile.order:
        builder.stage(node_id).compute(node_id)
        for tensor in sorted(freed_after[node_id], key=profile.position.__getitem__):
            builder.free(tensor)
    return builder.build(budget_bytes)


_PEAKS: dict[str, int] = {}


def keep_all_peak_bytes(profile: GraphProfile) -> int:
    """Peak memory of the keep-all plan: the reference for memory ratios (remembered per profile digest)."""
    digest = profile.digest()
    if digest not in _PEAKS:
        if len(_PEAKS) > 64:
            _PEAKS.clear()
        _PEAKS[digest] = simulate(profile, keep_all_schedule(profile), keep_timeline=False).peak_memory_bytes
    return _PEAKS[digest]


@strategy("keep-all", "fastest implementation everywhere, nothing recomputed or moved, no budget: the lower bound", uses_budget=False)
def plan_keep_all(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    """Without a budget, the lower bound; with one, a plan like any other: refused where its peak is over it."""
    schedule = certify(profile, keep_all_schedule(profile, None), "keep-all")
    if budget_bytes is None:
        return schedule
    peak_bytes = schedule.summary.peak_memory_bytes
    if peak_bytes > budget_bytes:
        raise InfeasibleBudget(
            f"strategy 'keep-all' finds no plan within {budget_bytes} bytes ({format_bytes(budget_bytes)}): keeping "
            f"every tensor peaks at {peak_bytes} bytes ({format_bytes(peak_bytes)}), the smallest budget it can meet",
            minimum_budget_bytes=peak_bytes,
        )
    return certify(profile, schedule.model_copy(update={"budget_bytes": budget_bytes}), "keep-all")

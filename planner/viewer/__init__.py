"""A plan viewer people can look at: one self-contained HTML page per plan.

The page shows the three streams (compute, device-to-host, host-to-device) on a
time axis with every operation coloured by kind (compute, recompute, offload,
prefetch, stall), the memory curve against the budget on the same axis, and a
table of nodes with their decision and algorithm (chosen against fastest). Hover
reads any operation or instant; the wheel zooms and dragging pans the time axis.
Everything shown comes from the simulator's replay of the schedule.

Why SVG written here, and not a charting library: the page must open with no
network (clusters are often offline) and the project has no JavaScript build.
A charting library vendored through a package manager (Plotly, ECharts, uPlot
from npm or a Python wheel that bundles one) would put hundreds of kilobytes of
someone else's minified code into every page, inside the page's trust boundary,
for a picture that is bars on three lanes and one step curve. So the server
writes that picture as SVG in data coordinates, and about 400 lines of plain
inline script handle zoom, pan, hover and the table. A 2,000-node plan is a few
thousand rectangles in groups that a zoom moves with one transform each; hover
finds operations by binary search in time, not by hit-testing elements; the node
table holds only the rows in view (laid out in full, the 2,001-node page had 67,698
DOM nodes and 1.2-2.9 s of layout). Load and interaction times are measured in the
browser test and in benchmarks/viewer.py.
"""

from __future__ import annotations

from pathlib import Path

from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.simulator import SimulationResult, simulate
from planner.viewer.facts import NodeFacts, PlanFacts, plan_facts
from planner.viewer.page import content_security_policy, render_page

__all__ = [
    "NodeFacts",
    "PlanFacts",
    "content_security_policy",
    "plan_facts",
    "plan_view_html",
    "write_plan_view",
]


def plan_view_html(
    profile: GraphProfile,
    schedule: Schedule,
    result: SimulationResult | None = None,
    *,
    title: str | None = None,
) -> str:
    """The page for `schedule` on `profile`; `result` is the simulator's replay (made here when not given)."""
    if result is None or not result.memory_timeline:
        result = simulate(profile, schedule)
    strategy = schedule.summary.strategy if schedule.summary is not None else None
    title = title or (f"{profile.name} ({strategy})" if strategy else profile.name)
    return render_page(plan_facts(profile, result), schedule, title)


def write_plan_view(
    profile: GraphProfile,
    schedule: Schedule,
    path: str | Path,
    result: SimulationResult | None = None,
    *,
    title: str | None = None,
) -> None:
    Path(path).write_text(plan_view_html(profile, schedule, result, title=title), encoding="utf-8")

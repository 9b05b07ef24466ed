"""chen-sqrt: Chen et al. 2016, "Training deep nets with sublinear memory cost", the sqrt(n) plan.

The forward pass is cut into about sqrt(n) segments of consecutive nodes. The
tensor at each segment boundary is kept; everything else is freed after its
last forward use and recomputed, from the boundary before it, when backward
first needs it (recomputing a segment's prefix once keeps its outputs for the
rest of that segment's backward, as the paper's segment recomputation does).

On a DAG the segments are cut where the graph narrows to one tensor
(articulation points of the forward pass, the paper's candidate split points);
where none is near, a segment is cut anyway and every tensor crossing the cut
is kept too, so a segment is always recomputable from what was kept. The last
segment is kept whole: backward starts with it, so recomputing it would only
cost time. Algorithms: the fastest; when that plan does not fit, Auto's choice.
"""

from __future__ import annotations

import math

from planner.attribute_plans import AttributeProgram, GraphFacts
from planner.budget_search import plan_fixed_recompute
from planner.liveness import build_schedule
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import strategy

NAME = "chen-sqrt"


def crossing_tensors(profile: GraphProfile, facts: GraphFacts) -> list[set[str]]:
    """For each forward position i, the tensors made at or before i that a later forward node (or the loss) reads."""
    forward = facts.forward
    index = {node_id: i for i, node_id in enumerate(forward)}
    by_id = profile.node_by_id
    starts: dict[int, list[str]] = {}
    ends: dict[int, list[str]] = {}
    for t in forward:
        readers = [r for r in profile.consumers[t] if by_id[r].kind != "backward"]
        last = max((index.get(r, len(forward)) for r in readers), default=index[t])
        if last > index[t]:
            starts.setdefault(index[t], []).append(t)
            ends.setdefault(last, []).append(t)  # no longer crossing once position `last` is reached
    crossing: list[set[str]] = []
    active: set[str] = set()
    for i in range(len(forward)):
        active.difference_update(ends.get(i, ()))
        active.update(starts.get(i, ()))
        crossing.append(set(active))
    return crossing


def checkpoints(profile: GraphProfile, facts: GraphFacts) -> tuple[set[str], list[int]]:
    """Tensors to keep, and the forward positions where segments end."""
    forward = facts.forward
    n = len(forward)
    if n == 0:
        return set(), []
    length = max(1, math.isqrt(n - 1) + 1 if n > 1 else 1)  # ceil(sqrt(n))
    crossing = crossing_tensors(profile, facts)
    keep: set[str] = set()
    boundaries: list[int] = []
    since = 0
    for i, node_id in enumerate(forward):
        since += 1
        narrow = crossing[i] <= {node_id}
        if (since >= length and narrow) or since >= 2 * length:
            boundaries.append(i)
            keep.add(node_id)
            keep.update(crossing[i])
            since = 0
    last = boundaries[-1] + 1 if boundaries else 0
    keep.update(forward[last:])
    return keep, boundaries


def chen_schedule(profile: GraphProfile, facts: GraphFacts | None = None) -> Schedule:
    facts = facts or GraphFacts(profile)
    keep, _ = checkpoints(profile, facts)
    attributes = {t: ("keep" if t in keep else "recompute") for t in facts.forward}
    program = AttributeProgram(profile, attributes, facts=facts)
    return build_schedule(profile, program.build_steps(), None)


@strategy(NAME, "Chen et al. sqrt(n) checkpointing: keep about sqrt(n) segment boundaries, recompute each segment in backward; fastest algorithms, Auto when they do not fit")
def plan_chen_sqrt(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return plan_fixed_recompute(profile, chen_schedule(profile), budget_bytes, NAME, options)


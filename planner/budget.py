"""What a budget must at least be, and budgets given as a fraction of the keep-all peak."""

from __future__ import annotations

import numbers

from planner.errors import BudgetError
from planner.profile import GraphProfile
from planner.units import MAX_SIZE_BYTES, format_bytes


def node_floor_bytes(profile: GraphProfile, node_id: str) -> int:
    """Memory that computing `node_id` needs at least: its inputs, its output and its smallest workspace."""
    node = profile.node_by_id[node_id]
    inputs = sum(profile.node_by_id[source].size_bytes for source in dict.fromkeys(node.inputs))
    return inputs + node.size_bytes + node.smallest_workspace.workspace_bytes


def node_floor_parts(profile: GraphProfile, node_id: str) -> list[tuple[str, str, int]]:
    """What `node_floor_bytes` adds up, as (role, tensor, bytes): each input, the output, the smallest workspace."""
    node = profile.node_by_id[node_id]
    parts = [("input", source, profile.node_by_id[source].size_bytes) for source in dict.fromkeys(node.inputs)]
    parts.append(("output", node_id, node.size_bytes))
    smallest = node.smallest_workspace
    if smallest.workspace_bytes:
        parts.append((f"workspace of {smallest.name}", node_id, smallest.workspace_bytes))
    return parts


def nodes_over(profile: GraphProfile, budget_bytes: int) -> list[tuple[str, int]]:
    """The nodes that cannot run within `budget_bytes` in any plan, as (node, bytes it needs with fixed memory), worst first."""
    needs = [(node_id, profile.fixed_bytes + node_floor_bytes(profile, node_id)) for node_id in profile.order]
    return sorted([item for item in needs if item[1] > budget_bytes], key=lambda item: (-item[1], profile.position[item[0]]))


def minimum_budget_bytes(profile: GraphProfile) -> int:
    """No plan of any strategy fits below this: fixed memory plus the largest single node, or plus the optimizer
    step's temporaries, which come after the backward, when no activation is held."""
    largest_node = max(node_floor_bytes(profile, node_id) for node_id in profile.order)
    return profile.fixed_bytes + max(largest_node, profile.fixed_memory.optimizer_step_bytes)


def check_budget(profile: GraphProfile, budget_bytes: int) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral):
        raise BudgetError(f"a budget is a whole number of bytes, not {type(budget_bytes).__name__} {budget_bytes!r}")
    if budget_bytes > MAX_SIZE_BYTES:
        raise BudgetError(f"budget {budget_bytes} bytes is larger than any memory ({format_bytes(MAX_SIZE_BYTES)} at most)")
    minimum = minimum_budget_bytes(profile)
    if budget_bytes < minimum:
        raise BudgetError(
            f"budget {budget_bytes} bytes ({format_bytes(budget_bytes)}) is below what any plan needs: "
            f"{describe_minimum(profile)}",
            minimum_budget_bytes=minimum,
        )


def describe_minimum(profile: GraphProfile) -> str:
    """`minimum_budget_bytes` in words: what it is made of."""
    minimum = minimum_budget_bytes(profile)
    worst = max(profile.order, key=lambda node_id: node_floor_bytes(profile, node_id))
    if profile.fixed_bytes + node_floor_bytes(profile, worst) >= minimum:
        binding = f"node {worst!r} with its inputs and smallest workspace"
    else:
        binding = f"the {profile.fixed_memory.optimizer_step_bytes} bytes of temporaries of the optimizer's step"
    return f"{minimum} bytes ({format_bytes(minimum)}), that is fixed memory {profile.fixed_bytes} bytes plus {binding}"


def check_memory_ratio(memory_ratio: float) -> None:
    if isinstance(memory_ratio, bool) or not isinstance(memory_ratio, numbers.Real):
        raise BudgetError(f"memory ratio is a number in (0, 1], not {type(memory_ratio).__name__} {memory_ratio!r}")
    if not 0 < memory_ratio <= 1.0 or memory_ratio != memory_ratio:
        raise BudgetError(f"memory ratio must be a number in (0, 1], not {memory_ratio!r}")


def budget_from_ratio(profile: GraphProfile, memory_ratio: float) -> int:
    """A fraction of the keep-all peak with the fastest implementations, as the MO-SOS paper measures."""
    check_memory_ratio(memory_ratio)
    from planner.strategies.keep_all import keep_all_peak_bytes

    return int(keep_all_peak_bytes(profile) * memory_ratio)

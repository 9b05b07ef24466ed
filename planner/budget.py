"""Budgets: what one must at least be, one given in bytes or as a fraction of the keep-all peak resolved to bytes
(`resolve_budget`, the one place that does it), and the one search for the smallest budget at which something fits
(`smallest_budget`)."""

from __future__ import annotations

import numbers
from typing import Callable

from planner.errors import BudgetError
from planner.profile import GraphProfile
from planner.strategies.keep_all import keep_all_peak_bytes
from planner.units import MAX_SIZE_BYTES, format_bytes, parse_bytes


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
    return int(keep_all_peak_bytes(profile) * memory_ratio)


def requested_budget(budget: str | int | None, memory_ratio: float | None) -> tuple[int | None, float | None]:
    """(bytes, ratio) as a caller asked, at most one of them: a size in bytes or a string like '10GiB', or a ratio
    in (0, 1] of the keep-all peak. Both is an error: the ratio would decide alone."""
    _one_of(budget, memory_ratio)
    if memory_ratio is not None:
        check_memory_ratio(memory_ratio)
        return None, memory_ratio
    return (None if budget is None else parse_bytes(budget)), None


def _one_of(budget, memory_ratio) -> None:
    if budget is not None and memory_ratio is not None:
        raise BudgetError(f"give either a budget (budget={budget!r}) or a memory ratio (memory_ratio={memory_ratio!r}),"
                          " not both: the ratio would decide alone")


def resolve_budget(profile: GraphProfile, budget_bytes: int | None, memory_ratio: float | None) -> int | None:
    """The budget in bytes, checked against what any plan needs; None where neither is given (a strategy without a
    budget). Bytes or a ratio, never both: a ratio is of this profile's keep-all peak. Bytes are checked, not
    parsed: a size given as text is `requested_budget`'s."""
    _one_of(budget_bytes, memory_ratio)
    if memory_ratio is not None:
        budget_bytes = budget_from_ratio(profile, memory_ratio)
    if budget_bytes is not None:
        check_budget(profile, budget_bytes)
    return budget_bytes


def smallest_budget(
    fits: Callable[[int], int | None], infeasible_bytes: int, feasible_bytes: int,
    out_of_time: Callable[[], bool] = lambda: False, doublings: int = 8, resolution_bytes: int = 1,
) -> int | None:
    """The smallest budget at which `fits` was seen to succeed, by bisection between `infeasible_bytes` (nothing
    fits) and `feasible_bytes` (doubled up to `doublings` times until something does; with none, known to fit and
    not tried).

    `fits(budget)`: the bytes of a plan found within `budget` (its own peak, or the budget itself), None where none
    is found. What fits need not be monotone in the budget (a heuristic's plan, the greedy pass): the answer is
    always a budget where `fits` succeeded, with one byte less seen to fail, or, once `out_of_time()`, the smallest
    success so far. None where even the last doubling fails, or time ran out before any success.
    `resolution_bytes`: the bisection stops once the two are that close (a `fits` that takes a tenth of a second
    need not find the byte).
    """
    high = feasible_bytes
    for attempt in range(doublings):
        needed = fits(high)
        if needed is not None:
            high = min(high, needed)
            break
        if out_of_time() or attempt == doublings - 1:
            return None
        high *= 2
    low = infeasible_bytes
    while high - low > max(resolution_bytes, 1) and not out_of_time():
        middle = (low + high) // 2
        needed = fits(middle)
        if needed is None:
            low = middle
        else:
            high = min(middle, needed)
    return high

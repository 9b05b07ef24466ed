"""(1) the objective: compute time, recomputations and charged prefetch waits included.

Or the peak memory, for the minimum-budget search.
"""

from __future__ import annotations

from ortools.sat.python import cp_model

from planner.cpsat.data import ModelData
from planner.cpsat.variables import Variables


def compute_time_expression(data: ModelData, v: Variables) -> cp_model.LinearExpr:
    """Over the free tensors only (a fixed one's cost is a constant of the window)."""
    terms = []
    for k, tensor_copies in enumerate(v.copies):
        if v.is_fixed(k):
            continue
        for copy in tensor_copies:
            if copy.computes:
                terms += [impl.time_units * literal for impl, literal in zip(data.impls[k], copy.implementations)]
            elif copy.early is not None:
                terms.append(data.prefetch_units[k] * copy.early)  # wait for a prefetch read before it lands
    return sum(terms)


def set_objective(model: cp_model.CpModel, data: ModelData, v: Variables) -> cp_model.LinearExpr:
    if data.features.minimize_memory:
        model.minimize(v.capacity)
        return v.capacity
    expression = compute_time_expression(data, v)
    # Every node runs at least once with at least its fastest time: a bound the search should never report below.
    model.add(expression >= sum(
        min(impl.time_units for impl in impls) for k, impls in enumerate(data.impls) if not v.is_fixed(k)
    ))
    model.minimize(expression)
    return expression

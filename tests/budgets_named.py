"""Asking as a user who wants the least memory would: from 1 byte, each budget a BudgetError names, until one
plans."""

from __future__ import annotations

from typing import Callable, TypeVar

import pytest

from planner.errors import BudgetError

T = TypeVar("T")


def plan_at_the_budgets_named(attempt: Callable[[int], T], tries: int = 5) -> tuple[T, int, list[int]]:
    """(what `attempt` returned at the first budget that planned, that budget, the budgets asked after 1 byte).
    Each budget named must be above the one asked; a test fails where no budget plans within `tries`."""
    budget, asked = 1, []
    for _ in range(tries):
        try:
            return attempt(budget), budget, asked
        except BudgetError as error:
            assert error.minimum_budget_bytes > budget, (asked, str(error))
            budget = error.minimum_budget_bytes
            asked.append(budget)
    pytest.fail(f"no plan at the budgets named: {asked}")

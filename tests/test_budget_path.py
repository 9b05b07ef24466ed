"""One budget path: a budget in bytes or as a ratio is resolved in one function, and one bisection finds the
smallest budget at which something fits (planner/budget.py); the old names are gone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import planner.budget
import planner.budget_search
import planner.planning
from planner.budget import requested_budget, resolve_budget, smallest_budget
from planner.errors import BudgetError
from planner.profile import load_profile
from planner.strategies.keep_all import keep_all_peak_bytes

PROFILE = "models/profiles/vgg19-b144-227-p40.json"


def test_each_exists_once_and_the_old_names_are_gone():
    planner_folder = Path(planner.budget.__file__).parent
    defined = {}
    for path in planner_folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("smallest_budget", "resolve_budget"):
                defined.setdefault(node.name, []).append(path.relative_to(planner_folder.parent).as_posix())
    assert defined == {"smallest_budget": ["planner/budget.py"], "resolve_budget": ["planner/budget.py"]}
    assert planner.planning.resolve_budget is resolve_budget  # plan() uses the one the CLI and the service use
    assert planner.budget_search.smallest_budget is smallest_budget  # the heuristics' bisection is the one


def test_a_budget_is_bytes_or_a_ratio_never_both():
    assert requested_budget("1GiB", None) == (1 << 30, None)
    assert requested_budget(1000, None) == (1000, None)
    assert requested_budget(None, 0.5) == (None, 0.5)
    assert requested_budget(None, None) == (None, None)
    with pytest.raises(BudgetError, match=r"give either a budget \(budget='1GiB'\) or a memory ratio "
                                          r"\(memory_ratio=0.5\), not both"):
        requested_budget("1GiB", 0.5)
    with pytest.raises(BudgetError, match=r"memory ratio must be a number in \(0, 1\]"):
        requested_budget(None, 1.5)
    with pytest.raises(BudgetError, match="a size"):
        requested_budget(True, None)


def test_a_ratio_resolves_against_the_keep_all_peak_and_is_checked():
    profile = load_profile(PROFILE)
    assert resolve_budget(profile, None, 0.6) == int(keep_all_peak_bytes(profile) * 0.6)
    assert resolve_budget(profile, None, None) is None
    with pytest.raises(BudgetError) as below:
        resolve_budget(profile, 1000, None)
    assert below.value.minimum_budget_bytes is not None and "below what any plan needs" in str(below.value)


def test_the_search_bisects_to_a_budget_seen_to_fit_with_one_byte_less_seen_to_fail():
    tried = []

    def fits(budget):
        tried.append(budget)
        return budget if budget >= 1234 else None

    assert smallest_budget(fits, 0, 5000) == 1234
    assert 1233 in tried and 1234 in tried


def test_the_search_doubles_a_feasible_guess_that_fails_and_gives_up_after_the_doublings():
    assert smallest_budget(lambda b: b if b >= 10_000 else None, 0, 3000) == 10_000
    assert smallest_budget(lambda b: None, 0, 3000) is None
    assert smallest_budget(lambda b: b if b >= 10_000 else None, 0, 3000, doublings=1) is None


def test_the_search_stops_at_its_resolution_and_a_known_fit_needs_no_doubling():
    tried = []

    def fits(budget):
        tried.append(budget)
        return budget if budget >= 1234 else None

    found = smallest_budget(fits, 0, 5000, doublings=0, resolution_bytes=100)
    assert 1234 <= found <= 1234 + 100 and 5000 not in tried and len(tried) <= 6


def test_the_measuring_pass_search_bisects_with_the_one_search(monkeypatch):
    """executor.measure.measuring finds the smallest budget a measuring pass fits with planner.budget's bisection
    (its own scan upwards aside), not a loop of its own."""
    from executor.measure import measuring

    calls = []
    real = measuring.smallest_budget
    monkeypatch.setattr(measuring, "smallest_budget", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(measuring, "_greedy", lambda provisional, budget, deadline: object() if budget >= 3 << 20
                        else None)
    found = measuring._smallest_greedy_budget(None, 1 << 20, 8 << 20, [], 5.0)
    assert calls and 3 << 20 <= found <= (3 << 20) + max((8 << 20) // 200, 1 << 10)


def test_a_plan_that_needs_less_than_its_budget_lowers_the_answer():
    # the greedy plan's peak: a plan found within 1000 bytes that needs 777 fits in 777
    assert smallest_budget(lambda b: 777 if b >= 1000 else None, 0, 5000) == 777


def test_a_non_monotone_fit_still_answers_a_budget_seen_to_fit():
    seen = set()

    def fits(budget):
        ok = budget >= 2000 or 500 <= budget < 600  # a heuristic that fits at 550 but not at 1000
        if ok:
            seen.add(budget)
        return budget if ok else None

    answer = smallest_budget(fits, 0, 4000)
    assert answer in seen


def test_the_search_stops_when_time_runs_out_with_the_smallest_success_so_far():
    calls = []

    def fits(budget):
        calls.append(budget)
        return budget if budget >= 100 else None

    answer = smallest_budget(fits, 0, 1 << 20, out_of_time=lambda: len(calls) >= 3)
    assert len(calls) == 3 and answer == min(b for b in calls if b >= 100)


def test_a_known_feasible_budget_is_not_tried():
    calls = []
    assert smallest_budget(lambda b: calls.append(b) or (b if b >= 10 else None), 0, 1000, doublings=0) == 10
    assert 1000 not in calls

"""Run several strategies at one budget and compare them through the simulator."""

from __future__ import annotations

import time
from dataclasses import dataclass

from planner.errors import BudgetError, MososError
from planner.planning import plan
from planner.profile import GraphProfile
from planner.schedule import Schedule


@dataclass
class ComparisonRow:
    strategy: str
    schedule: Schedule | None
    error: str | None = None
    minimum_budget_bytes: int | None = None
    # a solver strategy with no plan: whether it proved that none fits (False: its time ran out first)
    proven: bool | None = None
    not_run: bool = False  # its turn came after the shared time limit

    @classmethod
    def failed(cls, strategy: str, error: BudgetError) -> "ComparisonRow":
        return cls(strategy, None, str(error), error.minimum_budget_bytes, getattr(error, "proven", None))

    @property
    def out_of_time(self) -> bool:
        """No plan, and no proof that none fits: the search ran out of time (a plan at this budget may exist)."""
        return self.schedule is None and self.proven is False

    def as_dict(self, lower_bound_ms: float | None) -> dict:
        row: dict = {"strategy": self.strategy, "feasible": self.schedule is not None}
        if self.schedule is not None and self.schedule.summary is not None:
            summary = self.schedule.summary
            row.update(summary.model_dump(exclude={"strategy", "solver"}))
            if lower_bound_ms:
                row["overhead_percent"] = 100.0 * (summary.predicted_step_time_ms / lower_bound_ms - 1.0)
            if summary.solver is not None:
                row["solver"] = summary.solver.model_dump()
        else:
            row["error"] = self.error
            row["minimum_budget_bytes"] = self.minimum_budget_bytes
            row["out_of_time"] = self.out_of_time
            row["not_run"] = self.not_run
        return row


# How a shared time limit is split between strategies run one after another: solver-based ones need it,
# heuristics finish in a fraction of a second on most graphs (and stop at their share on the rest).
SOLVER_WEIGHTS = {"mosos": 4.0, "recompute-only": 1.0, "checkmate-auto": 1.0, "str-auto": 1.0}
HEURISTIC_WEIGHT = 0.25


def time_share_s(strategies: list[str], index: int, remaining_s: float) -> float:
    """The seconds strategy `index` may take of `remaining_s`, shared by it and the ones after it by weight."""
    weights = [SOLVER_WEIGHTS.get(name, HEURISTIC_WEIGHT) for name in strategies[index:]]
    return max(0.0, remaining_s) * weights[0] / sum(weights)


HEURISTIC_S_PER_NODE = 0.0002  # the least a heuristic takes on a loaded 2-core machine: 0.3 ms a node seen
HEURISTIC_SLACK = 1.5  # how much slower than the slowest so far the next heuristic may be


def compare(
    profile: GraphProfile, budget_bytes: int | None, strategies: list[str], *, time_limit_s: float = 60.0,
    started_at: float | None = None, shared: bool = False, **options,
) -> list[ComparisonRow]:
    """Plan with each strategy; the rows come in the order given. `shared`: `time_limit_s` bounds all of them
    together, from `started_at` (default now), split by `time_share_s`; otherwise each gets `time_limit_s`.

    Shared, the heuristics run first: each needs a few whole simulations whatever its share (0.1-0.4 s on 2,000
    nodes, where a share was 0.05-0.1 s), and run last they took the command past its limit; the solvers after them
    keep to a deadline and share what is left."""
    run_order = sorted(range(len(strategies)), key=lambda index: strategies[index] in SOLVER_WEIGHTS) if shared \
        else list(range(len(strategies)))
    names_in_run_order = [strategies[index] for index in run_order]
    rows: dict[int, ComparisonRow] = {}
    clock = time.monotonic() if started_at is None else started_at
    # what one heuristic took on this graph: the least the next one will need; before the first, a few whole
    # simulations' worth (the first ran with 0.02 s left and took 0.6-0.8 s on 2,000 nodes, past the limit)
    slowest_heuristic_s = HEURISTIC_S_PER_NODE * len(profile.nodes)
    for position, index in enumerate(run_order):
        name = strategies[index]
        limit = time_limit_s
        if shared:
            remaining_s = time_limit_s - (time.monotonic() - clock)
            if remaining_s <= 0:  # the limit bounds the whole comparison: what is left is not started
                rows[index] = ComparisonRow(name, None, "not run: the time limit was spent before its turn",
                                            not_run=True)
                continue
            # a heuristic is started where one half again as slow as the slowest so far still ends in time (on
            # VGG-416 under load one took 0.39 s, the next 0.58 s); a solver, whose greedy passes and checks before
            # CP-SAT cost about one heuristic, where the slowest still would
            least_s = slowest_heuristic_s * (1.0 if name in SOLVER_WEIGHTS else HEURISTIC_SLACK)
            if remaining_s < least_s:
                rows[index] = ComparisonRow(
                    name, None, f"not run: {remaining_s:.2f} s of the time limit was left, and a heuristic took up to "
                    f"{slowest_heuristic_s:.2f} s on this graph", not_run=True)
                continue
            limit = max(1e-3, time_share_s(names_in_run_order, position, remaining_s))
        began = time.monotonic()
        try:
            # one time limit shared by a dozen strategies: no time to place each plan's buffers (0.3-0.5 s each on
            # 2,000 nodes, more than a heuristic's share); each plan of its own gets its addresses
            rows[index] = ComparisonRow(name, plan(profile, budget_bytes, strategy=name, time_limit_s=limit,
                                                   addresses=not shared, **options))
        except BudgetError as error:
            rows[index] = ComparisonRow.failed(name, error)
        except MososError as error:  # a strategy that cannot run on this profile (no bandwidth, ...): its row says why
            rows[index] = ComparisonRow(name, None, str(error))
        if name not in SOLVER_WEIGHTS:
            slowest_heuristic_s = max(slowest_heuristic_s, time.monotonic() - began)
    return [rows[index] for index in range(len(strategies))]

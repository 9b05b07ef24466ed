"""Run several strategies at one budget and compare them through the simulator."""

from __future__ import annotations

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
        return row


def compare(profile: GraphProfile, budget_bytes: int | None, strategies: list[str], **options) -> list[ComparisonRow]:
    rows = []
    for name in strategies:
        try:
            rows.append(ComparisonRow(name, plan(profile, budget_bytes, strategy=name, **options)))
        except BudgetError as error:
            rows.append(ComparisonRow(name, None, str(error), error.minimum_budget_bytes))
        except MososError as error:  # a strategy that cannot run on this profile (no bandwidth, ...): its row says why
            rows.append(ComparisonRow(name, None, str(error)))
    return rows

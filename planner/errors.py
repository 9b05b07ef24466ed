"""Errors that carry what went wrong and where, so no caller needs a traceback."""

from __future__ import annotations

from dataclasses import dataclass


class MososError(Exception):
    """Base of every error mosos raises on bad input; its message is for people."""


@dataclass(frozen=True)
class Issue:
    """One problem in an input document: a JSON path and a sentence."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.message}"


class DocumentError(MososError):
    """A profile or schedule document that does not validate."""

    document = "document"

    def __init__(self, issues: list[Issue], source: str | None = None):
        self.issues = list(issues)
        self.source = source
        where = f" ({source})" if source else ""
        lines = [f"invalid {self.document}{where}: {len(self.issues)} problem(s)"]
        lines += [f"  - {issue}" for issue in self.issues]
        super().__init__("\n".join(lines))


class ProfileError(DocumentError):
    document = "profile"


class ScheduleError(DocumentError):
    document = "schedule"


class BudgetError(MososError):
    """A memory budget that no plan can meet, or that cannot be parsed."""

    def __init__(self, message: str, minimum_budget_bytes: int | None = None):
        self.minimum_budget_bytes = minimum_budget_bytes
        super().__init__(message)


class InfeasibleBudget(BudgetError):
    """The strategy found no plan within the budget; says the smallest budget it can meet.

    `proven`: for a solver strategy, whether the solver proved that no plan of its model fits (False: it found
    none within its time limit); None for a heuristic, whose one plan simply does not fit.
    """

    def __init__(self, message: str, minimum_budget_bytes: int | None = None, proven: bool | None = None):
        self.proven = proven
        super().__init__(message, minimum_budget_bytes)


class TimeLimitReached(MososError):
    """A command's time limit ran out before it finished: the message says what it was doing; nothing was
    written."""

    exit_code = 4


class ScheduleRejected(MososError):
    """The simulator found a schedule that cannot run as written.

    It names the first violation: the stage, the operation, the tensor and,
    for memory, how many bytes over the budget.
    """

    def __init__(
        self,
        reason: str,
        *,
        stage: int | None = None,
        operation_index: int | None = None,
        operation: str | None = None,
        tensor: str | None = None,
        over_budget_bytes: int | None = None,
        time_ms: float | None = None,
        path: str | None = None,
    ):
        self.reason = reason
        self.path = path
        self.stage = stage
        self.operation_index = operation_index
        self.operation = operation
        self.tensor = tensor
        self.over_budget_bytes = over_budget_bytes
        self.time_ms = time_ms
        where = [path] if path else []
        if stage is not None and not path:  # the path says where already, in the document's own numbering
            where.append(f"stage {stage}")
        if operation_index is not None and not path:
            where.append(f"operation {operation_index}")
        if operation:
            where.append(f"({operation})")
        prefix = "schedule rejected"
        if where:
            prefix += " at " + " ".join(where)
        super().__init__(f"{prefix}: {reason}")

    def located(self, path: str) -> "ScheduleRejected":
        """The same rejection with the operation's JSON path in the schedule document."""
        return ScheduleRejected(
            self.reason, stage=self.stage, operation_index=self.operation_index, operation=self.operation,
            tensor=self.tensor, over_budget_bytes=self.over_budget_bytes, time_ms=self.time_ms, path=path,
        )

    def as_dict(self) -> dict:
        return {
            "reason": self.reason,
            "path": self.path,
            "stage": self.stage,
            "operation_index": self.operation_index,
            "operation": self.operation,
            "tensor": self.tensor,
            "over_budget_bytes": self.over_budget_bytes,
            "time_ms": self.time_ms,
            "message": str(self),
        }

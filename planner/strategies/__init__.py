"""Strategies: each turns (profile, budget, options) into a certified Schedule.

A strategy registers itself with `@strategy("name")`. Every schedule it
returns has been through the simulator (`planner.builder.certify`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule

__all__ = ["SolveOptions", "StrategyFunction", "StrategyInfo", "STRATEGIES", "strategy", "load_all"]


class StrategyFunction(Protocol):
    def __call__(self, profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule: ...


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    function: StrategyFunction
    description: str
    uses_budget: bool = True
    # Moves tensors to host memory: useless on a profile without transfer bandwidth, refused before any work.
    needs_transfers: bool = False
    # Hands the other plans it made on its way to SolveOptions.candidates: plan() keeps time to place them where its
    # own plan's buffers do not place within the budget.
    offers_candidates: bool = False


STRATEGIES: dict[str, StrategyInfo] = {}


def strategy(name: str, description: str, uses_budget: bool = True, needs_transfers: bool = False,
             offers_candidates: bool = False):
    def register(function: StrategyFunction) -> StrategyFunction:
        STRATEGIES[name] = StrategyInfo(name, function, description, uses_budget, needs_transfers, offers_candidates)
        return function

    return register


def load_all() -> dict[str, StrategyInfo]:
    """Import the strategy modules so that they register themselves."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return STRATEGIES

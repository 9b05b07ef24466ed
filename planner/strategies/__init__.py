"""Strategies: each turns (profile, budget, options) into a certified Schedule.

A strategy registers itself with `@strategy("name")`. Every schedule it
returns has been through the simulator (`planner.builder.certify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from planner.profile import GraphProfile
from planner.schedule import Schedule


@dataclass
class SolveOptions:
    time_limit_s: float = 60.0
    workers: int | None = None
    seed: int = 0
    progress: Callable[[dict], None] | None = field(default=None, repr=False)
    # Stops a running solve early (the service's cancel); returns True to stop.
    should_stop: Callable[[], bool] | None = field(default=None, repr=False)


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


STRATEGIES: dict[str, StrategyInfo] = {}


def strategy(name: str, description: str, uses_budget: bool = True, needs_transfers: bool = False):
    def register(function: StrategyFunction) -> StrategyFunction:
        STRATEGIES[name] = StrategyInfo(name, function, description, uses_budget, needs_transfers)
        return function

    return register


def load_all() -> dict[str, StrategyInfo]:
    """Import the strategy modules so that they register themselves."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return STRATEGIES

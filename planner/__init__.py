"""mosos planner: profiles, schedules, the simulator and the strategies. Never imports torch."""

from planner.errors import BudgetError, InfeasibleBudget, MososError, ProfileError, ScheduleError, ScheduleRejected
from planner.planning import plan, strategy_names
from planner.profile import GraphProfile, load_profile, parse_profile
from planner.schedule import Schedule, load_schedule, parse_schedule
from planner.simulator import SimulationResult, simulate

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "GraphProfile",
    "InfeasibleBudget",
    "MososError",
    "ProfileError",
    "Schedule",
    "ScheduleError",
    "ScheduleRejected",
    "SimulationResult",
    "load_profile",
    "load_schedule",
    "parse_profile",
    "parse_schedule",
    "plan",
    "simulate",
    "strategy_names",
]

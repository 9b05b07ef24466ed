"""The MO-SOS integer program on OR-Tools CP-SAT.

One module per job: `data` turns a profile and a budget into integers (stage
timing ss/sf included), `variables` creates the decision variables,
`constraints` holds one function per constraint family, `objective`, `hints`
(warm starts from baseline schedules), `callback` (progress), `extract`
(solution -> Schedule), `solve` (the driver), `greedy` (a quick
evict-and-recompute plan: hint and fallback) and `run` (what every CP-SAT
strategy does around the solve: best certified plan, or InfeasibleBudget).
"""

from planner.cpsat.data import Features, ModelData
from planner.cpsat.solve import SolveOutcome, solve_model

__all__ = ["Features", "ModelData", "SolveOutcome", "solve_model"]

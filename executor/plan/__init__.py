"""Plan: optimize() takes a model from capture through measuring to a schedule (solved here or by the planner
service) and a PlannedModule; cache keeps plans between runs; schedules holds the hand-made schedules (keep all,
offload or recompute everything) the tests and baselines use."""

"""Plan: cache keeps plans between runs (keyed by the model, its inputs and the budget); schedules for measuring live
in the step engine (executor.engine.schedules). optimize(), which takes a model from capture through measuring to a
plan and a PlannedModule, sits above both, in executor.replay.optimize."""

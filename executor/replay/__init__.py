"""Replay: a schedule run in training. `optimize()` (optimize.py) captures, measures and plans a model (or takes its
plan from the cache) and wraps it in a PlannedModule (replay.py), which runs the step the step engine generates
(executor.engine), re-plans from measured times, and checks the replay against plain PyTorch (reference.py)."""

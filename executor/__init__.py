"""The PyTorch side of mosos: profile a real model, replay a schedule in training, pick conv algorithms.

Needs torch (the planner never imports this package).
"""

from __future__ import annotations

__all__ = ["profile_model", "estimate_profile", "PlannedModule", "optimize", "CaptureError", "ProfileMismatch", "ReplayError"]


def __getattr__(name: str):
    # lazy, so `import executor.measure.conv_algorithms` does not pull in the whole replay machinery
    if name == "profile_model":
        from executor.measure.profiler import profile_model

        return profile_model
    if name == "estimate_profile":
        from executor.measure.estimate import estimate_profile

        return estimate_profile
    if name == "PlannedModule":
        from executor.replay.replay import PlannedModule

        return PlannedModule
    if name == "optimize":
        from executor.plan.plugin import optimize

        return optimize
    if name in ("CaptureError", "ProfileMismatch", "ReplayError"):
        from executor import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'executor' has no attribute {name!r}")

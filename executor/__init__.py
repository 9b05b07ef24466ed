"""The PyTorch side of mosos: profile a real model, replay a schedule in training, pick conv algorithms.

Needs torch (the planner never imports this package).
"""

from __future__ import annotations

import importlib.util as _importlib_util
from pathlib import Path as _Path


def _check_models_package() -> None:
    """mosos's own `models` package must be the one `import models` finds: a user's models.py (or models/ folder)
    beside their script comes first on sys.path and made optimize() fail with "'models' is not a package"."""
    ours = _Path(__file__).resolve().parent.parent / "models"
    try:
        spec = _importlib_util.find_spec("models")
    except (ImportError, ValueError):
        return
    origin = getattr(spec, "origin", None) or next(iter(getattr(spec, "submodule_search_locations", None) or []), None)
    if spec is None or origin is None or _Path(origin).resolve().is_relative_to(ours):
        return
    raise ImportError(
        f"mosos's executor needs its own package 'models' ({ours}), but 'import models' finds {origin} first, a "
        "module of yours of the same name on sys.path (the script's folder or the working directory): rename yours "
        "(e.g. my_models.py), or run from another folder")


_check_models_package()

__all__ = ["profile_model", "estimate_profile", "PlannedModule", "optimize", "CaptureError", "ProfileMismatch", "ReplayError"]


def __getattr__(name: str):
    # lazy, so `import executor.engine.conv_algorithms` does not pull in the whole replay machinery
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
        from executor.replay.optimize import optimize

        return optimize
    if name in ("CaptureError", "ProfileMismatch", "ReplayError"):
        from executor import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'executor' has no attribute {name!r}")

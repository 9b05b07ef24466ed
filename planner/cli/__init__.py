"""The `mosos` command. Each command lives in its own module and registers on `app`."""

from planner.cli.app import app, main
from planner.cli import import_cmd, plan_cmd, schema_cmd, serve_cmd, simulate_cmd  # noqa: F401  (registration)
from planner.cli import estimate_cmd  # noqa: F401  (registration; torch is imported only when it runs)
from planner.cli import profile_cmd  # noqa: F401  (registration; torch is imported only when it runs)

__all__ = ["app", "main"]

"""The `mosos` command. Each command lives in its own module and registers on `app`."""

from planner.cli.app import app, main
from planner.cli import import_cmd, plan_cmd, schema_cmd, serve_cmd, simulate_cmd  # noqa: F401  (registration)

__all__ = ["app", "main"]

"""The `mosos` command. Each command lives in its own module and registers on `app`."""

from cli.app import app, main
from cli import import_cmd, plan_cmd, schema_cmd, serve_cmd, simulate_cmd  # noqa: F401  (registration)
from cli import sweep_cmd  # noqa: F401  (registration; Ray is imported only when it runs)
from cli import estimate_cmd  # noqa: F401  (registration; torch is imported only when it runs)
from cli import profile_cmd  # noqa: F401  (registration; torch is imported only when it runs)
from cli import max_batch_cmd  # noqa: F401  (registration; torch is imported only when it runs)
from cli import cache_cmd  # noqa: F401  (registration; torch is imported only when it runs)

__all__ = ["app", "main"]

"""Extra strategies from the user's own code: modules or .py files that register them when imported."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def load_plugins(plugins: list[str]) -> None:
    """Import modules (or .py files) that register extra strategies."""
    for plugin in plugins:
        if plugin.endswith(".py"):
            path = Path(plugin).resolve()
            name = f"mosos_plugin_{path.stem}"  # executed every time, so that its strategies register again
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot import plugin file {plugin}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(plugin)

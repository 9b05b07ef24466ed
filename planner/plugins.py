"""Extra strategies from the user's own code: modules or .py files that register them when imported.

Shared by the service, its solve processes and sweeps on Ray workers; a failure is a PluginError that names the
plugin and says what went wrong where, never a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from planner.errors import MososError


class PluginError(MososError):
    """A --plugin that cannot be imported: what was given and why, without a traceback."""


def _where(error: BaseException) -> str:
    """' (file, line N)' of the innermost frame outside the import machinery, where a plugin failed."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith("<frozen")]
    return f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def _import_plugin(plugin: str) -> None:
    path = Path(plugin).expanduser()
    if plugin.endswith(".py") or os.sep in plugin or (os.altsep and os.altsep in plugin) or path.exists():
        if path.is_dir():
            raise PluginError(f"plugin {plugin} is a directory; give a .py file or the name of an importable module")
        if not path.exists():
            raise PluginError(f"plugin {plugin}: no such file")
        if path.suffix != ".py":
            raise PluginError(f"plugin {plugin} is not a Python file (.py) nor the name of an importable module")
        path = path.resolve()
        name = f"mosos_plugin_{path.stem}"  # executed every time, so that its strategies register again
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise PluginError(f"plugin {plugin} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return
    try:
        importlib.import_module(plugin)
    except ModuleNotFoundError as error:
        if error.name is not None and (plugin == error.name or plugin.startswith(error.name + ".")):
            raise PluginError(
                f"plugin {plugin}: no module named {error.name!r} (give a module importable from PYTHONPATH, or a .py file)"
            ) from None
        raise


def load_plugins(plugins: list[str]) -> None:
    """Import modules (or .py files) that register extra strategies; any failure is a PluginError that names the
    plugin and says what went wrong where."""
    for plugin in plugins:
        try:
            _import_plugin(plugin)
        except PluginError:
            raise
        except SyntaxError as error:
            raise PluginError(f"plugin {plugin} is not valid Python: {error.msg} ({error.filename}, line {error.lineno})") from None
        except SystemExit as error:
            raise PluginError(f"plugin {plugin} exited (SystemExit: {error.code}) while it was imported") from None
        except Exception as error:
            raise PluginError(
                f"plugin {plugin} failed while it was imported: {type(error).__name__}: {error}{_where(error)}"
            ) from None

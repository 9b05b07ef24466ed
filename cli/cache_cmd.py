"""`mosos cache list` / `mosos cache clear`: the plans `optimize()` keeps across runs (executor.plan.cache)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import typer
from rich.table import Table
from rich.markup import escape

from cli.app import app, console, friendly
from planner.errors import MososError
from planner.units import format_bytes
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.

cache_app = typer.Typer(help="The plans optimize() keeps across runs ($MOSOS_CACHE_DIR or the user's cache directory).",
                        no_args_is_help=True)
app.add_typer(cache_app, name="cache")

DIRECTORY = typer.Option(None, "--dir", help="The cache directory (default: $MOSOS_CACHE_DIR, else the user's cache "
                                            "directory)", file_okay=False)


def _cache(directory: Path | None):
    if importlib.util.find_spec("torch") is None:
        raise MososError("the plan cache is written by the executor, which needs torch: pip install torch")
    from executor.plan.cache import PlanCache

    return PlanCache(directory)


def _budget(budget: dict) -> str:
    if budget.get("memory_ratio") is not None:
        return f"{budget['memory_ratio']:g} of keep-all"
    return format_bytes(budget["bytes"]) if budget.get("bytes") is not None else "none"


@cache_app.command("list")
@friendly
def list_plans(directory: Path | None = DIRECTORY) -> None:
    """The kept plans: model, input signature, device, budget, strategy, predicted step, size, last use."""
    cache = _cache(directory)
    entries = cache.entries()
    if not entries:
        console.print(f"no plans kept in {cache.plans}")
        return
    table = Table(title=escape(f"plans kept in {cache.plans}"))
    for header in ("entry", "model", "inputs", "device", "budget", "strategy", "step ms", "peak", "size", "last used"):
        table.add_column(header, overflow="fold")
    for entry in entries:
        summary = entry.summary
        table.add_row(
            entry.digest[:12], summary.get("model", "?"), summary.get("inputs", ""), summary.get("device", ""),
            _budget(summary["budget"]) if "budget" in summary else "", summary.get("strategy", ""),
            f"{entry.predicted_step_time_ms:.2f}" if entry.predicted_step_time_ms is not None else "",
            format_bytes(entry.peak_memory_bytes) if entry.peak_memory_bytes is not None else "",
            format_bytes(entry.size_bytes),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used)) if entry.last_used else "",
        )
    console.print(table)


@cache_app.command("clear")
@friendly
def clear_plans(directory: Path | None = DIRECTORY) -> None:
    """Remove every kept plan, damaged ones too (the next optimize() captures, profiles and solves again)."""
    cache = _cache(directory)
    removed = cache.clear()
    console.print(f"removed {removed} kept plan{'s' if removed != 1 else ''} from {cache.plans}")

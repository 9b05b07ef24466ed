"""`mosos simulate`: replay a schedule, report figures or the first violation."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import typer
from rich.table import Table
from rich.markup import escape

from cli.app import app, console, error_console, friendly
from cli.checks import distinct_files, replacing, writable_output
from planner.errors import ScheduleRejected
from planner.profile import load_profile
from planner.schedule import load_schedule
from planner.simulator import peak_at_optimizer_step, simulate
from planner.units import format_bytes, parse_bytes
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.

EXIT_REJECTED = 4


@app.command("simulate")
@friendly
def simulate_command(
    profile_path: Path = typer.Argument(..., metavar="PROFILE"),
    schedule_path: Path = typer.Argument(..., metavar="SCHEDULE"),
    budget: str = typer.Option(None, help="check against this budget instead of the schedule's own"),
    as_json: bool = typer.Option(False, "--json", help="print the figures as JSON"),
    trace: Path = typer.Option(None, help="write a Chrome trace (Perfetto, chrome://tracing)"),
    plot: Path = typer.Option(None, help="draw memory over time with the budget line (PNG)"),
    html: Path = typer.Option(None, "--html", help="write the plan viewer: one self-contained HTML page"),
) -> None:
    """Replay SCHEDULE on PROFILE: step time, stalls, per-stream busy time and peak memory."""
    writable_output(trace, "--trace")
    writable_output(plot, "--plot", (".png", ".svg", ".pdf"))
    writable_output(html, "--html", (".html", ".htm"))
    distinct_files({"PROFILE": profile_path, "SCHEDULE": schedule_path},
                   {"--trace": trace, "--plot": plot, "--html": html})
    profile = load_profile(profile_path)
    schedule = load_schedule(schedule_path)
    try:
        result = simulate(profile, schedule, parse_bytes(budget) if budget is not None else None)
    except ScheduleRejected as rejection:
        if as_json:
            typer.echo(json.dumps({"valid": False, "violation": rejection.as_dict()}, indent=2))
        else:
            error_console.print(f"[bold red]error:[/] {rejection}", highlight=False)
        raise typer.Exit(EXIT_REJECTED) from None
    with contextlib.ExitStack() as outputs:  # every file or none: each replaces its target once all are written
        if trace:
            from planner.trace import write_chrome_trace

            write_chrome_trace(result, outputs.enter_context(replacing(trace, "--trace")), title=f"{profile.name}")
        if plot:
            from planner.plot import plot_memory

            plot_memory(result, outputs.enter_context(replacing(plot, "--plot")),
                        title=f"{profile.name}: device memory")
        if html:
            from planner.viewer import plan_view_html

            outputs.enter_context(replacing(html, "--html")).write_bytes(
                plan_view_html(profile, schedule, result).encode("utf-8"))
    if as_json:
        typer.echo(json.dumps({"valid": True, **result.figures()}, indent=2))
        return
    table = Table(title=escape(f"{profile.name}: simulated step"), show_header=False)
    table.add_row("step time", f"{result.step_time_ms:.3f} ms")
    table.add_row("stall time", f"{result.stall_time_ms:.3f} ms")
    table.add_row("busy: compute / d2h / h2d", f"{result.compute_busy_ms:.3f} / {result.d2h_busy_ms:.3f} / {result.h2d_busy_ms:.3f} ms")
    table.add_row("recompute time", f"{result.recompute_time_ms:.3f} ms")
    at_step = " (the optimizer's step)" if peak_at_optimizer_step(profile, result) else ""
    table.add_row("peak memory", f"{format_bytes(result.peak_memory_bytes)} ({result.peak_memory_bytes} bytes) at "
                  f"{result.peak_time_ms:.3f} ms{at_step}")
    table.add_row("budget", format_bytes(result.budget_bytes) if result.budget_bytes is not None else "none")
    table.add_row("offloaded / prefetched", f"{format_bytes(result.offloaded_bytes)} / {format_bytes(result.prefetched_bytes)}")
    console.print(table)
    for path in (trace, plot, html):
        if path:
            console.print(f"wrote {path}")

"""`mosos sweep SPEC.yaml`: many solves as Ray tasks, locally or on a cluster (needs the `ray` extra)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.markup import escape
from rich.table import Table

from cli.app import app, console, error_console, friendly
from planner.errors import MososError
from planner.units import format_bytes
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.

EXIT_SOME_FAILED = 1
EXIT_INTERRUPTED = 130


def _results_table(title: str, rows: list[dict]) -> Table:
    table = Table(title=escape(title))
    for header in ("#", "profile", "strategy", "budget", "status", "step time", "overhead", "peak memory", "wall", "note"):
        table.add_column(header, justify="right" if header in ("#", "step time", "overhead", "peak memory", "wall") else "left")
    for row in rows:
        step = f"{row['predicted_step_time_ms']:.2f} ms" if row.get("predicted_step_time_ms") is not None else ""
        overhead = f"{row['overhead_percent']:+.2f}%" if row.get("overhead_percent") is not None else ""
        wall = f"{row['wall_time_s']:.1f} s" if row.get("wall_time_s") is not None else ""
        note = row.get("reason") or ""
        if row["status"] == "infeasible" and row.get("minimum_budget_bytes"):
            note = f"needs at least {format_bytes(row['minimum_budget_bytes'])}"
        if (row.get("attempts") or 0) > 1:
            note = f"ran {row['attempts']} times (pids {row['pids']}); " + note
        table.add_row(str(row["index"]), row.get("profile") or row["source"], row["strategy"], row["budget"],
                      row["status"], step, overhead, format_bytes(row.get("peak_memory_bytes")) if step else "",
                      wall, note.split("\n")[0][:120])
    return table


def _dry_run(loaded) -> None:
    table = Table(title=escape(f"{loaded.path}: the solves"))
    for header in ("#", "source", "strategy", "budget"):
        table.add_column(header)
    for solve in loaded.solves:
        table.add_row(str(solve.index), solve.source, solve.strategy, solve.budget_text)
    console.print(table)
    count = len(loaded.solves)
    console.print(f"{count} solve{'' if count == 1 else 's'}; dry run: nothing sent to Ray", highlight=False)


@app.command("sweep")
@friendly
def sweep_command(
    spec_path: Path = typer.Argument(..., metavar="SPEC.yaml", help="profiles or models x budgets x strategies"),
    address: str = typer.Option(None, help="Ray cluster to join (host:port, auto, ray://...); default: a local Ray "
                                "on this machine ($RAY_ADDRESS if set)"),
    out: Path = typer.Option(None, "--out", help="folder for results.csv, results.json and schedules/ "
                             "(default: SPEC-results beside the current folder)"),
    force: bool = typer.Option(False, help="replace an earlier sweep's results in --out"),
    as_json: bool = typer.Option(False, "--json", help="print the results as JSON instead of a table"),
    as_csv: bool = typer.Option(False, "--csv", help="print the results as CSV instead of a table"),
    dry_run: bool = typer.Option(False, help="check the spec and list the solves; run nothing"),
) -> None:
    """Run every solve of SPEC.yaml as a Ray task; one row per solve (plan, infeasible, failed or timed out).

    Exit code 0 when every solve has an answer, 1 when some failed or timed out, 130 when interrupted.
    """
    if as_json and as_csv:
        raise MososError("give --json or --csv, not both")
    from cluster.sweep_results import check_out_dir, prepare_out_dir, write_results
    from cluster.sweep_spec import load_spec

    if not dry_run:
        from cluster.runtime import import_ray

        import_ray("mosos sweep")  # before any work: without Ray, say what to install
    out_dir = out if out is not None else Path(f"{spec_path.stem}-results")
    if not dry_run:
        check_out_dir(out_dir, force)
    loaded = load_spec(spec_path)
    if dry_run:
        _dry_run(loaded)
        return
    from cluster.runtime import connect
    from cluster.sweep import SweepRunner

    show = error_console.is_terminal
    joining = f"joining the Ray cluster at {address}" if address else "starting Ray"
    error_console.print(f"mosos sweep: {len(loaded.solves)} solves from {spec_path}; {joining}...", highlight=False)
    session = connect(address, what="mosos sweep")
    try:
        error_console.print(f"running on {session.where}", highlight=False)
        if loaded.spec.workers > session.largest_node_cpus():
            raise MososError(
                f"workers: {loaded.spec.workers} solver threads per solve, but the largest Ray node has "
                f"{session.largest_node_cpus():g} CPUs: no solve could ever start"
            )
        schedules_dir = prepare_out_dir(out_dir, force)
        counts = {"done": 0, "infeasible": 0, "failed": 0, "timed_out": 0, "cancelled": 0}
        running = [0]
        with Progress(SpinnerColumn(), TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[status]}"), console=error_console, disable=not show,
                      transient=False) as progress:
            task = progress.add_task("sweep", total=len(loaded.solves), status="")

            def status_text() -> str:
                shown = [f"running {running[0]}"] + [f"{name.replace('_', ' ')} {count}" for name, count in counts.items() if count]
                return " · ".join(shown)

            def on_row(row: dict) -> None:
                counts[row["status"]] = counts.get(row["status"], 0) + 1
                progress.update(task, advance=1, status=status_text())

            def on_running(count: int) -> None:
                running[0] = count
                progress.update(task, status=status_text())

            runner = SweepRunner(loaded, session, schedules_dir=schedules_dir, on_row=on_row, on_running=on_running)
            result = runner.run()
    finally:
        session.close()
    csv_path, json_path = write_results(out_dir, result, loaded)
    from cluster.sweep_results import csv_text, json_document

    if as_json:
        typer.echo(json.dumps(json_document(result, loaded), indent=1))
    elif as_csv:
        typer.echo(csv_text(result.rows), nl=False)
    else:
        title = f"{loaded.spec.name or spec_path.name}: {len(result.rows)} solves on {result.where}"
        console.print(_results_table(title, result.rows))
    summary = ", ".join(f"{count} {name.replace('_', ' ')}" for name, count in result.counts.items() if count)
    error_console.print(f"{summary} in {result.wall_time_s:.1f} s; wrote {csv_path}, {json_path} and "
                        f"{sum(1 for row in result.rows if row.get('schedule_path'))} schedule(s) in {schedules_dir}",
                        highlight=False)
    if result.interrupted:
        error_console.print("interrupted: the rows of solves that had not ended say 'cancelled'")
        raise typer.Exit(EXIT_INTERRUPTED)
    if not result.all_solved:
        raise typer.Exit(EXIT_SOME_FAILED)

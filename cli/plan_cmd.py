"""`mosos plan`: plan a profile under a budget and compare strategies."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import typer
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from cli.app import EXIT_INFEASIBLE, app, console, error_console, friendly
from cli.checks import distinct_files, replacing, time_limit_within, whole_number_in, writable_output
from cli.time_limit import command_started
from planner.budget import resolve_budget
from planner.comparison import ComparisonRow, compare, time_share_s
from planner.errors import BudgetError, InfeasibleBudget, MososError
from planner.planning import plan, strategy_names
from planner.profile import load_profile
from planner.simulator import simulate
from planner.strategies import load_all
from planner.strategies.keep_all import keep_all_schedule
from planner.units import format_bytes, parse_bytes
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.

# Seconds kept back from --time-limit for what the command does after planning (the lower bound, printing, writing
# -o), and for what the strategies do past their shares before they can stop (each pass a heuristic or a solver's
# set-up starts runs whole: 0.2-0.3 s past its share on vgg416's 2,093 nodes under load): both grow with the graph.
FINISH_S = 0.2
FINISH_PER_NODE_S = 0.00015


class _Progress:
    """A live line for long solves: each improving solution, the bound, the gap, the time."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.live: Live | None = None
        self.started = time.monotonic()

    def __enter__(self):
        if self.enabled:
            self.live = Live(console=error_console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def __call__(self, event: dict) -> None:
        if self.live is None:
            return
        name = event.get("strategy", "")
        if event.get("phase"):
            name += f" ({event['phase']})"
        parts = [f"[bold]{name}[/]", f"{time.monotonic() - self.started:6.1f} s"]
        if event.get("objective") is not None:
            parts.append(f"best {event['objective']:.4g}")
        if event.get("bound") is not None:
            parts.append(f"bound {event['bound']:.4g}")
        if event.get("gap") is not None:
            parts.append(f"gap {100 * event['gap']:.2f}%")
        if event.get("solutions") is not None:
            parts.append(f"{event['solutions']} solutions")
        self.live.update("  ".join(parts))


def _title(profile_name: str, budget_bytes: int | None, memory_ratio: float | None) -> str:
    budget_text = f"budget {format_bytes(budget_bytes)}" if budget_bytes is not None else "no budget"
    if memory_ratio is not None:
        budget_text += f" ({memory_ratio:g} of the keep-all peak)"
    return f"{profile_name}: {budget_text}"


def _report_infeasible(error: BudgetError, compared: list[dict], as_json: bool) -> None:
    """The chosen strategy found no plan: say why (and, with --compare, how the others did), exit 3."""
    if as_json:
        document = {"feasible": False, "error": str(error), "minimum_budget_bytes": error.minimum_budget_bytes}
        if compared:
            document["strategies"] = compared
        typer.echo(json.dumps(document, indent=2 if compared else None))
    else:
        error_console.print(f"[bold red]infeasible:[/] {error}", highlight=False)
    raise typer.Exit(EXIT_INFEASIBLE)


def _comparison_table(title: str, rows: list[ComparisonRow], lower_bound_ms: float, budget: int | None) -> Table:
    table = Table(title=escape(title))
    for header in ("strategy", "step time", "overhead", "peak memory", "fits", "arena", "offloaded", "recompute",
                   "algos changed", "solver"):
        table.add_column(header, justify="left" if header in ("strategy", "solver") else "right")
    for row in rows:
        summary = row.schedule.summary if row.schedule is not None else None
        if row.not_run:
            table.add_row(row.strategy, "not run", "", "", "", "", "", "", "", "time limit spent")
            continue
        if row.out_of_time:  # no plan found in its share of the time, none proven impossible either
            known = f"; {format_bytes(row.minimum_budget_bytes)} fits" if row.minimum_budget_bytes else ""
            table.add_row(row.strategy, "none in time", "", "", f"unknown{known}", "", "", "", "", "time limit")
            continue
        if summary is None and row.minimum_budget_bytes:
            table.add_row(row.strategy, "infeasible", "", "", f"no: needs {format_bytes(row.minimum_budget_bytes)}",
                          "", "", "", "", "")
            continue
        if summary is None:  # the strategy cannot run on this profile: the reason goes in the last column
            table.add_row(row.strategy, "cannot run", "", "", "no", "", "", "", "", (row.error or "").split("; ")[0])
            continue
        fits = "yes" if budget is None or summary.peak_memory_bytes <= budget else "no"
        solver = ""
        if summary.solver is not None:
            gap = f", gap {100 * summary.solver.gap:.2f}%" if summary.solver.gap is not None else ""
            solver = f"{summary.solver.status} {summary.solver.wall_time_s:.1f}s{gap}"
        table.add_row(
            row.strategy,
            f"{summary.predicted_step_time_ms:.2f} ms",
            f"{100 * (summary.predicted_step_time_ms / lower_bound_ms - 1):+.2f}%" if lower_bound_ms else "",
            format_bytes(summary.peak_memory_bytes),
            fits,
            _arena(row.schedule, summary),
            format_bytes(summary.offloaded_bytes),
            f"{summary.recompute_time_ms:.2f} ms",
            str(summary.implementations_changed),
            solver,
        )
    return table


def _arena(schedule, summary) -> str:
    """The arena of planned addresses; 'over' where fixed memory and it pass the budget (no addresses then)."""
    if summary.arena_bytes is None:
        return ""
    return format_bytes(summary.arena_bytes) + ("" if schedule.arena_bytes is not None else " (over)")


@app.command("plan")
@friendly
def plan_command(
    profile_path: Path = typer.Argument(..., metavar="PROFILE"),
    budget: str = typer.Option(None, help="memory budget: 10GiB, 12GB or bytes"),
    memory_ratio: float = typer.Option(None, help="budget as a fraction of the keep-all peak, e.g. 0.6"),
    strategy: str = typer.Option("mosos", help="which planner; see --compare all for every one"),
    time_limit: float = typer.Option(
        60.0, help="time limit of the whole command, seconds: the best plan found by then (with --compare, "
        "shared by the strategies, the solver-based ones getting the largest shares)"
    ),
    workers: int = typer.Option(None, help="solver threads (default: all cores)"),
    seed: int = typer.Option(0, help="solver seed; with --workers 1 the plan is reproducible"),
    compare_with: str = typer.Option(None, "--compare", help="'all' or a comma-separated list of strategies to compare"),
    output: Path = typer.Option(None, "-o", "--output", help="write the schedule here"),
    html: Path = typer.Option(None, "--html", help="write the plan viewer: one self-contained HTML page"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON"),
) -> None:
    """Plan PROFILE within a budget, check it in the simulator, and compare strategies."""
    # --time-limit counts from the start of `mosos` itself (Python and the imports take about 0.3 s): reading the
    # profile is part of the command, as is everything before it
    started = command_started()
    writable_output(output, "-o")
    writable_output(html, "--html", (".html", ".htm"))
    distinct_files({"PROFILE": profile_path}, {"-o": output, "--html": html})
    time_limit_within(time_limit)
    whole_number_in(seed, "--seed", 0, 2**31 - 1)
    whole_number_in(workers, "--workers", 1, 1024)
    profile = load_profile(profile_path)
    names = strategy_names()
    try:
        budget_bytes = resolve_budget(profile, parse_bytes(budget) if budget is not None else None, memory_ratio)
    except BudgetError as error:
        if error.minimum_budget_bytes is None:  # not a budget at all: bad input
            raise
        # below what any plan needs: no strategy can meet it, which is what exit 3 says (with the minimum)
        _report_infeasible(error, [], as_json)
    capacity = profile.hardware.memory_capacity_bytes
    notes = []
    if budget_bytes is not None and budget_bytes > capacity:
        notes.append(f"the budget {format_bytes(budget_bytes)} is more than the device's memory "
                     f"({format_bytes(capacity)}, {profile.hardware.name}); plans are checked against the budget only")
        if not as_json:
            error_console.print(f"[yellow]note:[/] {notes[-1]}", highlight=False)
    if strategy in names and budget_bytes is None and load_all()[strategy].uses_budget:
        raise MososError(f"strategy {strategy!r} needs a budget: give --budget or --memory-ratio")
    if compare_with is not None:
        listed = [s.strip() for s in compare_with.split(",") if s.strip()]
        if not listed:
            raise MososError(f"--compare takes 'all' or strategies separated by commas, not {compare_with!r}")
        wanted = [s for s in listed if s != "all"] + (names if "all" in listed else [])
        unknown = [s for s in wanted if s not in names]
        if unknown:
            raise MososError(f"unknown strategy {unknown[0]!r} in --compare; known: {', '.join(names)}")
        wanted = list(dict.fromkeys(wanted))  # each once, in the order given
    else:
        wanted = []
    order = [strategy] + [s for s in wanted if s != strategy]
    # The command's own work after planning (the lower bound, the table, the output file) is kept out of the limit.
    limit = max(1e-3, time_limit - FINISH_S - FINISH_PER_NODE_S * len(profile.nodes))
    with _Progress(enabled=not as_json and error_console.is_terminal) as progress:
        options = dict(workers=workers, seed=seed, progress=progress)
        infeasible: InfeasibleBudget | None = None
        try:
            # its share of what is left now: reading the profile and loading the strategies came out of the limit
            # too, and charged to the chosen strategy alone, they left it nothing (VGG19 with --compare all at 2 s:
            # 0.5 s of its 0.78 s gone before it began, and no plan, where the strategies after it found one)
            chosen = plan(
                profile, budget_bytes, strategy=strategy,
                time_limit_s=max(1e-3, time_share_s(order, 0, limit - (time.monotonic() - started))), **options,
            )
            rows = [ComparisonRow(strategy, chosen)]
        except InfeasibleBudget as error:
            if not order[1:]:
                _report_infeasible(error, [], as_json)
            infeasible, chosen, rows = error, None, [ComparisonRow.failed(strategy, error)]
        # the comparison asked for is made even when the chosen strategy finds no plan: it says which one does
        rows += compare(
            profile, budget_bytes, order[1:], time_limit_s=limit, started_at=started, shared=True, **options
        )
    lower_bound_ms = simulate(profile, keep_all_schedule(profile), keep_timeline=False).step_time_ms
    if infeasible is not None:
        if not as_json:
            console.print(_comparison_table(_title(profile.name, budget_bytes, memory_ratio), rows, lower_bound_ms,
                                            budget_bytes))
        _report_infeasible(infeasible, [row.as_dict(lower_bound_ms) for row in rows], as_json)
    files = []
    if output:
        files.append((output, "-o", chosen.to_json().encode("utf-8")))
    if html:
        from planner.viewer import plan_view_html

        files.append((html, "--html", plan_view_html(profile, chosen).encode("utf-8")))
    with contextlib.ExitStack() as outputs:  # every file or none: each replaces its target once all are written
        for path, option, content in files:
            outputs.enter_context(replacing(path, option)).write_bytes(content)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "profile": profile.name,
                    "budget_bytes": budget_bytes,
                    "lower_bound_ms": lower_bound_ms,
                    "strategies": [row.as_dict(lower_bound_ms) for row in rows],
                    "schedule_path": str(output) if output else None,
                    "html_path": str(html) if html else None,
                    "notes": notes,
                },
                indent=2,
            )
        )
        return
    console.print(_comparison_table(_title(profile.name, budget_bytes, memory_ratio), rows, lower_bound_ms,
                                    budget_bytes))
    console.print(f"lower bound (keep-all, fastest algorithms, no budget): {lower_bound_ms:.2f} ms")
    for path in (output, html):
        if path:
            console.print(f"wrote {path}")

"""`mosos max-batch`: the largest batch whose plan fits the GPU, per strategy, and the batch with the best throughput.

A named model is estimated for a named GPU (`--model vgg19 --gpu v100`); a
user's `--model path.py:build` workload is estimated for a named GPU from its
captured step at every batch (`--gpu h100`, `executor.measure.batch_profiles.EstimatedWorkloadProfiles`),
or, without `--gpu`, measured on this machine's device at a few batches and
scaled (`executor.measure.batch_profiles.MeasuredProfiles`). torch, `models` and
`executor` are imported only when the command runs.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.markup import escape
from rich.table import Table

from cli.app import EXIT_INFEASIBLE, app, console, error_console, friendly
from cli.checks import (distinct_files, positive_finite, replacing, time_limit_within, whole_number_in, workload_file,
                        writable_output)
from cli.time_limit import command_started, time_limited
from planner.errors import MososError, TimeLimitReached
from planner.max_batch import DEFAULT_STRATEGIES, MAX_BATCH_LIMIT, MaxBatchResult, max_batch, parse_overhead
from planner.planning import strategy_names
from planner.units import format_bytes, parse_bytes
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.

MIN_SEARCH_S = 1.0  # what the search needs at least once the profiles are ready
FINISH_S = 0.5  # kept from the search for the table, the JSON and the plot


def _batches(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise MososError(f"{option} is a comma-separated list of batch sizes, e.g. 2,4; not {text!r}") from None
    if len(set(values)) < 2 or min(values) < 1:
        raise MososError(f"{option} needs at least two different batch sizes of 1 or more, not {text!r}")
    return values


def _check_math_and_optimizer(*, estimated: bool, math: str, optimizer: str | None) -> None:
    """Before the profiles are made (seconds of work): the names the estimator or the measuring pass takes."""
    if math not in ("fp32", "tf32"):
        raise MososError(f"--math must be fp32 or tf32 (tensors are float32), not {math!r}")
    if optimizer is None:
        return
    if estimated:
        from models.estimator import OPTIMIZER_STATE_BUFFERS

        if optimizer not in OPTIMIZER_STATE_BUFFERS:
            raise MososError(f"unknown --optimizer {optimizer!r} for estimates; use {', '.join(OPTIMIZER_STATE_BUFFERS)}")
    elif importlib.util.find_spec("torch") is not None:  # without torch, making the profiles says what to install
        from executor.measure.profiler import optimizer_state_bytes

        optimizer_state_bytes(optimizer, 0)  # the measuring pass's own check


def _strategies(given: list[str] | None) -> list[str]:
    if not given:
        return list(DEFAULT_STRATEGIES)
    names = strategy_names()
    wanted: list[str] = []
    for item in given:
        for name in (part.strip() for part in item.split(",")):
            if not name:
                continue
            if name == "all":
                wanted += [n for n in names if n not in wanted]
                continue
            if name not in names:
                raise MososError(f"unknown strategy {name!r} in --strategy; known: {', '.join(names)}")
            wanted.append(name)
    return list(dict.fromkeys(wanted))


def _profile_source(model: str, gpu: str | None, *, image_size, tokens, small, math, optimizer, memory, device,
                    measure_batches, validate_batch, repeats, threads, d2h, h2d, budget, say):
    if importlib.util.find_spec("torch") is None:
        raise MososError("mosos max-batch needs torch to estimate or measure the model (a CPU build is enough): "
                         "pip install torch")
    from models.workload import looks_like_spec

    if looks_like_spec(model):
        if gpu is not None:
            from executor.measure.batch_profiles import EstimatedWorkloadProfiles

            return EstimatedWorkloadProfiles(model, gpu, math=math, optimizer=optimizer, memory_bytes=memory,
                                             progress=say)
        from executor.measure.batch_profiles import MeasuredProfiles

        return MeasuredProfiles(model, device=device, measure_batches=measure_batches, validate_batch=validate_batch,
                                optimizer=optimizer, repeats=repeats, threads=threads, d2h_gb_per_s=d2h,
                                h2d_gb_per_s=h2d, budget_bytes=budget, progress=say)
    from models.gpus import GPUS
    from models.registry import list_models

    if gpu is None:
        known = ", ".join(list_models())
        raise MososError(
            f"--model {model} names a reference network: give --gpu ({', '.join(GPUS)}) to estimate it on that GPU, "
            f"or --model path/to/file.py:build to measure your own workload here (reference networks: {known})"
        )
    from models.batch_profiles import EstimatedProfiles

    return EstimatedProfiles(model, gpu, image_size=image_size, tokens=tokens, small=small, math=math,
                             optimizer=optimizer, memory_bytes=memory)


def _table(result: MaxBatchResult, title: str) -> Table:
    table = Table(title=escape(title))
    for header in ("strategy", "largest batch", "step time", "overhead", "peak memory", "throughput",
                   "best throughput", "search", "solves", "time"):
        table.add_column(header, justify="left" if header in ("strategy", "search") else "right")
    for answer in result.strategies:
        probe = answer.at_max
        open_next = answer.unsettled_next()
        if open_next is not None:
            search = (f"next: {open_next.batch_size} {open_next.outcome} in its {open_next.time_limit_s:g} s "
                      f"({open_next.solver_status or 'no plan'}): more time may fit more")
        elif answer.complete:
            search = "complete" + (f" (next: {answer.first_failing_batch_size} does not fit)"
                                   if answer.first_failing_batch_size else "")
        else:
            search = f"open: {answer.stopped_by or 'stopped'}"
        if not answer.monotone:
            search += f"; NOT monotone ({len(answer.violations)})"
        solves = sum(1 for p in answer.probes if p.outcome != "below-floor")
        if probe is None:
            # "no batch found ...": the time ran out first, which is not "none fits"
            none = "none in time" if (answer.reason or "").startswith("no batch found") else "none fits"
            table.add_row(answer.strategy, none, "", "", "", "", "", search, str(solves), f"{answer.wall_time_s:.1f} s")
            continue
        best = (f"{answer.best_throughput_batch_size} ({answer.best_throughput_samples_per_s:.1f}/s)"
                if answer.best_throughput_batch_size is not None else "")
        table.add_row(
            answer.strategy, str(answer.max_batch_size), f"{probe.step_time_ms:.1f} ms", f"{100 * probe.overhead:+.1f}%",
            format_bytes(probe.peak_memory_bytes), f"{probe.throughput_samples_per_s:.1f}/s", best, search,
            str(solves), f"{answer.wall_time_s:.1f} s",
        )
    return table


class _Progress:
    """A bar of the time limit used, and a line naming the strategy, the batch just tried and its outcome."""

    def __init__(self, enabled: bool, time_limit_s: float):
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                 console=error_console, transient=False) if enabled else None
        self.time_limit_s = time_limit_s
        self.started = time.monotonic()
        self.task = None

    def __enter__(self):
        if self.progress is not None:
            self.progress.__enter__()
            self.task = self.progress.add_task("preparing profiles", total=self.time_limit_s)
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.update(self.task, completed=self.time_limit_s)
            self.progress.__exit__(*exc)

    def say(self, message: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=message, completed=time.monotonic() - self.started)

    def __call__(self, event: dict) -> None:
        largest = event.get("largest_fitting")
        self.say(f"{event['strategy']} ({event['phase']}): batch {event['batch_size']} {event['outcome']}"
                 + (f", largest so far {largest}" if largest else ""))


@app.command("max-batch")
@friendly
def max_batch_command(
    model: str = typer.Option(..., "--model", "-m", help="reference network (vgg19, resnet50, ...) with --gpu, or "
                              "path/to/file.py:build (your workload, build(batch_size=...): estimated for --gpu, "
                              "else measured here)"),
    gpu: str = typer.Option(None, "--gpu", "-g", help="GPU to estimate on (a reference network, or your "
                            "file.py:build without measuring it): titanx, p40, p100, v100, a100, h100"),
    budget: str = typer.Option(None, help="memory budget (16GB, 16GiB, bytes); default: the GPU's (or device's) memory"),
    max_overhead: str = typer.Option("10%", help="slowest acceptable step over each batch's lower bound: 10%, 0.1 "
                                     "(a bare number above 1 is refused: write 150%), 'forward' (one extra forward "
                                     "pass, Checkmate's) or 'none'"),
    strategy: list[str] = typer.Option(None, "--strategy", "-s", help="strategy to search (repeat, or comma-separated; "
                                       f"'all'); default: {', '.join(DEFAULT_STRATEGIES)}"),
    time_limit: float = typer.Option(120.0, help="seconds for the whole command: profiles, then the search (each "
                                     "strategy an equal share of what is left; each solve a part of its share)"),
    workers: int = typer.Option(None, help="solver threads per solve (default: all cores)"),
    seed: int = typer.Option(0, help="solver seed"),
    batch_limit: int = typer.Option(65536, help="largest batch to consider"),
    throughput_probes: int = typer.Option(6, help="extra batches evaluated to locate the best throughput"),
    image_size: int = typer.Option(None, help="image height and width of a reference network (default 224; U-Net 256)"),
    tokens: int = typer.Option(None, help="sequence length of the transformer (default 1024)"),
    small: bool = typer.Option(False, help="the tiny test variant of a reference network"),
    math: str = typer.Option("fp32", help="fp32, or tf32 (A100/H100 tensor cores), for estimates"),
    optimizer: str = typer.Option(None, help="optimizer state counted as fixed memory (estimates: sgd, sgd-momentum "
                                  "(default), adam; measured: sgd (default), momentum, adam, adamw)"),
    memory: str = typer.Option(None, help="device memory if not the GPU's own, for estimates, e.g. 32GiB"),
    device: str = typer.Option("cpu", help="where a file.py:build workload is measured: cpu or cuda"),
    measure_batches: str = typer.Option("4,8", help="batches a workload is measured at; others are scaled from them"),
    validate_batch: int = typer.Option(16, help="batch measured to check the scaling (0: none)"),
    repeats: int = typer.Option(3, help="timed runs per node when measuring"),
    threads: int = typer.Option(None, help="torch CPU threads while measuring (1 steadies timings on a busy machine)"),
    d2h_gb_per_s: float = typer.Option(None, "--d2h-gb-per-s", help="device-to-host bandwidth of a measured "
                                       "workload (CPU: none unless given, so no offloading)"),
    h2d_gb_per_s: float = typer.Option(None, "--h2d-gb-per-s", help="host-to-device bandwidth of a measured workload"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
    plot: Path = typer.Option(None, help="draw throughput and overhead against batch size (PNG, SVG or PDF)"),
) -> None:
    """The largest batch whose plan fits the budget, for each strategy, and the batch with the best throughput."""
    started = command_started()  # --time-limit counts from the start of `mosos` itself
    writable_output(plot, "--plot", (".png", ".svg", ".pdf"))
    distinct_files({"the workload's file": workload_file(model)}, {"--plot": plot})
    time_limit_within(time_limit)
    whole_number_in(workers, "--workers", 1, 1024)
    whole_number_in(seed, "--seed", 0, 2**31 - 1)
    whole_number_in(batch_limit, "--batch-limit", 1, MAX_BATCH_LIMIT)
    whole_number_in(throughput_probes, "--throughput-probes", 0, 64)
    whole_number_in(image_size, "--image-size", 1, 1 << 16)
    whole_number_in(tokens, "--tokens", 1, 1 << 24)
    whole_number_in(validate_batch, "--validate-batch", 0, MAX_BATCH_LIMIT)
    whole_number_in(repeats, "--repeats", 1, 1000)
    whole_number_in(threads, "--threads", 1, 1024)
    positive_finite(d2h_gb_per_s, "--d2h-gb-per-s")
    positive_finite(h2d_gb_per_s, "--h2d-gb-per-s")
    overhead = parse_overhead(max_overhead)
    strategies = _strategies(strategy)
    budget_bytes = parse_bytes(budget) if budget is not None else None
    if budget_bytes == 0:
        raise MososError("--budget must be more than 0 bytes")
    memory_bytes = parse_bytes(memory) if memory else None
    if memory_bytes == 0:
        raise MososError("--memory must be more than 0 bytes")
    measures = _batches(measure_batches, "--measure-batches")
    _check_math_and_optimizer(estimated=gpu is not None, math=math, optimizer=optimizer)
    if gpu is not None:  # before torch is imported for the profiles (seconds)
        from models.gpus import get_gpu

        try:
            get_gpu(gpu)
        except KeyError as error:
            raise MososError(f"--gpu: {error.args[0]}") from None
    with _Progress(not as_json and error_console.is_terminal, time_limit) as progress:
        # making the profiles (torch, a capture, measuring) takes no deadline of its own: the alarm stops it
        with time_limited(time_limit, started) as watch:
            def say(message: str) -> None:
                watch.note(message)
                progress.say(message)

            watch.note(f"making the profiles of {model}")
            source = _profile_source(
                model, gpu, image_size=image_size, tokens=tokens, small=small, math=math,
                optimizer=optimizer or ("sgd" if ":" in model and gpu is None else "sgd-momentum"),
                memory=memory_bytes, device=device, measure_batches=measures, validate_batch=validate_batch or None,
                repeats=repeats, threads=threads, d2h=d2h_gb_per_s, h2d=h2d_gb_per_s, budget=budget_bytes, say=say,
            )
        prepared_s = time.monotonic() - started
        search_s = time_limit - prepared_s - FINISH_S
        if search_s < MIN_SEARCH_S:
            raise TimeLimitReached(f"making the profiles took {prepared_s:.1f} s of the {time_limit:g} s time limit, "
                                   "leaving too little to search: give a longer --time-limit")
        result = max_batch(source, budget_bytes, strategies=strategies, max_overhead=overhead, time_limit_s=search_s,
                           workers=workers, seed=seed, batch_limit=batch_limit, throughput_probes=throughput_probes,
                           progress=progress)
    profiles_text = source.describe()

    def write_plot() -> None:
        """After the result is shown: a plot that cannot be written (a full disk) loses nothing else."""
        if plot:
            from planner.max_batch_plot import plot_max_batch

            with replacing(plot, "--plot") as temporary:
                plot_max_batch(result, temporary, title=f"{result.profile_name.replace('batch 1 ', '')}: "
                               f"budget {format_bytes(result.budget_bytes)}, {result.overhead_description}")
    found = any(answer.max_batch_size is not None for answer in result.strategies)
    # no batch found because every strategy's share ran out, not because none fits: the time limit's exit code
    not_found_code = (TimeLimitReached.exit_code if not found and all(a.stopped_by for a in result.strategies)
                      else EXIT_INFEASIBLE)
    if as_json:
        document = {**result.model_dump(mode="json"), "profiles": profiles_text,
                    "profile_seconds": prepared_s, "command_seconds": time.monotonic() - started}
        if hasattr(source, "report"):
            document["scaling"] = source.report.as_dict()
        typer.echo(json.dumps(document, indent=2))
        write_plot()
        if not found:
            raise typer.Exit(not_found_code)
        return
    title = (f"{result.profile_name.replace('batch 1 ', '')}: budget {format_bytes(result.budget_bytes)}, "
             f"{result.overhead_description}")
    console.print(_table(result, title))
    for answer in result.strategies:
        if answer.reason:
            console.print(f"[bold]{answer.strategy}[/]: {answer.reason}", highlight=False)
        for violation in answer.violations:
            console.print(f"[yellow]{answer.strategy}: not monotone:[/] {violation}", highlight=False)
    if result.best_throughput:
        best = result.best_throughput
        console.print(f"best throughput: {best['strategy']} at batch {best['batch_size']}, "
                      f"{best['samples_per_s']:.1f} samples/s (simulated)", highlight=False)
    console.print(f"no plan of any strategy fits above batch {result.floor_batch_size}: {result.floor_reason}",
                  highlight=False)
    console.print(f"profiles: {profiles_text} ({prepared_s:.1f} s)", highlight=False)
    under = getattr(getattr(source, "report", None), "size_underestimate_bytes", None)
    if under:
        error_console.print(f"[yellow]note:[/] scaling under-predicted some sizes by up to {under} bytes at the "
                            "validation batch: measure at batches aligned with the model's steps (see --measure-batches)",
                            highlight=False)
    console.print(f"time: {result.time_split}; {result.wall_time_s:.1f} s of {result.time_limit_s:.1f} s searching",
                  highlight=False)
    write_plot()
    if plot:
        console.print(f"wrote {plot}")
    if not found and not_found_code != EXIT_INFEASIBLE:
        error_console.print(f"[bold red]no batch found[/]: --time-limit {time_limit:g} s ran out before any strategy "
                            "solved a batch (see above); give a longer --time-limit", highlight=False)
        raise typer.Exit(not_found_code)
    if not found:
        error_console.print("[bold red]no batch fits[/] with any strategy (see above)", highlight=False)
        raise typer.Exit(EXIT_INFEASIBLE)

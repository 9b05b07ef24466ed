"""The Typer application and the error handling every command shares."""

from __future__ import annotations

import functools
import gc

import typer
from rich.console import Console
from rich.markup import escape

from cli.time_limit import counted_from_process_start
from planner.errors import MososError
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.

app = typer.Typer(
    name="mosos",
    help="Plan training steps that fit in GPU memory: keep, offload, recompute, and pick algorithms.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
error_console = Console(stderr=True)
if not console.is_terminal:  # pipes and CI logs: wide enough for the comparison table
    console.width = 160
if not error_console.is_terminal:
    error_console.width = 160

EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3


def friendly(command):
    """Bad input ends with a message and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except MososError as error:
            # escaped: a message naming "mosos[ray]" or a path like "x[a]" must not be read as rich markup
            error_console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, markup=True, soft_wrap=True)
            code = getattr(error, "exit_code", EXIT_BAD_INPUT)
            raise typer.Exit(code) from None
        except OSError as error:  # a file the checks up front could not foresee (disk full, permissions)
            where = f" ({error.filename})" if error.filename else ""
            error_console.print(f"[bold red]error:[/] {error.strerror or error}{where}", highlight=False)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except KeyboardInterrupt:
            error_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def step_note(profile) -> str:
    """The optimizer step's temporaries beside the fixed memory in a one-line summary, where there are any."""
    from planner.units import format_bytes

    step_bytes = profile.fixed_memory.optimizer_step_bytes
    return f" (and {format_bytes(step_bytes)} during the optimizer's step)" if step_bytes else ""


def main() -> None:
    try:
        with counted_from_process_start():
            app(prog_name="mosos")
    finally:
        # Nothing is left to do but exit: without a last collection over every object a large plan left behind,
        # the interpreter's exit takes 0.05 s instead of 0.2 s (vgg416 --compare all), time --time-limit counts.
        gc.freeze()

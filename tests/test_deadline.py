"""A time limit is a limit: every strategy returns within it on large generated graphs, through plan() and the CLI.

The bounds here are loose (a loaded 2-core CI machine: T + 50% + 3 s); the tight figure (T + 5% + 1 s) is
benchmarks/solver_scaling.py's. The graphs are generated (planner/random_layered.py), not written by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner.errors import MososError
from planner.planning import InfeasibleBudget, plan, strategy_names
from planner.random_layered import random_layered_profile, random_training_profile
from planner.simulator import simulate

LIMIT_S = 1.5
ROOT = Path(__file__).resolve().parents[1]


def loose_bound_s(limit_s: float) -> float:
    return 1.5 * limit_s + 3.0


@pytest.fixture(scope="module")
def training_graph():
    return random_training_profile(500, seed=3)  # 1,001 nodes, algorithm choices, a 12 GB/s link


def timed_plan(profile, strategy, limit_s=LIMIT_S, **options):
    started = time.monotonic()
    try:
        schedule = plan(profile, memory_ratio=0.6, strategy=strategy, time_limit_s=limit_s, **options)
    except MososError as error:
        schedule = error
    return schedule, time.monotonic() - started


@pytest.mark.parametrize("strategy", strategy_names())
def test_every_strategy_returns_within_its_limit_on_a_1001_node_graph(training_graph, strategy):
    schedule, elapsed = timed_plan(training_graph, strategy)
    assert elapsed <= loose_bound_s(LIMIT_S), f"{strategy}: {elapsed:.1f} s for a {LIMIT_S} s limit"
    if isinstance(schedule, InfeasibleBudget):
        # anytime, even when nothing is found: the answer names a budget known to work
        assert schedule.minimum_budget_bytes is not None
    elif not isinstance(schedule, MososError) and schedule.budget_bytes is not None:
        budget = schedule.budget_bytes
        assert simulate(training_graph, schedule, budget, keep_timeline=False).peak_memory_bytes <= budget


@pytest.mark.parametrize("strategy", ["mosos", "recompute-only"])
def test_the_limit_holds_on_a_dense_random_layered_graph(strategy):
    """The family where --time-limit 30 ran 89 s: 1,000 nodes, 11,000 edges, no plan in the given order."""
    profile = random_layered_profile(1000, seed=0)
    _, elapsed = timed_plan(profile, strategy, limit_s=2.0)
    assert elapsed <= loose_bound_s(2.0), f"{strategy}: {elapsed:.1f} s for a 2 s limit"


def test_one_worker_keeps_the_limit_too(training_graph):
    _, elapsed = timed_plan(training_graph, "mosos", workers=1)
    assert elapsed <= loose_bound_s(LIMIT_S)


def test_the_cli_time_limit_bounds_the_whole_command(tmp_path, training_graph):
    """Reading the profile, planning and writing the answer: from the command's start (interpreter start-up aside)."""
    path = tmp_path / "generated.json"
    path.write_text(training_graph.model_dump_json())
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", "import time, sys; from cli import main; t = time.monotonic(); "
         "sys.argv = ['mosos', 'plan', sys.argv[1], '--memory-ratio', '0.6', '--time-limit', '2', '--json']; "
         "\ntry:\n    main()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
         "print('elapsed', time.monotonic() - t, file=sys.stderr); sys.exit(code)", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    total = time.monotonic() - started
    assert result.returncode in (0, 3), result.stderr[-2000:]
    command_s = float(result.stderr.strip().splitlines()[-1].split()[-1])
    assert command_s <= loose_bound_s(2.0), f"the command took {command_s:.1f} s ({total:.1f} s with start-up)"
    answer = json.loads(result.stdout)
    if result.returncode == 0:
        assert answer["strategies"][0]["strategy"] == "mosos"
    else:  # nothing found in time on a slow machine: the answer still names a budget known to work
        assert answer["feasible"] is False and answer["minimum_budget_bytes"] > 0


def test_mosos_time_limit_counts_from_the_start_of_the_process_to_its_exit(tmp_path):
    """`time mosos plan ... --time-limit 4` measured 4.2-4.4 s on vgg416 with --compare all: the clock began after
    Python's start-up and the imports (0.3 s), and the interpreter's exit over a large plan took 0.2 s more. The
    limit now counts from the process's start, and the exit skips a last collection."""
    profile = ROOT / "models/profiles/vgg416-b32-titanx.json"
    output = tmp_path / "plan.json"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "cli", "plan", str(profile), "--memory-ratio", "0.6",
                             "--compare", "all", "--time-limit", "4", "--json", "-o", str(output)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    took_s = time.monotonic() - started
    assert result.returncode in (0, 3), result.stderr[-2000:]
    # 3.9-4.0 s here, 4.14 s once in CI: the last solver's stop and the exit are a few tens of milliseconds each
    assert took_s <= 4.0 + 0.25, f"--time-limit 4 took {took_s:.2f} s from the process's start to its exit"


def test_the_age_of_a_process_counts_what_ran_before_the_command():
    code = ("import time\ntime.sleep(0.6)\nfrom cli.time_limit import process_age_s\nprint(process_age_s())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert 0.6 <= float(result.stdout) < 10, result.stdout + result.stderr

def test_a_stop_request_ends_the_joint_models_solve_too(still_heap):
    """The service's cancel: once the joint model's phase has begun, a stop request ends the call within a second,
    as it does in the earlier phases (its whole-model solve used to run on to its share of the limit)."""
    profile = json.loads((ROOT / "models/profiles/vgg19-b144-227-p40.json").read_text())
    from planner.profile import parse_profile

    profile = parse_profile(profile)
    asked: list[float] = []

    def progress(event: dict) -> None:
        if event.get("phase") == "joint model" and not asked:
            asked.append(time.monotonic())

    schedule = plan(profile, memory_ratio=0.6, strategy="mosos", time_limit_s=20, workers=2, progress=progress,
                    should_stop=lambda: bool(asked))
    assert asked, "the joint model's phase never began"
    assert time.monotonic() - asked[0] < 1.5
    assert simulate(profile, schedule).peak_memory_bytes <= schedule.budget_bytes


# Ctrl-C ---------------------------------------------------------------------------------------------------


def _interrupted(command: list[str], after_s: float) -> tuple[subprocess.CompletedProcess, float]:
    """Run `command`, send it SIGINT after `after_s`; its result and how long it took to end after the signal."""
    import signal

    # as a terminal's foreground command gets it: a test run started in the background (CI) ignores SIGINT, and
    # its children inherit that
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parents[1],
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(after_s)
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    stdout, stderr = process.communicate(timeout=60)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), time.monotonic() - sent


def test_ctrl_c_stops_a_plan_at_once_and_writes_nothing(tmp_path):
    """CP-SAT caught SIGINT itself and ended only the solve it was in: `mosos plan` went on through its other solves,
    wrote its plan and exited 0 after the whole limit (17 s after the signal of a 20 s run)."""
    profile = Path(__file__).resolve().parents[1] / "models/profiles/vgg19-b144-227-p40.json"
    output = tmp_path / "plan.json"
    output.write_text("kept")
    command = [sys.executable, "-m", "cli", "plan", str(profile), "--memory-ratio", "0.58", "--time-limit", "30",
               "--workers", "1", "-o", str(output)]
    result, took_s = _interrupted(command, 6.0)  # past the imports and the profile's loading, into the solves
    assert result.returncode == 130 and "interrupted" in result.stderr, (result.returncode, result.stderr[-500:])
    assert took_s < 3.0, took_s
    assert output.read_text() == "kept"


def test_ctrl_c_stops_a_plan_within_a_python_phase_of_a_large_graph(tmp_path):
    """On a 2,093-node graph the phases between solves (a memory-aware reordering, the greedy pass) run seconds of
    Python that poll no stop: Ctrl-C took 4-10 s to end `mosos plan`. The main thread is now interrupted until the
    plan ends."""
    profile = Path(__file__).resolve().parents[1] / "models/profiles/vgg416-b32-titanx.json"
    output = tmp_path / "plan.json"
    command = [sys.executable, "-m", "cli", "plan", str(profile), "--memory-ratio", "0.3", "--time-limit", "30",
               "--workers", "1", "-o", str(output)]
    result, took_s = _interrupted(command, 3.0)
    assert result.returncode == 130 and "interrupted" in result.stderr, (result.returncode, result.stderr[-500:])
    assert took_s < 2.0, took_s
    assert not output.exists()


def test_a_process_that_ignores_sigint_keeps_ignoring_it_while_planning():
    """The service's solve processes ignore SIGINT (the server stops them itself); plan() must not take it back."""
    code = (
        "import signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from planner.interrupt import stop_on_interrupt\n"
        "with stop_on_interrupt() as interrupted:\n"
        "    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert result.stdout.strip() == "ok", result.stderr

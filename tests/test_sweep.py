"""`mosos sweep`: the spec's messages, and small sweeps on the session's local Ray (through the CLI, in a fresh
process joining it by address, and through the runner for what happens to solves that hang or crash)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from planner.profile import load_profile
from planner.schedule import parse_schedule
from planner.simulator import simulate
from planner.strategies import STRATEGIES
from tests.conftest import REPO

pytest.importorskip("yaml")

PROFILES = REPO / "models" / "profiles"
TEST_STRATEGIES = ("sweep-stubborn", "sweep-crash", "sweep-crash-once")

PLUGIN = textwrap.dedent(
    '''
    """Test-only strategies: one that hangs, one that kills its worker, one that kills it on the first try only."""
    import os
    import time
    from pathlib import Path

    from planner.builder import certify
    from planner.strategies import strategy
    from planner.strategies.keep_all import keep_all_schedule


    @strategy("sweep-stubborn", "sleeps 60 s, never looks at should_stop", uses_budget=False)
    def stubborn(profile, budget_bytes, options):
        time.sleep(60)
        return certify(profile, keep_all_schedule(profile, None), "sweep-stubborn")


    @strategy("sweep-crash", "kills its worker process", uses_budget=False)
    def crash(profile, budget_bytes, options):
        os._exit(3)


    @strategy("sweep-crash-once", "kills its worker the first time (a marker file remembers), then keeps all",
              uses_budget=False)
    def crash_once(profile, budget_bytes, options):
        marker = Path(__file__).with_suffix(".crashed")
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(3)
        return certify(profile, keep_all_schedule(profile, None), "sweep-crash-once")
    '''
)


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def run_cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=environment)


@pytest.fixture
def forget_test_strategies():
    yield
    for name in TEST_STRATEGIES:
        STRATEGIES.pop(name, None)


# The spec -------------------------------------------------------------------------------------


def test_every_mistake_in_a_spec_is_reported_at_its_path_and_line(tmp_path):
    from cluster.sweep_spec import SpecError, load_spec

    spec = write(tmp_path / "bad.yaml", f"""\
        profiles:
          - {PROFILES / 'vgg19-small-cpu.json'}
          - missing.json
        models:
          - {{model: vgg19, gpu: v999, batches: [0]}}
        budgets: [8GiX, device, 1.5]
        memory_ratios: [0.5, 1.5]
        strategies: [mosos, nope]
        time_limit_s: "5"
        workerz: 2
        """)
    with pytest.raises(SpecError) as raised:
        load_spec(spec)
    found = {(path, line): message for path, line, message in raised.value.issues}
    assert set(found) == {
        ("profiles[1]", 3), ("models[0].gpu", 5), ("models[0].batches[0]", 5), ("budgets[0]", 6), ("budgets[2]", 6),
        ("memory_ratios[1]", 7), ("strategies[1]", 8), ("time_limit_s", 9), ("workerz", 10),
    }, found
    assert "file not found" in found[("profiles[1]", 3)]
    assert "unknown GPU 'v999'" in found[("models[0].gpu", 5)]
    assert "unknown size unit 'GiX'" in found[("budgets[0]", 6)]
    assert "unknown strategy 'nope'" in found[("strategies[1]", 8)]
    assert "must be a number" in found[("time_limit_s", 9)]
    assert "line 6, budgets[0]" in str(raised.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("profiles: [a.json]\nprofiles: [b.json]\n", "line 2, profiles: this key appears twice"),
        ("profiles: [a.json\n", "not valid YAML"),
        ("- 1\n", "a sweep spec is a mapping of fields"),
        ("", "not empty"),
        ("strategies: [keep-all]\n", "nothing to solve"),
        (f"profiles: [{PROFILES / 'vgg19-small-cpu.json'}]\n", "the strategies need a budget"),
        (f"profiles: [{PROFILES / 'vgg19-small-cpu.json'}]\nstrategies: []\n",
         "line 2, strategies: needs at least 1 item, not an empty list"),
        (f"profiles: [{PROFILES / 'vgg19-small-cpu.json'}]\nmemory_ratios: [0.5]\nplugins: [nope.py]\n",
         "plugins[0]: nope.py: file not found"),
    ],
)
def test_spec_level_mistakes(tmp_path, text, expected):
    from cluster.sweep_spec import SpecError, load_spec

    with pytest.raises(SpecError) as raised:
        load_spec(write(tmp_path / "spec.yaml", text))
    message = str(raised.value).replace("mapping of fields (profiles, budgets, ...), not empty", "not empty")
    assert expected in message


def test_dry_run_lists_the_solves_and_runs_nothing(tmp_path):
    spec = write(tmp_path / "spec.yaml", f"""\
        profiles: [{PROFILES / 'vgg19-small-cpu.json'}, {PROFILES / 'unet-small-cpu.json'}]
        budgets: [device]
        memory_ratios: [0.5, 0.8]
        strategies: [mosos, keep-all, mosos]
        """)
    done = run_cli(["sweep", str(spec), "--dry-run"], tmp_path)
    assert done.returncode == 0, done.stderr
    # 2 profiles x (mosos at 3 budgets + keep-all once): a strategy without a budget is solved once per profile
    assert "8 solves; dry run" in done.stdout, done.stdout
    assert not (tmp_path / "spec-results").exists()
    bad = run_cli(["sweep", str(write(tmp_path / "bad.yaml", "budgets: [1.5]\nprofiles: [x.json]\n"))], tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "line 1, budgets[0]" in bad.stderr and "line 2, profiles[0]: x.json: file not found" in bad.stderr


def test_a_non_empty_out_folder_is_refused_before_any_work(tmp_path):
    spec = write(tmp_path / "spec.yaml", f"profiles: [{PROFILES / 'vgg19-small-cpu.json'}]\nstrategies: [keep-all]\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = run_cli(["sweep", str(spec), "--out", str(out)], tmp_path)
    assert done.returncode == 2 and "is not empty" in done.stderr
    done = run_cli(["sweep", str(spec), "--out", str(out), "--force"], tmp_path)
    assert done.returncode == 2 and "not a sweep's results (notes.txt)" in done.stderr
    assert (out / "notes.txt").read_text() == "mine"


def test_force_replaces_only_what_a_sweep_wrote_in_schedules(tmp_path):
    """--force removed every .json under schedules/, a user's own file there included."""
    from cluster.sweep_results import check_out_dir, prepare_out_dir
    from planner.errors import MososError

    out = tmp_path / "out"
    schedules = out / "schedules"
    schedules.mkdir(parents=True)
    (out / "results.csv").write_text("old")
    (schedules / "0003-vgg19-mosos-8GiB.json").write_text("{}")
    (schedules / "other.json").write_text("mine")
    with pytest.raises(MososError, match=r"not a sweep's results \(schedules/other.json\)"):
        check_out_dir(out, force=True)
    assert (schedules / "other.json").read_text() == "mine"
    (schedules / "other.json").unlink()
    assert prepare_out_dir(out, force=True) == schedules
    assert not any(schedules.iterdir()) and not (out / "results.csv").exists()


# Sweeps on Ray -----------------------------------------------------------------------------------


def test_a_sweep_through_the_cli_writes_a_row_and_a_checked_schedule_per_solve(local_ray, tmp_path):
    """A fresh process joins the session's Ray by address: plans, infeasible budgets and a strategy that needs
    a budget at ratio 0.3 of a tiny profile, each a row; every schedule written passes the simulator."""
    address = local_ray.get_runtime_context().gcs_address
    spec = write(tmp_path / "spec.yaml", f"""\
        name: ci sweep
        profiles:
          - {PROFILES / 'vgg19-small-cpu.json'}
          - path: {PROFILES / 'unet-small-cpu.json'}
        memory_ratios: [0.3, 0.9]
        strategies: [chen-sqrt, mosos, keep-all]
        time_limit_s: 2
        """)
    out = tmp_path / "results"
    done = run_cli(["sweep", str(spec), "--address", address, "--out", str(out), "--json"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(done.stdout)
    assert document == json.loads((out / "results.json").read_text()) | {"finished_at": document["finished_at"]}
    rows = document["rows"]
    assert len(rows) == 2 * (2 * 2 + 1) and [row["index"] for row in rows] == list(range(10))
    assert document["counts"]["done"] + document["counts"]["infeasible"] == 10
    assert {row["status"] for row in rows if row["memory_ratio"] == 0.3} == {"infeasible"}
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 11 and csv_lines[0].startswith("index,source,profile")
    for row in rows:
        assert row["attempts"] == 1 and row["wall_time_s"] is not None
        if row["status"] == "infeasible":
            assert row["minimum_budget_bytes"] > row["budget_bytes"] and row["schedule_path"] is None
            continue
        assert row["status"] == "done", row
        profile = load_profile(row["source"])
        schedule = parse_schedule(json.loads((out / row["schedule_path"]).read_text()))
        figures = simulate(profile, schedule, schedule.budget_bytes, keep_timeline=False)
        assert figures.peak_memory_bytes == row["peak_memory_bytes"]
        assert abs(figures.step_time_ms - row["predicted_step_time_ms"]) < 1e-6
        if row["strategy"] != "keep-all":
            assert row["peak_memory_bytes"] <= row["budget_bytes"]
        assert row["overhead_percent"] >= -1e-9
    assert len(list((out / "schedules").glob("*.json"))) == document["counts"]["done"]


def _runner(directory: Path, text: str):
    from cluster.runtime import connect
    from cluster.sweep import SweepRunner
    from cluster.sweep_spec import load_spec

    directory.mkdir()
    (directory / "strategies.py").write_text(PLUGIN)
    loaded = load_spec(write(directory / "spec.yaml", text))
    session = connect(None, what="test")
    (directory / "schedules").mkdir()
    return SweepRunner(loaded, session, schedules_dir=directory / "schedules")


def test_a_hung_solve_is_stopped_past_the_hard_limit(local_ray, tmp_path, forget_test_strategies):
    runner = _runner(tmp_path / "hung", f"""\
        profiles: [{PROFILES / 'vgg19-small-cpu.json'}]
        strategies: [sweep-stubborn, keep-all]
        plugins: [strategies.py]
        time_limit_s: 0.5
        timeout_s: 3
        """)
    result = runner.run()
    stubborn, keep_all = result.rows
    assert stubborn["status"] == "timed_out" and "past the hard limit of 3 s" in stubborn["reason"]
    assert keep_all["status"] == "done" and keep_all["schedule_path"]
    assert result.counts == {"done": 1, "infeasible": 0, "failed": 0, "timed_out": 1, "cancelled": 0}
    assert not result.all_solved
    _wait_for_free_cpus(local_ray)  # the stopped solve's worker was killed: nothing keeps running


def test_a_dead_worker_is_retried_then_reported(local_ray, tmp_path, forget_test_strategies):
    runner = _runner(tmp_path / "dead", f"""\
        profiles: [{PROFILES / 'vgg19-small-cpu.json'}]
        strategies: [sweep-crash, sweep-crash-once]
        plugins: [strategies.py]
        time_limit_s: 1
        retries: 1
        """)
    crash, once = runner.run().rows
    assert crash["status"] == "failed" and crash["attempts"] == 2
    assert "after 2 attempt(s)" in crash["reason"] and "WorkerCrashedError" in crash["reason"]
    first_pid = (tmp_path / "dead" / "strategies.crashed").read_text()
    assert once["status"] == "done" and once["attempts"] == 2
    assert once["pids"].split(">")[0] == first_pid and once["pids"].split(">")[1] != first_pid


def _wait_for_free_cpus(ray, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"Ray CPUs still busy: {ray.available_resources()}")


def test_ctrl_c_stops_the_sweep_and_keeps_what_finished(local_ray, tmp_path):
    """SIGINT to a `mosos sweep` process: exit 130, the finished rows and their schedules written, the rest
    'cancelled', and no task left running on the cluster."""
    address = local_ray.get_runtime_context().gcs_address
    (tmp_path / "strategies.py").write_text(PLUGIN)
    spec = write(tmp_path / "spec.yaml", f"""\
        profiles: [{PROFILES / 'vgg19-small-cpu.json'}, {PROFILES / 'unet-small-cpu.json'}]
        strategies: [keep-all, sweep-stubborn]
        plugins: [strategies.py]
        time_limit_s: 1
        """)
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    # SIGINT as a terminal's foreground command gets it: a test run started in the background (CI) ignores it, and
    # its children inherit that (CP-SAT's own SIGINT handler, once on in this process, used to reset it)
    process = subprocess.Popen([sys.executable, "-m", "cli", "sweep", str(spec), "--address", address, "--out", "out"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not any("running on" in line for line in lines) and time.monotonic() < deadline:
        assert process.poll() is None, "".join(lines)
        time.sleep(0.1)
    schedules = tmp_path / "out" / "schedules"
    while len(list(schedules.glob("*.json"))) < 2 and time.monotonic() < deadline:  # the keep-all rows are done
        assert process.poll() is None, "".join(lines)
        time.sleep(0.1)
    time.sleep(0.5)  # the stubborn solves (60 s sleeps) are running
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 130
    reader.join(timeout=10)
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert document["interrupted"] is True
    statuses = {(row["source"].split("/")[-1], row["strategy"]): row["status"] for row in document["rows"]}
    assert statuses == {
        ("vgg19-small-cpu.json", "keep-all"): "done", ("vgg19-small-cpu.json", "sweep-stubborn"): "cancelled",
        ("unet-small-cpu.json", "keep-all"): "done", ("unet-small-cpu.json", "sweep-stubborn"): "cancelled",
    }, "".join(lines)
    assert len(list((tmp_path / "out" / "schedules").glob("*.json"))) == 2
    _wait_for_free_cpus(local_ray)


def test_the_shipped_spec_is_the_readme_s_and_runs_as_it_stands(tmp_path):
    """examples/sweep.yaml is the README's example, checks and expands as it says, and the CLI takes it as it is."""
    from cluster.sweep_spec import load_spec

    pytest.importorskip("torch")  # its estimated models are checked by name
    shipped = (REPO / "examples" / "sweep.yaml").read_text()
    readme = (REPO / "README.md").read_text()
    assert "```yaml\n" + shipped + "```" in readme
    loaded = load_spec(REPO / "examples" / "sweep.yaml")
    # 2 files + vgg19 at 2 batches, x 3 strategies x (2 budgets + 2 ratios)
    assert len(loaded.solves) == 4 * 3 * 4
    assert {solve.budget_text for solve in loaded.solves} == {"device memory", "8.00 GiB", "ratio 0.7", "ratio 0.9"}
    done = run_cli(["sweep", str(REPO / "examples" / "sweep.yaml"), "--dry-run"], tmp_path)
    assert done.returncode == 0, done.stderr

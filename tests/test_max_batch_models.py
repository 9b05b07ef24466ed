"""`mosos max-batch` on estimated and measured models: Python API, the CLI in a fresh process, its messages."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from cli import app  # noqa: E402
from executor.measure.batch_profiles import MeasuredProfiles  # noqa: E402
from models.batch_profiles import BatchProfileError, EstimatedProfiles  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.max_batch import max_batch  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.strategies.keep_all import keep_all_peak_bytes  # noqa: E402
from tests.conftest import REPO  # noqa: E402

MIB = 2**20
runner = CliRunner()

WORKLOAD = """
import torch
from torch import nn
import torch.nn.functional as F


def build(batch_size=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    return {"model": model, "inputs": torch.randn(batch_size, 3, 16, 16), "targets": torch.randint(10, (batch_size,)),
            "loss_fn": F.cross_entropy}


def branchy(batch_size=4):
    # a model that depends on the batch size: another graph at larger batches, which cannot be scaled
    layers = [nn.Linear(6, 6), nn.ReLU()] * (2 if batch_size > 4 else 1)
    model = nn.Sequential(*layers, nn.Linear(6, 2))
    return {"model": model, "inputs": torch.randn(batch_size, 6), "targets": torch.randint(2, (batch_size,)),
            "loss_fn": F.cross_entropy}


def one_batch():
    return build(4)


def mlp(batch_size=4):
    # its measuring passes' upper estimates of scratch are above its plans' peaks: at 8 MiB plans fit batch 478,
    # measuring fits 411
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return {"model": model, "inputs": torch.randn(batch_size, 256), "targets": torch.randint(10, (batch_size,)),
            "loss_fn": F.cross_entropy}


def deep(batch_size=4):
    # activations of 64 KiB a sample: at batch 16 keep-all holds 17.1 MB, a frugal schedule 11.9 MB (fixed 5.4 MB)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.Tanh())], nn.Flatten(),
                          nn.Linear(64 * 256, 10))
    return {"model": model, "inputs": torch.randn(batch_size, 64, 256), "targets": torch.randint(10, (batch_size,)),
            "loss_fn": F.cross_entropy}
"""


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("workload") / "tiny.py"
    path.write_text(textwrap.dedent(WORKLOAD))
    return path


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def brute_force(profiles, budget, strategy, top):
    fitting = []
    for batch in range(1, top + 1):
        try:
            schedule = plan(profiles(batch), budget, strategy=strategy)
        except BudgetError:
            continue
        if schedule.summary.peak_memory_bytes <= budget:
            fitting.append(batch)
    return max(fitting, default=None)


def test_estimated_small_vgg_matches_brute_force():
    profiles = EstimatedProfiles("vgg19", "v100", small=True)
    budget = 3 * MIB
    result = max_batch(profiles, budget, strategies=["keep-all", "checkpoint-all", "chen-sqrt"], max_overhead=None,
                       time_limit_s=60, batch_limit=40)
    answers = {a.strategy: a for a in result.strategies}
    for strategy in answers:
        assert answers[strategy].max_batch_size == brute_force(profiles, budget, strategy, 40), strategy
        assert answers[strategy].complete and answers[strategy].monotone
    keep_all = answers["keep-all"].max_batch_size
    assert keep_all_peak_bytes(profiles(keep_all)) <= budget < keep_all_peak_bytes(profiles(keep_all + 1))
    # the optimal recompute-only plan keeps everything when that fits, and does better when it does not
    solver = max_batch(profiles, budget, strategies=["recompute-only"], max_overhead=None, time_limit_s=8, workers=1,
                       batch_limit=40, throughput_probes=0).strategies[0]
    assert solver.max_batch_size > keep_all
    assert solver.at_max.schedule.summary.peak_memory_bytes <= budget


def test_the_cli_in_a_fresh_process_answers_in_json_and_draws(tmp_path):
    picture = tmp_path / "batch.png"
    command = [sys.executable, "-m", "cli", "max-batch", "--model", "vgg19", "--small", "--gpu", "v100", "--budget",
               "4MiB", "--strategy", "keep-all,checkpoint-all", "--max-overhead", "none", "--time-limit", "60",
               "--batch-limit", "64", "--json", "--plot", str(picture)]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["budget_bytes"] == 4 * MIB and report["max_overhead"] is None
    answers = {a["strategy"]: a for a in report["strategies"]}
    profiles = EstimatedProfiles("vgg19", "v100", small=True)
    assert answers["keep-all"]["max_batch_size"] == brute_force(profiles, 4 * MIB, "keep-all", 64)
    assert all(a["at_max"]["peak_memory_bytes"] <= 4 * MIB for a in answers.values())
    assert "estimated at every batch" in report["profiles"]
    assert report["command_seconds"] < 60 + 15
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_names_the_largest_batch_and_the_best_throughput():
    result = invoke("max-batch", "--model", "vgg19", "--small", "--gpu", "v100", "--budget", "4MiB", "--strategy",
                    "keep-all", "--strategy", "chen-sqrt", "--max-overhead", "50%", "--time-limit", "30",
                    "--batch-limit", "64")
    assert result.exit_code == 0, result.output
    assert "largest batch" in result.output and "best throughput: " in result.output
    assert "no plan of any strategy fits above batch" in result.output


@pytest.mark.parametrize(
    "arguments, code, message",
    [
        (["--model", "vgg19"], 2, "give --gpu"),
        (["--model", "vgg19", "--gpu", "v1000"], 2, "unknown GPU 'v1000'"),
        (["--model", "nonet", "--gpu", "v100"], 2, "unknown model 'nonet'"),
        (["--model", "vgg19", "--small", "--gpu", "v100", "--max-overhead", "lots"], 2, "cannot read 'lots'"),
        (["--model", "vgg19", "--small", "--gpu", "v100", "--strategy", "nope"], 2, "unknown strategy 'nope'"),
        (["--model", "vgg19", "--small", "--gpu", "v100", "--budget", "12 parsecs"], 2, "unknown size unit"),
        (["--model", "missing.py:build"], 2, "does not exist"),
        (["--model", "vgg19", "--small", "--gpu", "v100", "--math", "fp16"], 2, "--math must be fp32 or tf32"),
        (["--model", "vgg19", "--small", "--gpu", "v100", "--optimizer", "lion"], 2,
         "unknown --optimizer 'lion' for estimates"),
        (["--model", "vgg19", "--small", "--gpu", "v100", "--budget", "1KiB", "--time-limit", "30"], 3,
         "below what any plan needs at batch 1"),
        (["--model", "vgg19", "--small", "--gpu", "v100", "--budget", "4MiB", "--strategy", "chen-sqrt",
          "--max-overhead", "0%", "--time-limit", "30"], 3, "no batch fits within the overhead limit"),
    ],
)
def test_bad_input_is_a_message(arguments, code, message):
    result = invoke("max-batch", *arguments)
    assert result.exit_code == code, result.output
    assert message in result.output


def test_a_workload_spec_needs_a_batch_size_parameter(workload):
    result = invoke("max-batch", "--model", f"{workload}:one_batch", "--time-limit", "30")
    assert result.exit_code == 2 and "takes no batch_size parameter" in result.output
    result = invoke("max-batch", "--model", f"{workload}:one_batch", "--gpu", "v100", "--time-limit", "30")
    assert result.exit_code == 2 and "takes no batch_size parameter" in result.output
    result = invoke("max-batch", "--model", f"{workload}:build", "--gpu", "k80", "--time-limit", "30")
    assert result.exit_code == 2 and "unknown GPU 'k80'; known: titanx, p40" in result.output


def test_with_a_gpu_a_workload_is_estimated_at_every_batch_not_measured(workload):
    """`--model file.py:build --gpu`: each batch the search reaches is captured and estimated for the GPU, exactly
    (the profile at a batch is the estimate at that batch, not a line through others); nothing is measured."""
    from executor.measure.batch_profiles import EstimatedWorkloadProfiles
    from executor.measure.estimate import estimate_workload

    result = invoke("max-batch", "--model", f"{workload}:build", "--gpu", "v100", "--budget", "3MiB",
                    "--strategy", "keep-all", "--max-overhead", "none", "--time-limit", "120", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert "estimated for Tesla V100" in report["profiles"] and "scaling" not in report
    largest = report["strategies"][0]["max_batch_size"]
    assert largest is not None and largest > 1
    profiles = EstimatedWorkloadProfiles(f"{workload}:build", "v100")
    assert keep_all_peak_bytes(profiles(largest)) <= 3 * MIB < keep_all_peak_bytes(profiles(largest + 1))
    assert profiles(largest).provenance.source == "estimated"
    assert profiles(largest).provenance.input_signature == f"float32[{largest},3,16,16]"
    again = estimate_workload(f"{workload}:build", "v100", batch_size=largest)
    assert again.model_dump() == profiles(largest).model_dump()


def test_measured_profiles_are_scaled_exactly_in_size_and_the_search_runs_on_them(workload):
    profiles = MeasuredProfiles(f"{workload}:build", measure_batches=(4, 8), validate_batch=16, repeats=1, threads=1)
    report = profiles.report
    assert report.measured_batches == [4, 8, 16]
    # tensors scale exactly; a measured workspace (what the kernels really allocate) is linear in the batch only
    # up to their own scratch buffers: im2col-chunked's differs by 16 KiB at batch 16
    assert report.size_error_bytes <= 64 * 1024 and report.size_underestimate_bytes == 0 and report.peak_error == 0
    scaled = profiles(40)
    assert "scaled from batches 16" in scaled.name or "scaled from batches 8 and 16" in scaled.name
    assert scaled.provenance.source == "estimated" and scaled.provenance.input_signature == "float32[40,3,16,16]"
    assert scaled.provenance.model_structure_sha256 is None  # an estimate: the replay needs a measured profile
    assert profiles(4).provenance.model_structure_sha256 != profiles(8).provenance.model_structure_sha256
    four, eight = profiles(4), profiles(8)
    assert [n.size_bytes for n in scaled.nodes] == [
        a.size_bytes + (b.size_bytes - a.size_bytes) * 9 for a, b in zip(four.nodes, eight.nodes)
    ]  # 40 = 4 + 9 * (8 - 4): exactly linear
    result = max_batch(profiles, 2 * MIB, strategies=["keep-all", "checkpoint-all"], max_overhead=None,
                       time_limit_s=30, batch_limit=256)
    keep_all = result.strategies[0].max_batch_size
    assert keep_all is not None and keep_all_peak_bytes(profiles(keep_all)) <= 2 * MIB
    assert profiles.below_measuring_floor(keep_all, 2 * MIB) is None
    # the next batch's plan breaks the budget, or measuring it (what optimize() does first) would
    assert (keep_all_peak_bytes(profiles(keep_all + 1)) > 2 * MIB
            or profiles.below_measuring_floor(keep_all + 1, 2 * MIB) is not None)


def test_a_graph_that_changes_with_the_batch_cannot_be_scaled(workload):
    with pytest.raises(BatchProfileError, match="does not run the same operations at every batch"):
        MeasuredProfiles(f"{workload}:branchy", measure_batches=(2, 8), validate_batch=None, repeats=1, threads=1)


def test_the_cli_measures_a_workload(workload):
    result = invoke("max-batch", "--model", f"{workload}:build", "--budget", "2MiB", "--measure-batches", "4,8",
                    "--validate-batch", "0", "--repeats", "1", "--threads", "1", "--strategy", "keep-all",
                    "--time-limit", "60", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["scaling"]["measured_batches"] == [4, 8] and report["scaling"]["validate_batch"] is None
    assert report["strategies"][0]["max_batch_size"] > 8


@pytest.mark.parametrize("budget_bytes, validated", [(14_000_000, True), (10_000_000, False)])
def test_measuring_a_workload_holds_the_budget(workload, budget_bytes, validated):
    """The user asking for the largest batch is the one whose model does not fit: every measurement stays within
    the budget (measured under keep-all at batch 16, this workload held 17.1 MB of a 10 MB budget, and a
    BERT-sized one 135 MB of 40 MiB), the validation batch under a frugal schedule where one fits, else left out
    with the reason."""
    from executor.measure.allocations import AllocationTrace

    torch.set_num_threads(1)
    with AllocationTrace() as trace:
        profiles = MeasuredProfiles(f"{workload}:deep", measure_batches=(4, 8), validate_batch=16, repeats=1,
                                    threads=1, budget_bytes=budget_bytes)
    assert 0 < trace.peak_bytes <= budget_bytes
    if validated:
        assert profiles.report.validate_batch == 16 and 16 in profiles.measured and not profiles.report.notes
    else:
        assert profiles.report.validate_batch is None and 16 not in profiles.measured
        assert "batch 16 was not measured to check the scaling: no measuring pass fits" in profiles.describe()


def test_the_largest_measured_batch_can_be_measured_in_the_budget_as_optimize_does_first(workload):
    """max-batch named batch 478 at 8 MiB for an MLP, and `mosos profile --batch 478 --budget 8MiB` refused it (no
    measuring pass fits: 8.30 MiB): the plan fitted, the measuring that optimize() and profile do first did not.
    A batch now counts only where a measuring pass fits too, on the measurements' upper estimates scaled."""
    from executor.measure.profiler import profile_model
    from models.workload import load_workload

    torch.set_num_threads(1)
    budget = 8 * MIB
    profiles = MeasuredProfiles(f"{workload}:mlp", measure_batches=(2, 4), validate_batch=None, repeats=1, threads=1,
                                budget_bytes=budget)
    result = max_batch(profiles, budget, strategies=["recompute-only"], max_overhead=None, time_limit_s=60,
                       workers=1, throughput_probes=0)
    answer = result.strategies[0]
    largest = answer.max_batch_size
    assert largest is not None and answer.complete, answer
    assert result.floor_batch_size == largest and answer.first_failing_batch_size == largest + 1
    assert f"no quick measuring pass does at batch {largest + 1}" in result.floor_reason, result.floor_reason

    def measured(batch):
        built = load_workload(f"{workload}:mlp", batch_size=batch)
        return profile_model(built.model, built.inputs, built.loss_fn, built.targets, repeats=1, warmup=0,
                             budget_bytes=budget)

    assert measured(largest).name  # the answer is one optimize() can start from
    assert plan(profiles(largest + 1), budget, strategy="recompute-only").summary.peak_memory_bytes <= budget
    with pytest.raises(BudgetError, match="no measuring pass fits"):  # one more: a plan fits, measuring does not
        measured(largest + 1)


def test_a_measured_batch_that_does_not_fit_the_budget_says_what_to_do(workload):
    result = invoke("max-batch", "--model", f"{workload}:deep", "--budget", "8000000", "--repeats", "1",
                    "--threads", "1", "--strategy", "recompute-only", "--time-limit", "60")
    assert result.exit_code != 0
    message = " ".join(result.output.split())
    assert "at batch 8 within the budget 7.63 MiB" in message and "--measure-batches" in message, message


def test_the_time_limit_stops_the_making_of_the_profiles_too(workload):
    """Measuring a workload at its batches takes no deadline of its own: at the limit the command stops there (exit
    4, saying what it was doing), where it once measured on and only then said that no time was left."""
    import time

    started = time.monotonic()
    result = invoke("max-batch", "--model", f"{workload}:build", "--repeats", "1000", "--time-limit", "1.5")
    assert result.exit_code == 4, result.output
    assert "--time-limit 1.5 s ran out" in result.output and "stopped while" in result.output
    assert time.monotonic() - started < 5

"""benchmarks/executor_acceptance.py: the GPU acceptance run, exercised on the CPU so it works the day a GPU is lent."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("models")

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "executor_acceptance.py"
_spec = importlib.util.spec_from_file_location("executor_acceptance_bench", _SCRIPT)
acceptance = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = acceptance  # its dataclasses look their module up
_spec.loader.exec_module(acceptance)


def test_a_cpu_run_plans_replays_and_compares_with_plain_pytorch():
    # the transformer: measured workspace (native CPU convolutions allocate up to 8x their output) puts small VGGs'
    # smallest plan near 0.9 of keep-all
    report = acceptance.run("transformer", 8, small=True, device="cpu", ratios=(0.9, 0.6, 0.1), time_limit_s=10,
                            steps=1, warmup=0, profile_repeats=1, say=lambda line: None)
    assert report.profile_nodes > 50 and report.keep_all_peak_bytes > 0 and report.plain_step_ms > 0
    fitted, refused = report.rows[:2], report.rows[2]
    for row in fitted:
        assert row.feasible, row.note
        assert row.budget_bytes <= round(row.ratio * report.keep_all_peak_bytes) + 1
        # On the CPU the measured peak is the executor's ledger: exactly the simulator's, and within the budget.
        assert row.measured_peak_bytes == row.predicted_peak_bytes <= row.budget_bytes
        assert row.gradient_error < 1e-4 and row.loss_error < 1e-6
        assert row.measured_step_ms > 0 and row.simulated_step_ms > 0 and row.time_ratio > 0
    assert not refused.feasible and "below what any plan needs" in refused.note
    text = acceptance.section(report, "python3 benchmarks/executor_acceptance.py --small", 64 * 2**20)
    assert text.startswith("## transformer (small), batch 8, CPU")
    assert text.count("| yes |") == 2 and "no plan: budget" in text


def test_a_users_workload_runs_through_the_acceptance_too(tmp_path):
    """`--model path/to/file.py:build` (how BERT joins the GPU acceptance: benchmarks/workloads.py:bert_small)."""
    workload = tmp_path / "tiny.py"
    workload.write_text(
        "import torch\n"
        "def build(batch_size=64):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),\n"
        "                                torch.nn.Tanh(), torch.nn.Linear(64, 3))\n"
        "    return {'model': model, 'inputs': (), 'kwargs': {'input': torch.randn(batch_size, 16)},\n"
        "            'targets': torch.randint(0, 3, (batch_size,)), 'loss_fn': torch.nn.functional.cross_entropy}\n"
    )
    report = acceptance.run(f"{workload}:build", 64, device="cpu", ratios=(1.0,), time_limit_s=5, steps=1, warmup=0,
                            profile_repeats=1, say=lambda line: None)
    assert report.model == "build" and report.batch == 64 and report.rows[0].feasible
    assert report.rows[0].gradient_error == 0 and report.rows[0].loss_error == 0


def test_copy_overlap_counts_copies_on_side_streams_that_run_under_compute_kernels(tmp_path):
    # Compute stream 7 runs kernels over [0, 100) and [150, 200) us; stream 13 copies over [50, 170) (DtoH):
    # 50 us under the first kernel, 20 under the second, 50 in the gap. A copy on the compute stream does not count.
    events = [
        {"ph": "X", "cat": "kernel", "name": "conv", "ts": 0, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "relu", "ts": 150, "dur": 50, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "tiny", "ts": 0, "dur": 10, "args": {"stream": 13}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 50, "dur": 120,
         "args": {"stream": 13}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 300, "dur": 10,
         "args": {"stream": 14}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 0, "dur": 40, "args": {"stream": 7}},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    overlap = acceptance.copy_overlap(path)
    assert overlap["compute_stream"] == 7
    assert overlap["copy_streams"] == ["13", "14"]
    assert overlap["copies"] == 2 and overlap["copies_on_compute_stream"] == 1
    assert overlap["d2h_copies"] == 1 and overlap["h2d_copies"] == 1
    assert overlap["copy_ms"] == pytest.approx(0.130)
    assert overlap["overlapped_ms"] == pytest.approx(0.070)


def test_without_cuda_the_script_refuses_a_cuda_device(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert acceptance.main(["--device", "cuda", "--no-write"]) == 2
    assert "no CUDA device" in capsys.readouterr().err

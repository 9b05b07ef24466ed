"""The executor's benchmark scripts run (on a tiny workload), so that their figures can be made again."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

WORKLOAD = (
    "import torch\n"
    "def build(batch_size=256):\n"
    "    torch.manual_seed(0)\n"
    "    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),\n"
    "                                torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))\n"
    "    return model, torch.randn(batch_size, 32), torch.randint(0, 4, (batch_size,)), torch.nn.functional.cross_entropy\n"
)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_replay_speed_times_plain_and_planned_steps_side_by_side(tmp_path):
    replay_speed = _load("replay_speed")
    (tmp_path / "tiny.py").write_text(WORKLOAD)
    result = replay_speed.measure(f"{tmp_path / 'tiny.py'}:build", rounds=3, warmup=1, ratio=0.6, time_limit_s=2,
                                  say=lambda line: None)
    assert set(result["medians"]) >= {"plain", "keep-all", "keep-all + ledger"} and len(result["medians"]) == 4
    assert all(value > 0 for value in result["medians"].values()) and result["computes"] == result["nodes"]
    text = replay_speed.section([result], "python benchmarks/replay_speed.py", "0 0 0", 1)
    out = tmp_path / "executor.md"
    out.write_text("# The executor\n\n## other\n\nkept\n")
    replay_speed.write_section(out, text)
    replay_speed.write_section(out, text)  # replaced, not appended twice
    written = out.read_text()
    assert written.count(replay_speed.HEADING) == 1 and "kept" in written and "| tiny | " not in written
    assert "| build |" in written


def test_capture_scale_counts_planning_nodes_in_a_fresh_process(tmp_path):
    capture_scale = _load("capture_scale")
    (tmp_path / "tiny.py").write_text(WORKLOAD)
    result = capture_scale.run_child(f"{tmp_path / 'tiny.py'}:build")
    assert result["planning_nodes"] > 8 and result["operations"] >= result["planning_nodes"]
    assert result["seconds"] > 0 and result["rss_rise_bytes"] > 0


def test_step_breakdown_sorts_each_configurations_kernel_time_by_kind():
    import torch

    step_breakdown = _load("step_breakdown")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3))
    work = {"model": model, "inputs": (torch.randn(8, 3, 8, 8),), "targets": torch.randint(0, 3, (8,)),
            "loss_fn": torch.nn.functional.cross_entropy}
    result = step_breakdown.run(work, rounds=1, threads=1, say=lambda line: None)
    configurations = result["configurations"]
    assert list(configurations) == ["eager", "eager, second copy", "torch.compile", "mosos compiled, keep-all"]
    eager = configurations["eager"]["kinds_ms"]
    for kind in ("convolution forward", "convolution backward", "batch norm", "pooling"):
        assert eager[kind] > 0, kind
    # the only convolution reads the input: its whole backward is the first layer's filter gradient
    assert eager[step_breakdown.FIRST_FILTER_GRADIENT] == pytest.approx(eager["convolution backward"])
    assert configurations["torch.compile"]["kinds_ms"]["compiled code"] > 0
    assert all(c["step_ms"] > 0 and c["ratio_to_eager"] > 0 for c in configurations.values())
    rows = step_breakdown.table(result)
    assert rows[0] == "| per step | eager | eager, second copy | torch.compile | mosos compiled, keep-all |"
    assert len(rows) == 2 + 2 + len(step_breakdown.ROWS) + 2


def test_batch_split_sum_benchmark_compares_the_stems_filter_gradient_both_ways():
    batch_split_sum = _load("batch_split_sum")
    result = batch_split_sum.run(batch=64, rounds=1, threads=1)
    rows = {row["algorithm"]: row for row in result["rows"]}
    assert list(rows) == ["native", "batch-split-sum"]
    assert rows["native"]["from_native"] == 0
    # a quarter of the batch at a time: less scratch than the whole batch's reorder
    assert 0 <= rows["batch-split-sum"]["scratch_mib"] < rows["native"]["scratch_mib"]
    assert all(row["from_float64"] < 1e-4 and row["time_ms"] > 0 for row in rows.values())
    assert rows["batch-split-sum"]["from_native"] < 1e-4
    assert len(batch_split_sum.table(result)) == 2 + 2

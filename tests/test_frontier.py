"""The frontier benchmark's bookkeeping, which runs with no model: rows measured on a borrowed GPU come back as a
JSON-lines log, and merging them must replace only their own configurations' rows, keep the rest in place, and say
in each section which command measured which rows; `--jobs` children take turns on the device and the CPU."""

import json

import pytest

from benchmarks import frontier


def _row(config: str, ratio: float, precision: str = "fp32") -> dict:
    return {"model": "gpt2", "config": config, "family": frontier.family(config), "device": "cuda",
            "precision": precision, "time_ratio": ratio, "peak_mib": 100.0 / ratio, "eager_ms": 10.0,
            "config_ms": 10.0 * ratio, "device_name": "NVIDIA H200", "prepare_s": 1.0, "note": ""}


def test_merged_rows_replace_their_own_configurations_and_name_their_command(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    earlier = [_row("eager", 1.0), _row("mosos-0.7", 1.2), _row("compile", 0.9)]  # mosos-0.7: not a default ratio
    (results / "frontier_gpu_gpt2_fp32.json").write_text(json.dumps(earlier))
    (results / "frontier_gpu.md").write_text("# intro\n\n## gpt2, fp32\n\n`python benchmarks/frontier.py --old` "
                                            "(2026-11-26)\n\n| configuration |\n")
    log = tmp_path / "rows.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in [_row("compile", 0.8), _row("mosos-0.5", 1.1),
                                                       _row("compile", 0.5, "bf16")]) + "\n")
    assert frontier.main(["--device", "cuda", "--models", "gpt2", "--precisions", "fp32",
                          "--results-dir", str(results), "--merge-rows", str(log),
                          "--merge-command", "python benchmarks/frontier.py --new", "--merge-when", "today"]) == 0
    rows = json.loads((results / "frontier_gpu_gpt2_fp32.json").read_text())
    assert [r["config"] for r in rows] == ["eager", "mosos-0.7", "compile", "mosos-0.5"]
    assert rows[2]["time_ratio"] == 0.8 and rows[2]["command"] == "python benchmarks/frontier.py --new"
    assert "command" not in rows[0]
    text = (results / "frontier_gpu.md").read_text()
    assert "Earlier rows: `python benchmarks/frontier.py --old`" in text
    assert "`python benchmarks/frontier.py --new` (today; NVIDIA H200) measured compile, mosos-0.5." in text


def test_merging_needs_the_command_that_measured_the_rows_and_rows_it_can_read(tmp_path):
    log = tmp_path / "rows.jsonl"
    log.write_text('{"model": "gpt2", "config": "compile"}\nnot json\n')
    with pytest.raises(SystemExit, match="needs --merge-command"):
        frontier.main(["--device", "cuda", "--models", "gpt2", "--results-dir", str(tmp_path),
                       "--merge-rows", str(log)])
    with pytest.raises(SystemExit, match="--merge-rows .*missing.jsonl: No such file"):
        frontier.main(["--device", "cuda", "--models", "gpt2", "--results-dir", str(tmp_path),
                       "--merge-rows", str(tmp_path / "missing.jsonl"), "--merge-command", "x"])
    with pytest.raises(SystemExit, match="rows.jsonl:2: not a frontier row"):
        frontier.main(["--device", "cuda", "--models", "gpt2", "--results-dir", str(tmp_path),
                       "--merge-rows", str(log), "--merge-command", "x"])


def test_a_gpu_turn_waits_for_torch_compile_compiling_elsewhere_and_compiles_share(tmp_path, monkeypatch):
    """With `--jobs`, a configuration's timed rounds never run beside another's torch.compile compiling (its
    threads slowed a launch-bound step by a third), while compiles run beside each other."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    monkeypatch.setenv("FRONTIER_GPU_LOCK", str(tmp_path / "gpu.lock"))
    monkeypatch.setenv("FRONTIER_QUIET_LOCK", str(tmp_path / "quiet.lock"))
    holder = ("import sys, time\nfrom benchmarks import frontier\nwith frontier.compiling():\n"
              "    print('holding', flush=True)\n    time.sleep(1.5)\n    print(time.time(), flush=True)\n")
    repo = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-c", holder], cwd=repo, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(repo)))
    assert child.stdout.readline().strip() == "holding"
    began = time.time()
    with frontier.compiling():  # a second compile does not wait
        assert time.time() - began < 1.0
    with frontier.gpu_turn():
        entered = time.time()
    released = float(child.stdout.readline())
    child.wait(timeout=30)
    assert entered >= released, (entered, released)


def test_merging_leaves_the_files_of_models_and_precisions_the_log_has_no_rows_for(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    untouched = json.dumps([_row("eager", 1.0, "bf16")])
    (results / "frontier_gpu_gpt2_bf16.json").write_text(untouched)
    log = tmp_path / "rows.jsonl"
    log.write_text(json.dumps(_row("compile", 0.8)) + "\n")
    assert frontier.main(["--device", "cuda", "--models", "gpt2", "--precisions", "fp32,bf16",
                          "--results-dir", str(results), "--merge-rows", str(log), "--merge-command", "x"]) == 0
    assert (results / "frontier_gpu_gpt2_bf16.json").read_text() == untouched
    assert "## gpt2, bf16" not in (results / "frontier_gpu.md").read_text()
    assert [r["config"] for r in json.loads((results / "frontier_gpu_gpt2_fp32.json").read_text())] == ["compile"]

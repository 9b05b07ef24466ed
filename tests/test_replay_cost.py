"""What the replay costs in Python per planning node, counted (not timed): a planned keep-all step of many tiny
elementwise layers paid 23 Python calls a node (the ledger's entries, the model's fingerprint through
named_modules, nn.Module.__getattr__ for every parameter, the backward's gradient edges found anew); eager pays
none. The ledger now checks the first step of each program and pattern of gradients held, and the steps after it
run without its calls. Timing is benchmarks/replay_speed.py's; this test guards the count."""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import executor  # noqa: E402
from executor.engine import accountant  # noqa: E402


def _workloads():
    """benchmarks/workloads.py, whose `tiny_layers` the replay-speed benchmark times."""
    spec = importlib.util.spec_from_file_location("mosos_benchmark_workloads",
                                                  Path(__file__).resolve().parents[1] / "benchmarks" / "workloads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _planned(layers: int):
    work = _workloads().tiny_layers(batch_size=4, layers=layers, width=16)
    model, (x,), t = work["model"], work["inputs"], work["targets"]
    plain = copy.deepcopy(model)
    planned = executor.optimize(model, (x,), work["loss_fn"], targets=t, strategy="keep-all", budget=None,
                                progress=False, timed_steps=0, cache=False)
    return planned, plain, x, t


def _python_calls(step) -> Counter:
    counts: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            counts[(frame.f_code.co_filename, frame.f_code.co_name)] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counts


def _step(planned, x, t):
    planned.zero_grad(set_to_none=True)
    planned(x, t).backward()


def test_a_checked_step_costs_few_python_calls_a_node():
    calls, nodes = {}, {}
    for layers in (40, 80):
        planned, _, x, t = _planned(layers)
        for _ in range(2):  # the first step checks the ledger; the second runs the checked program
            _step(planned, x, t)
        planned.zero_grad(set_to_none=True)  # the training loop's own work, not the replay's
        calls[layers] = sum(_python_calls(lambda: planned(x, t).backward()).values())
        nodes[layers] = len(planned.profile.nodes)
    per_node = (calls[80] - calls[40]) / (nodes[80] - nodes[40])
    # 5 planning nodes, 2 parameters and one module a layer: the fingerprint's walk (one call a module for its
    # attributes, one for its hooks, one to walk it) and each parameter's gradient are what is left (1.8 a node,
    # was 2.4 before the fingerprint's per-module tests went to C); the ledger alone took 12
    assert per_node <= 2.0, (per_node, calls, nodes)


def test_the_ledger_checks_the_first_step_of_each_gradient_pattern_and_then_steps_aside(monkeypatch):
    planned, plain, x, t = _planned(6)
    entries = Counter()
    real_compute = accountant.Accountant.compute

    def counted(self, *args, **kwargs):
        entries["compute"] += 1
        return real_compute(self, *args, **kwargs)

    monkeypatch.setattr(accountant.Accountant, "compute", counted)
    peaks = []
    for step in range(4):
        if step < 2:
            planned.zero_grad(set_to_none=True)  # steps 0, 1: no gradient held when the step begins
        before = entries["compute"]
        loss = planned(x, t)
        loss.backward()
        peaks.append((entries["compute"] - before, planned.peak_memory_bytes))
        reference = nn.functional.mse_loss(plain(x), t)
        if step < 2:
            plain.zero_grad(set_to_none=True)
            reference = nn.functional.mse_loss(plain(x), t)
        reference.backward()
        assert torch.equal(loss, reference)
        for mine, theirs in zip(planned.parameters(), plain.parameters()):
            assert torch.equal(mine.grad, theirs.grad)
    checked, unchecked, accumulating, again = peaks
    assert checked[0] > 0 and unchecked[0] == 0  # step 1 repeats step 0's bytes: no ledger
    assert unchecked[1] == checked[1]  # its peak is the checked step's
    assert accumulating[0] > 0  # gradients held: additions into .grad, a new pattern, checked
    assert again[0] == 0 and again[1] == accumulating[1] >= checked[1]

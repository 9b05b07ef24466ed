"""What a planned step really holds on its device (the allocator's reserved segments, memory outside it) is read
around every step and reported against the budget; a re-plan runs beside training, never in a step."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import executor  # noqa: E402
from executor.measure import measured  # noqa: E402
from executor.engine.device_memory import HeldMemory  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.planning import plan  # noqa: E402


class FakeCachingAllocator:
    """A caching allocator as a GPU's behaves: it keeps every segment it ever reserved, and a segment is reused only
    by a request of exactly its size (the worst fragmentation: freed blocks of other sizes stay cached). It replays
    the step's own allocations and frees, read from the ledger, and adds a fixed context outside it."""

    def __init__(self, planned, context_bytes: int, fragmenting: bool = True):
        self.planned = planned
        self.context_bytes = context_bytes
        self.fragmenting = fragmenting  # False: an ideal allocator, which reserves no more than is allocated
        self.cached: dict[int, int] = {}  # size -> cached free blocks of that size
        self.reserved_bytes = 0

    def outside_allocator_bytes(self) -> int:
        return self.context_bytes

    def begin_step(self) -> None:
        pass

    def end_step(self) -> HeldMemory:
        ledger = self.planned.last_ledger
        live: dict[str, list[int]] = {}
        allocated = peak_allocated = 0
        peak_reserved = self.reserved_bytes
        for _, delta, _, label in sorted(ledger.events, key=lambda e: (e[0], e[2])):
            tensor = label.split(" ", 1)[1]
            if delta > 0:
                if self.cached.get(delta):
                    self.cached[delta] -= 1
                else:
                    self.reserved_bytes += delta
                live.setdefault(tensor, []).append(delta)
            elif delta < 0:
                size = live[tensor].pop(0)
                self.cached[size] = self.cached.get(size, 0) + 1
            allocated += delta
            peak_allocated = max(peak_allocated, allocated)
            peak_reserved = max(peak_reserved, self.reserved_bytes)
        fixed = ledger.fixed_bytes
        if not self.fragmenting:
            peak_reserved = peak_allocated
        return HeldMemory(fixed + peak_allocated, fixed + peak_reserved, self.context_bytes)


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 4))
    return model, torch.randn(2048, 64), torch.randint(0, 4, (2048,))


def _planned(memory_ratio: float, **options):
    model, x, y = _model_and_data()
    messages: list[str] = []
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=memory_ratio, cache=False,
                                time_limit_s=5, workers=1, progress=messages.append, **options)
    return planned, x, y, messages


def test_a_step_whose_reserved_memory_passes_the_budget_is_reported_not_silently_accepted():
    planned, x, y, messages = _planned(0.8, timed_steps=1, replan_when_off=False)
    assert planned.held_memory is None  # the CPU has no caching allocator to read: its ledger is what a step holds
    planned.device_memory = FakeCachingAllocator(planned, context_bytes=0)
    for _ in range(3):
        planned(x, y).backward()
    record = planned.report().held
    assert record.steps == 3
    budget = planned.schedule.budget_bytes
    assert record.worst.allocated_peak_bytes <= budget  # the plan's tensors fit ...
    assert record.worst.reserved_peak_bytes > budget  # ... but a caching allocator that cannot reuse holds more
    assert record.steps_over_budget >= 1
    text = planned.report().describe()
    assert "OVER THE BUDGET" in text and "allocator reserved" in text and "outside the allocator" in text
    assert sum("more than the budget" in m for m in messages) == 1  # said once, counted every step


def test_memory_outside_the_allocator_counts_against_the_budget():
    planned, x, y, _ = _planned(1.0, timed_steps=1, replan_when_off=False)
    budget = planned.schedule.budget_bytes
    fake = FakeCachingAllocator(planned, context_bytes=0, fragmenting=False)
    planned.device_memory = fake
    planned(x, y).backward()
    planned(x, y).backward()  # the second step reuses the first's segments
    record = planned.report().held
    assert record.steps_over_budget == 0
    within = record.worst.held_peak_bytes
    fake.context_bytes = budget - within + 1  # a library's workspace outside the allocator takes the rest and a byte
    planned(x, y).backward()
    record = planned.report().held
    assert record.steps == 3 and record.steps_over_budget == 1 and record.first_over_step == 3
    assert record.worst.outside_allocator_bytes == budget - within + 1


def test_a_replan_runs_beside_training_and_is_taken_at_a_step_boundary(monkeypatch):
    """The solver takes seconds: the steps go on under the current plan meanwhile, each as fast as before it
    started, and the new plan is taken at the first step boundary after it is ready."""
    monkeypatch.setattr(measured, "REPLAN_OFF", -1.0)  # every timed step is "off"
    model, x, y = _model_and_data()
    solver_s = 3.0
    started: list[float] = []

    planned_holder: list = []

    def slow_replan(profile, schedule, token):
        started.append(time.perf_counter())
        time.sleep(solver_s)  # a solver at work (CP-SAT releases the GIL as sleep does)
        return plan(profile, schedule.budget_bytes, strategy="recompute-only", time_limit_s=5, workers=1)

    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.8, cache=False,
                                time_limit_s=5, workers=1, progress=False, timed_steps=2)
    planned._replan = slow_replan
    planned_holder.append(planned)
    first_schedule = planned.schedule
    for _ in range(2):  # the timed steps; the re-plan starts at the end of the second
        planned(x, y).backward()
    assert started and planned.replanning
    step_s = []
    while planned.replanning and time.perf_counter() - started[0] < solver_s * 0.8:
        begun = time.perf_counter()
        planned(x, y).backward()
        step_s.append(time.perf_counter() - begun)
    assert len(step_s) >= 3 and max(step_s) < solver_s / 3  # no step waited for the solver
    assert planned.schedule is first_schedule  # the current plan holds meanwhile
    assert planned.wait_for_replan(30)
    assert planned.schedule is not first_schedule and not planned.replanning
    planned(x, y).backward()
    assert planned.report() is not None
    assert any(r.replanned for r in [planned.report(), *planned.report().history])


def test_a_replan_is_taken_onto_the_plan_it_was_made_for_when_another_input_signature_runs_meanwhile(monkeypatch):
    """Bucketed lengths: the re-plan of one signature's plan comes back while another signature's step is in use.
    It waits with its own plan and is taken when that signature comes back (CI once saw it taken onto the other
    signature's step, which refused it as a profile made for another model)."""
    import threading

    monkeypatch.setattr(measured, "REPLAN_OFF", -1.0)  # every timed step is "off"
    model, x, y = _model_and_data()
    release = threading.Event()
    replanned: list = []

    def gated_replan(profile, schedule, token):
        if "[1024," in profile.name:
            return None  # the second signature's own re-plan keeps its plan, at once
        release.wait(30)
        replanned.append(profile.name)
        return plan(profile, schedule.budget_bytes, strategy="recompute-only", time_limit_s=5, workers=1)

    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.8, cache=False,
                                time_limit_s=5, workers=1, progress=False, timed_steps=1, replan_when_off=True)
    planned._replan = gated_replan
    planned(x, y).backward()  # the timed step: the re-plan of the first signature's plan starts
    assert planned.replanning
    first_schedule = planned.schedule
    half_x, half_y = x[:1024], y[:1024]
    for _ in range(3):  # another signature: planned now, timed, its own re-plan kept at once
        planned(half_x, half_y).backward()
    second_schedule = planned.schedule
    assert "[1024," in second_schedule.profile_name and "[2048," in first_schedule.profile_name
    release.set()
    deadline = time.perf_counter() + 30
    while not replanned and time.perf_counter() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the first signature's re-plan has come back while the second's plan is in use
    for _ in range(2):
        planned(half_x, half_y).backward()  # not taken here: it is not this plan's
    assert planned.schedule is second_schedule
    for _ in range(2):
        planned(x, y).backward()  # back to the first: its re-plan is taken
    assert planned.schedule is not first_schedule and "[2048," in planned.schedule.profile_name
    reports = [planned.report(), *planned.report().history]
    assert any(r.replanned for r in reports)


def test_memory_outside_the_allocator_at_the_start_is_taken_from_a_budget_in_bytes():
    """A budget in bytes is what the device may hold: optimize() reads what the process holds outside PyTorch's
    allocator when it begins (a CUDA context here), plans the step within the rest, and checks every step's held
    memory against the whole budget."""
    model, x, y = _model_and_data()
    context_bytes = 3 * 2**20
    fake = FakeCachingAllocator(None, context_bytes=context_bytes, fragmenting=False)
    messages: list[str] = []
    probe = executor.optimize(*_model_and_data()[:1], (x,), F.cross_entropy, targets=y, memory_ratio=0.8,
                              cache=False, time_limit_s=5, workers=1, progress=False, timed_steps=0)
    budget = probe.schedule.budget_bytes + context_bytes
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=budget, cache=False,
                                time_limit_s=5, workers=1, progress=messages.append, timed_steps=0,
                                device_memory=fake)
    fake.planned = planned
    assert planned.schedule.budget_bytes == budget - context_bytes
    assert any("less the 3.00 MiB the device holds outside PyTorch's allocator" in m for m in messages), messages
    planned(x, y).backward()
    record = planned.held_memory
    assert record.budget_bytes == budget and record.steps_over_budget == 0
    assert record.worst.outside_allocator_bytes == context_bytes


def test_a_budget_the_memory_outside_the_allocator_already_takes_is_refused_before_anything_runs():
    model, x, y = _model_and_data()
    fake = FakeCachingAllocator(None, context_bytes=64 * 2**20)
    with pytest.raises(BudgetError, match="outside PyTorch's allocator"):
        executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=32 * 2**20, cache=False, time_limit_s=5,
                          workers=1, progress=False, device_memory=fake)


def test_a_step_over_the_device_budget_re_plans_within_less_beside_training():
    """The allocator held more than the budget: a re-plan within the plan's budget less the excess runs beside
    training and is taken at a step boundary; where steps stay over, it stops after HELD_REPLANS."""
    from executor.replay import replay

    model, x, y = _model_and_data()
    messages: list[str] = []
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.8, cache=False,
                                time_limit_s=5, workers=1, progress=messages.append, timed_steps=0)
    first_budget = planned.schedule.budget_bytes
    planned.device_memory = FakeCachingAllocator(planned, context_bytes=0)  # keeps every segment it reserved
    planned(x, y).backward()
    record = planned.held_memory
    assert record.steps_over_budget == 1 and planned.replanning
    excess = record.worst.held_peak_bytes - first_budget
    assert planned.wait_for_replan(60)
    assert planned.schedule.budget_bytes == first_budget - excess
    assert planned.schedule.summary.peak_memory_bytes <= first_budget - excess
    assert any("re-planning within" in m and "beside training" in m for m in messages)
    for _ in range(6):
        planned(x, y).backward()
        planned.wait_for_replan(60)
    assert sum("re-planning within" in m for m in messages) <= replay.HELD_REPLANS
    assert record.budget_bytes == first_budget  # the device's budget stays what it was
    text = record.describe()
    assert "re-planned within" in text


class _SolverThatDropsAnEarlyStop:
    """A solver whose first stop comes before its search began, as CP-SAT's can: only a later one ends the solve."""

    def __init__(self):
        self.stops = 0
        self.ended = threading.Event()

    def stop_search(self):
        self.stops += 1
        if self.stops > 1:
            self.ended.set()

    def solve(self):
        return self.ended.wait(5.0)


def test_a_stop_asked_before_the_solve_began_still_stops_it(still_heap):
    from planner.cpsat.callback import StopWatcher

    solver = _SolverThatDropsAnEarlyStop()
    began = time.monotonic()
    with StopWatcher(solver, lambda: True, period_s=0.01):
        stopped = solver.solve()
    assert stopped and time.monotonic() - began < 2.0, "the solve ran to its limit: the stop was asked only once"


_EXITS_DURING_A_REPLAN = """
import sys, time
from planner.planning import plan
from planner.profile import load_profile
from executor.replay.replay import STOPPING, BackgroundReplan

profile = load_profile("models/profiles/transformer-b64-h100.json")

def replan(profile, schedule, token):
    return plan(profile, memory_ratio=0.5, time_limit_s=120, should_stop=STOPPING.is_set,
                progress=lambda event: print("solution", event.get("objective"), file=sys.stderr, flush=True))

BackgroundReplan(replan, profile, None, None, None)
time.sleep(float(sys.argv[1]))
"""


@pytest.mark.parametrize("after_s", [0.0, 1.5])
def test_a_process_that_exits_while_a_replan_runs_stops_its_solver_and_exits_cleanly(tmp_path, after_s):
    """The re-plan's solver thread is stopped and joined at exit: a solver left running into the interpreter's
    finalization aborts the process (SIGABRT, 'terminate called without an active exception')."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exits.py"
    script.write_text(_EXITS_DURING_A_REPLAN)
    root = Path(__file__).resolve().parents[1]
    began = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(after_s)], cwd=root, capture_output=True, text=True,
                          timeout=100, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate" not in done.stderr
    assert time.monotonic() - began < 60, "exit waited for the whole time limit instead of stopping the solver"

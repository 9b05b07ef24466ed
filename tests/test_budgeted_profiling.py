"""The budget holds from the first allocation, in the process itself: every allocation of capture, profiling,
planning and the first planned step counted by the allocator's own events (executor.measure.allocations), and the
profile measured within a budget agrees with the keep-all one where keep-all fits."""

from __future__ import annotations

import copy
import re
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import executor  # noqa: E402
from executor.measure.allocations import AllocationTrace  # noqa: E402
from executor.measure.profiler import profile_step  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.planning import InfeasibleBudget, plan  # noqa: E402
from planner.schedule import Schedule  # noqa: E402
from planner.simulator import simulate  # noqa: E402
from planner.units import format_bytes  # noqa: E402
from planner.strategies.keep_all import keep_all_peak_bytes  # noqa: E402
from tests.budgets_named import plan_at_the_budgets_named  # noqa: E402
from tests.zoo import ZOO, assert_trains_like_plain  # noqa: E402


def _resident_bytes(model, args, kwargs, targets) -> int:
    """What the caller already holds when optimize() starts: parameters, buffers, inputs (distinct storages)."""
    seen = {}
    tensors = list(model.parameters()) + list(model.buffers()) + list(args) + list(kwargs.values()) + [targets]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def _zoo_provisional(name: str):
    """The provisional profile (sizes from the capture, workspaces from above) a zoo model is measured from."""
    from torch.utils._pytree import tree_flatten

    from executor.measure.profiler import plan_step, provisional_profile

    model, args, kwargs, targets, loss_fn = ZOO[name]()
    leaves = tree_flatten(((args, kwargs, targets), {}))[0]
    profiled = plan_step(model, args, kwargs, targets, loss_fn)
    return provisional_profile(profiled, leaves, torch.device("cpu"), "sgd", ("native",), None, None, name, None,
                               lambda message: None)


def _step(planned, args, kwargs, targets):
    loss = planned(*args, targets=targets, **kwargs)
    loss.backward()
    return loss


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_live_storage_stays_within_the_budget_from_capture_to_the_first_step(name):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, args, kwargs, targets, loss_fn = ZOO[name]()
    resident = _resident_bytes(model, args, kwargs, targets)
    error = None
    with AllocationTrace() as trace:
        try:
            planned = executor.optimize(model, args, loss_fn, targets=targets, kwargs=kwargs, memory_ratio=0.5,
                                        repeats=1, warmup=0, time_limit_s=5, workers=1, progress=False)
            _step(planned, args, kwargs, targets)
        except BudgetError as raised:
            error = raised
    if error is not None:
        # no plan at 0.5 of keep-all (convolutions' scratch): said before the step, naming what would work
        assert error.minimum_budget_bytes, str(error)
        assert trace.peak_bytes <= error.minimum_budget_bytes
        return
    budget = planned.schedule.budget_bytes
    assert trace.peak_bytes <= budget - resident, (
        f"{name}: live storage rose by {trace.peak_bytes} bytes over the {resident} already held, "
        f"budget {budget}: {trace.peak_bytes + resident - budget} bytes over")
    assert planned.peak_memory_bytes <= budget


def _node_times_ms(profile) -> list[float]:
    return [next(i for i in node.implementations if i.name in ("native", "default")).time_ms for node in profile.nodes]


def _paired_ratios(keep_all_ms: list[float], frugal_ms: list[float]) -> list[float]:
    """Each frugal pass's time against the mean of the keep-all passes taken just before and just after it
    (K F K F ... K)."""
    assert len(keep_all_ms) == len(frugal_ms) + 1
    return [frugal / ((keep_all_ms[i] + keep_all_ms[i + 1]) / 2) for i, frugal in enumerate(frugal_ms)]


def _profiles_measured_in_turn(rounds: int = 16) -> dict:
    """BERT-small: a keep-all and a frugal (at 0.5 of keep-all's peak) profile of five repeats each, whose plans are
    compared on the keep-all profile; then keep-all and frugal passes of one repeat each in turn, K F K F ... K, on
    the same capture, each pass's node times."""
    from models.workload import load_workload

    torch.set_num_threads(1)
    work = load_workload("benchmarks/workloads.py:bert_small")

    def measure(repeats: int, **options):
        return profile_step(work.model, work.inputs, work.loss_fn, work.targets, kwargs=work.kwargs,
                            repeats=repeats, warmup=1, **options)

    def frugal_pass(repeats: int):
        measured, _ = measure(repeats, budget_bytes=budget, measuring="frugal", profiled=profiled)
        measured_under = profiled.measuring  # the capture is shared: the next measurement replaces it
        assert measured_under.strategy != "keep-all"
        assert measured_under.measured_peak_bytes <= budget
        assert [n.size_bytes for n in measured.nodes] == [n.size_bytes for n in keep_all.nodes]
        return measured

    keep_all, profiled = measure(5)
    budget = int(keep_all_peak_bytes(keep_all) * 0.5)
    frugal = frugal_pass(5)
    # the plan made from the frugal profile, replayed on the keep-all one, against the keep-all profile's own plan;
    # the strategy's plans, not placed (a plan whose buffers do not place is planned again within less, which
    # compares the placements' luck, not the profiles)
    plan_budget = int(keep_all_peak_bytes(keep_all) * 0.6)
    from_keep_all = plan(keep_all, plan_budget, strategy="recompute-only", time_limit_s=20, workers=1,
                         addresses=False)
    from_frugal = plan(frugal, plan_budget, strategy="recompute-only", time_limit_s=20, workers=1, addresses=False)
    transplanted = Schedule.model_validate(from_frugal.model_dump() | {"profile_digest": keep_all.digest(),
                                                                        "profile_name": keep_all.name})
    replayed = simulate(keep_all, transplanted, plan_budget, keep_timeline=False)
    keep_all_ms, frugal_ms = [_node_times_ms(measure(1, profiled=profiled)[0])], []
    for _ in range(rounds):
        frugal_ms.append(_node_times_ms(frugal_pass(1)))
        keep_all_ms.append(_node_times_ms(measure(1, profiled=profiled)[0]))
    return {"keep_all_ms": keep_all_ms, "frugal_ms": frugal_ms, "transplanted_ms": replayed.step_time_ms,
            "keep_all_plan_ms": from_keep_all.summary.predicted_step_time_ms}


@pytest.mark.slow
def test_a_profile_measured_within_the_budget_agrees_with_the_keep_all_one():
    """Measured under a frugal schedule although keep-all would fit, the frugal passes against the keep-all passes
    taken in turn with them (K F K F ... K): each frugal pass against the mean of the keep-all passes on either side
    of it, the median of those ratios. On the 2-core CI machine whole passes drift by 15-30% within one process,
    even between neighbours (keep-all against its neighbours 0.82-1.20 in one run), so the median is taken over
    sixteen short passes (one repeat each, a few seconds a pair) rather than four long ones: four pairs of five
    repeats came out at 1.09, 1.23, 0.99 and 1.16 in one CI run (median 1.13) and 0.86-1.35 here (median 1.02).
    Each kind's lower envelope is no better (11% apart in a CI run whose paired ratios were 0.92-1.06).

    In a fresh process whose C allocator keeps what is freed, as a GPU's caching allocator does: glibc hands large
    freed blocks back to the kernel, and the keep-all pass, whose memory only grows, then pays a page fault per
    fresh page on every pass (about 1 ms per 4 MiB activation, 5-8% of BERT-small's total), which a smaller
    frugal pass mostly does not; that is the CPU allocator's cost, not a node's."""
    import json
    import os
    import statistics

    code = ("import json; from tests.test_budgeted_profiling import _profiles_measured_in_turn as f; "
            "print('RESULT ' + json.dumps(f()))")
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
    completed = _fresh("-c", code, env=env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(completed.stdout.split("RESULT ", 1)[1])
    passes = {kind: [sum(times) for times in result[kind]] for kind in ("keep_all_ms", "frugal_ms")}
    ratios = _paired_ratios(passes["keep_all_ms"], passes["frugal_ms"])
    ratio = statistics.median(ratios)
    assert abs(ratio - 1) <= 0.10, (ratio, [round(r, 3) for r in ratios],
                                    {kind: [round(ms, 1) for ms in totals] for kind, totals in passes.items()})
    assert result["transplanted_ms"] <= result["keep_all_plan_ms"] * 1.02, result


def test_a_budget_below_the_parameters_is_refused_before_anything_is_allocated():
    from models.workload import load_workload

    work = load_workload("benchmarks/workloads.py:bert_small")
    with AllocationTrace() as trace:
        with pytest.raises(BudgetError) as raised:
            executor.optimize(work.model, work.inputs, work.loss_fn, targets=work.targets, kwargs=work.kwargs,
                              budget="1MiB", progress=False)
    message = str(raised.value)
    assert "fixed memory" in message and "smallest budget" in message
    assert raised.value.minimum_budget_bytes > 1 << 20
    assert trace.peak_bytes < 1 << 20  # the capture runs on fake tensors: no activation was allocated


def test_a_budget_below_every_measuring_pass_names_the_smallest_that_works():
    from models.workload import load_workload

    work = load_workload("benchmarks/workloads.py:elementwise")  # 12 x tanh(x * s), 32 MiB activations
    with AllocationTrace() as trace:
        with pytest.raises(BudgetError) as raised:
            executor.optimize(work.model, work.inputs, work.loss_fn, budget="60MiB", progress=False)
    minimum = raised.value.minimum_budget_bytes
    assert minimum is not None and minimum > 60 << 20
    assert f"{minimum} bytes" in str(raised.value)
    assert trace.peak_bytes < 1 << 20
    # and that budget does work
    planned = executor.optimize(work.model, work.inputs, work.loss_fn, budget=minimum, repeats=1, warmup=0,
                                time_limit_s=5, workers=1, progress=False)
    assert planned.schedule.budget_bytes == minimum


def test_a_step_measured_once_is_planned_below_the_bound_that_refused_it():
    """transformers' ConvNeXt (small, from a config, batch 16): before anything runs, each native convolution's
    scratch is bounded from above. Its last stages' images are 2x2 and 4x4, probed on some of their groups, and the
    7x7 depthwise filter gradients there are bounded by oneDNN's blocked layout; that bound names the smallest
    budget. Planned once there (from 1 byte, each budget named), the step's profile is kept with its measured
    workspaces; asked again for less, mosos plans on that profile and names what a plan on it needs, below the
    bound, and the step trains within it by the allocator's events. Without the kept profile the same budget is
    refused."""
    pytest.importorskip("transformers")
    from benchmarks.workloads import convnext_small

    work = convnext_small()
    model, inputs, kwargs, targets, loss_fn = work["model"], (), work["kwargs"], None, work["loss_fn"]

    def optimize(budget, **options):
        return executor.optimize(model, inputs, loss_fn, targets=targets, kwargs=kwargs, budget=budget, repeats=1,
                                 warmup=0, time_limit_s=10, workers=1, progress=False, timed_steps=1, **options)

    _, bounded_bytes, _ = plan_at_the_budgets_named(optimize, tries=4)
    with pytest.raises(BudgetError) as measured:
        optimize(1)
    measured_bytes = measured.value.minimum_budget_bytes
    assert "profile an earlier run measured" in str(measured.value)
    # how far below depends on the CPU's kernels: on a Sapphire Rapids core oneDNN takes the blocked layout for the
    # 2x2 stage's filter gradient (6.2 MiB of scratch, the bound 6.4) and the kept profile names 0.97 of the bound;
    # the machine of the 2026-11-30 run planned at 5.81 MiB against 9.35
    assert measured_bytes < bounded_bytes, (measured_bytes, bounded_bytes)
    with pytest.raises(BudgetError):
        optimize(measured_bytes, cache=False)
    planned = optimize(measured_bytes)
    resident = _resident_bytes(model, inputs, kwargs, targets)
    with AllocationTrace() as trace:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            planned(**kwargs).backward()
    assert trace.peak_bytes <= measured_bytes - resident, (trace.peak_bytes, measured_bytes, resident)


@pytest.mark.parametrize("replanning", ["finds a plan", "finds none"])
def test_the_first_steps_are_timed_reported_and_re_planned_once_when_the_plan_is_off(replanning):
    """A profile whose times are ten times what the step takes: the report says so, names the nodes, the module
    re-plans once on what it measured, and every step stays plain PyTorch's, bit for bit. A re-plan that finds no
    plan (a solver's time limit on a loaded machine) fails no step: the current plan stays, and the report says
    why."""
    import copy

    from executor.replay.replay import PlannedModule

    torch.set_num_threads(1)
    model, args, kwargs, targets, loss_fn = ZOO["bert"]()
    plain = copy.deepcopy(model)
    profile, profiled = profile_step(model, args, loss_fn, targets, kwargs=kwargs, repeats=1, warmup=0)
    document = profile.model_dump(mode="json")
    for node in document["nodes"]:
        for implementation in node["implementations"]:
            implementation["time_ms"] *= 10
    from planner.profile import parse_profile

    slow = parse_profile(document, "ten times too slow")
    budget = int(keep_all_peak_bytes(slow) * 0.7)
    schedule = plan(slow, budget, strategy="recompute-only", time_limit_s=5, workers=1)
    asked: list = []

    def replan(measured, current, token):
        asked.append(measured)
        if replanning == "finds none":
            raise InfeasibleBudget("strategy 'mosos': no plan found in 2 s (UNKNOWN)")
        return plan(measured, budget, strategy="recompute-only", time_limit_s=5, workers=1)

    planned = PlannedModule(model, slow, schedule, loss_fn, profiled=profiled, timed_steps=2, replan=replan)
    optimizer, plain_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain))
    timing = []
    for step in range(6):
        for m, o in ((model, optimizer), (plain, plain_optimizer)):
            o.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        assert planned.wait_for_replan(60)  # the re-plan runs beside the steps: take it as soon as it is there
        timing.append(planned.timing)
        loss = planned(*args, targets=targets, **kwargs)
        loss.backward()
        torch.manual_seed(step)
        expected = loss_fn(plain(*args, **kwargs), targets)
        expected.backward()
        assert torch.equal(loss, expected), step
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
        if step == 0:
            assert planned.report() is None  # two timed steps first
        optimizer.step()
        plain_optimizer.step()
    assert len(asked) == 1  # re-planned once, not after the new plan's own timed steps
    # node by node: the first two steps, and the new plan's first two (what a benchmark waits out)
    assert timing == [True, True] + ([False] * 4 if replanning == "finds none" else [True, True, False, False])
    report = planned.report()
    if replanning == "finds none":
        assert report.off and not report.replanned and "UNKNOWN" in report.replan_failed
        assert planned.schedule is schedule and "the current one stays" in report.describe()
        return
    first = report.history[0]
    assert first.off and first.replanned and first.ratio < 0.5  # about 0.1; a loaded machine stretched 1/3 to 0.6
    assert first.nodes and abs(first.nodes[0].difference_ms) >= abs(first.nodes[-1].difference_ms)
    assert planned.profile is asked[0] and planned.schedule.profile_digest == asked[0].digest()
    assert report.steps_timed == 2 and not report.replanned
    assert report.measured_peak_bytes <= budget
    assert "re-planned" in report.describe() and "nodes that differ most" in report.describe()


# --- as a user runs it: the CLI and the example script, fresh processes ------------------------------------

def _fresh(*arguments: str, env=None):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, *arguments], cwd=root, capture_output=True, text=True, timeout=600,
                          env=env)


@pytest.mark.slow
def test_mosos_profile_within_a_budget_measures_frugally_and_refuses_a_budget_too_small(tmp_path):
    from planner.profile import load_profile

    out = tmp_path / "tanh.json"
    done = _fresh("-m", "cli", "profile", "benchmarks/workloads.py:elementwise", "--budget", "256MiB",
                  "--repeats", "1", "--warmup", "0", "--time-limit", "600", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "measured under greedy recompute" in done.stdout.replace("\n", " ")
    assert "no plain step was timed" in done.stdout.replace("\n", " ")
    profile = load_profile(out)
    assert "measured under greedy recompute" in profile.provenance.notes
    refused = _fresh("-m", "cli", "profile", "benchmarks/workloads.py:elementwise", "--budget", "60MiB",
                     "-o", str(tmp_path / "no.json"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "below what any plan needs" in refused.stderr and "smallest" not in refused.stdout
    assert not (tmp_path / "no.json").exists()


def test_mosos_profile_stops_at_its_time_limit_says_where_and_writes_nothing(tmp_path):
    """Profiling ResNet-18-small at batch 8 with 5000 timed runs per node takes minutes (seven timing passes of
    about 180 nodes); with --time-limit 10 the command ends soon after 10 s (its own start-up before the clock, a
    kernel running, the interpreter's exit)."""
    out = tmp_path / "resnet.json"
    started = time.monotonic()
    stopped = _fresh("-m", "cli", "profile", "--model", "resnet18", "--small", "--batch", "8", "--repeats", "5000",
                     "--time-limit", "10", "-o", str(out))
    took_s = time.monotonic() - started
    assert stopped.returncode == 4, stopped.stderr
    message = " ".join(stopped.stderr.split())
    assert "--time-limit 10 s ran out after 10" in message and "stopped while" in message, message
    assert "nothing was written" in message and "Traceback" not in stopped.stderr
    assert not out.exists()
    assert took_s < 10 + 8, took_s


def test_the_search_for_a_measuring_pass_keeps_to_a_deadline(still_heap):
    """At a budget no measuring pass fits, the searches take their whole time limits (the solver 20 s); with a
    deadline (mosos profile --time-limit) a second away, TimeLimitReached comes within it and says what was tried,
    never a BudgetError that a search cut short cannot back. It comes 0.01 s late here; CI once saw 1.02 s late an
    hour into the suite, so the bound allows a loaded machine 1.5 s and is still far below the searches' 20 s."""
    from executor.measure import measuring
    from planner.budget import minimum_budget_bytes
    from planner.errors import TimeLimitReached

    provisional = _zoo_provisional("gpt2")
    floor = minimum_budget_bytes(provisional)
    started = time.monotonic()
    with pytest.raises(TimeLimitReached, match="in the time left [(]tried keep-all, "):
        measuring.measuring_schedule(provisional, floor, deadline=started + 1)
    assert time.monotonic() - started < 1 + 1.5


@pytest.mark.slow
def test_the_training_example_keeps_the_whole_run_within_its_budget():
    done = _fresh("examples/train.py", "--model", "benchmarks/workloads.py:elementwise", "--budget", "250MiB",
                  "--steps", "2", "--time-limit", "5")
    assert done.returncode == 0, done.stderr
    assert "plain PyTorch not run" in done.stdout  # its step does not fit in what the budget leaves
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("peak of the whole run") and "of the budget 250.00 MiB" in last and "OVER" not in last


def test_a_bfloat16_model_is_measured_within_its_budget():
    """CPU kernels on bf16 tensors widen them to float32 while they work (oneDNN's matrix products): the measuring
    pass allows for it, so no pass holds more than the budget (the profiler warns when one does)."""
    import copy
    import warnings

    import torch.nn.functional as F

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.norm = torch.nn.Linear(64, 128), torch.nn.LayerNorm(128)
            self.b, self.head = torch.nn.Linear(128, 128), torch.nn.Linear(128, 10)

        def forward(self, x):
            h = F.gelu(self.norm(self.a(x)))
            h = torch.softmax(self.b(h), -1) @ self.b.weight
            return self.head(h @ self.b.weight.t() + self.b(h))

    torch.manual_seed(0)
    model = Shared().to(torch.bfloat16)
    plain = copy.deepcopy(model)
    x, y = torch.randn(2048, 64, dtype=torch.bfloat16), torch.randint(0, 10, (2048,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        # 0.85: each half-precision product is allowed its threads' packing buffers too
        planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.85, time_limit_s=2,
                                    workers=1, cache=False, progress=False)
    assert planned.profiled_peak_bytes <= planned.schedule.budget_bytes
    _step(planned, (x,), {}, y)
    F.cross_entropy(plain(x), y).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    assert planned.peak_memory_bytes <= planned.schedule.budget_bytes


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_a_budget_below_every_measuring_pass_is_told_the_smallest_the_greedy_pass_fits(name):
    """The strategies' own figures named budgets 1.2-1.7x the floor on the zoo's transformers, where the greedy
    pass fits from 1.05-1.25x: the error names a budget within 1% of where the greedy pass first fits (a scan in
    1% steps here; it fits at some budgets and not at some above them), and asking for it measures."""
    from executor.measure import measuring
    from planner.budget import minimum_budget_bytes

    provisional = _zoo_provisional(name)
    floor = minimum_budget_bytes(provisional)
    with pytest.raises(BudgetError) as raised:
        measuring.measuring_schedule(provisional, floor)  # the profiler's time limit: its search has 5 s
    named = raised.value.minimum_budget_bytes
    scanned = next(budget for budget in (int(floor * (1 + k / 100)) for k in range(200))
                   if measuring._greedy(provisional, budget, time.monotonic() + 1) is not None)
    assert floor < named <= scanned * 1.01, (floor, named, scanned)
    chosen = measuring.measuring_schedule(provisional, named, time_limit_s=4)
    assert chosen.peak_bytes <= named


def test_the_budget_a_refused_measuring_pass_names_measures():
    """The zoo's BERT at its floor: the solver's memory-minimizing search named 1.116 MiB, which its own
    time-limited solve and the greedy pass then missed, so asking for it was refused again. A named budget is now
    one a measuring pass was seen to fit, and so is the one named for a budget below the floor (before, that error
    named the floor, at which no pass fit, and the next named more)."""
    from planner.budget import minimum_budget_bytes

    model, args, kwargs, targets, loss_fn = ZOO["bert"]()
    with pytest.raises(BudgetError) as raised:
        profile_step(model, args, loss_fn, targets, kwargs=kwargs, budget_bytes=1, repeats=1, warmup=0)
    named = raised.value.minimum_budget_bytes
    message = str(raised.value)
    floor = int(re.search(r"any plan needs at least [\d.]+ [KMG]?i?B \((\d+) bytes\)", message).group(1))
    assert named > floor and f"the smallest budget known to work is {format_bytes(named)} ({named} bytes)" in message
    # the budget to ask for first, the floor after it as a bound (a reader took the floor, and was refused again)
    assert message.index("known to work") < message.index("any plan needs at least")
    assert "but no measuring pass fits there" in message
    with AllocationTrace() as trace:
        profile, profiled = profile_step(model, args, loss_fn, targets, kwargs=kwargs, budget_bytes=named, repeats=1,
                                         warmup=0)
    assert profiled.measuring.peak_bytes <= named and minimum_budget_bytes(profile) <= named
    assert trace.peak_bytes + _resident_bytes(model, args, kwargs, targets) <= named


def test_a_budget_the_step_was_measured_within_is_planned_when_the_planner_finds_no_plan(monkeypatch):
    """BERT of the frontier at 108 MiB was measured under the greedy pass, then the solver's model (its compute
    order fixed) proved none of its plans fits and named 140 MiB: the schedule the step was measured under is a
    plan within the budget, and the answer. Here the planner finds nothing at all."""
    import executor.replay.optimize as plugin

    def finds_nothing(profile, budget_bytes, **options):
        raise InfeasibleBudget("no plan in the time limit (a stand-in planner)", minimum_budget_bytes=10 * budget_bytes)

    monkeypatch.setattr(plugin, "plan", finds_nothing)
    torch.manual_seed(0)
    model, args, kwargs, targets, loss_fn = ZOO["gpt2"]()
    plain = copy.deepcopy(model)
    resident = _resident_bytes(model, args, kwargs, targets)
    said = []
    with AllocationTrace() as trace:
        planned = executor.optimize(model, args, loss_fn, targets=targets, kwargs=kwargs, memory_ratio=0.6,
                                    repeats=1, warmup=0, progress=said.append, cache=False)
        torch.manual_seed(1)
        loss = _step(planned, args, kwargs, targets)
    summary, budget = planned.schedule.summary, planned.schedule.budget_bytes
    assert summary.strategy.startswith("measuring pass (") and "keep-all" not in summary.strategy
    assert summary.peak_memory_bytes <= budget and trace.peak_bytes <= budget - resident
    assert any("the schedule the step was measured under" in message for message in said)
    assert_trains_like_plain(model, plain, loss, args, kwargs, targets, loss_fn, seed=1)
    # a budget the measuring pass does not fit on the measured figures gets no such plan: the error stands
    assert planned._prepared.profiled.measuring.as_plan(planned.profile, budget // 2) is None


# oneDNN pads a convolution's channels to its ISA's block: 16 on AVX-512, 8 on AVX2. The stem's filter gradient (4
# output channels) copies its output's gradient padded so: 32 MiB at batch 2048 on AVX-512, 16 MiB on AVX2, where the
# stem neither sets the floor nor leaves native no room at the smallest workspaces.
_STEM_SCRATCH_PADDED_TO_16 = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="the stem's native scratch is half as large where oneDNN blocks channels by 8 (AVX2)")


@_STEM_SCRATCH_PADDED_TO_16
def test_a_convolution_measured_on_its_smallest_workspace_where_natives_scratch_leaves_no_room():
    """ResNet-18-small with the batch-split algorithms offered (as `compile=True` offers them): below the budget
    the stem's native scratch needs, the greedy pass on every node's fastest implementation finds nothing, and the
    measuring pass runs on the smallest workspaces instead (native back wherever it fits). The budget holds."""
    from torch.utils._pytree import tree_flatten

    from benchmarks.workloads import resnet18_small
    from executor.measure import measuring
    from executor.measure.profiler import plan_step, provisional_profile
    from planner.cpsat.greedy import greedy_recompute_schedule

    torch.set_num_threads(2)
    work = resnet18_small(batch_size=256)
    algorithms = ("native", "batch-split", "batch-split-sum")
    args, kwargs = tuple(work.inputs), dict(work.kwargs or {})
    leaves = tree_flatten(((args, kwargs, work.targets), {}))[0]
    profiled = plan_step(work.model, args, kwargs, work.targets, work.loss_fn)
    provisional = provisional_profile(profiled, leaves, torch.device("cpu"), "sgd", algorithms, None, None)
    scan = [int(provisional.fixed_bytes + (keep_all_peak_bytes(provisional) - provisional.fixed_bytes) * k / 100)
            for k in range(40, 101)]
    fastest = next(b for b in scan if greedy_recompute_schedule(provisional, b) is not None)
    smallest = next(b for b in scan
                    if greedy_recompute_schedule(provisional, b, implementation="smallest-workspace") is not None)
    assert smallest < fastest, (smallest, fastest)
    chosen = measuring.measuring_schedule(provisional, smallest, time_limit_s=4)
    assert chosen.peak_bytes <= smallest
    with AllocationTrace() as trace:
        profile, profiled = profile_step(work.model, args, work.loss_fn, work.targets, kwargs=kwargs,
                                         budget_bytes=smallest, repeats=1, warmup=0, algorithms=algorithms,
                                         profiled=profiled)
    assert profiled.measuring.measured_peak_bytes <= smallest
    assert trace.peak_bytes + _resident_bytes(work.model, args, kwargs, work.targets) <= smallest
    # the stem's filter gradient was measured only on what fits: a batch split
    stem = profile.node_by_id["conv1/convolution_backward:bwd"]
    assert "native" not in {impl.name for impl in stem.implementations}


@_STEM_SCRATCH_PADDED_TO_16
def test_a_floor_set_by_a_whole_batch_convolution_names_the_algorithms_that_lower_it():
    """optimize()'s eager replay offers native convolutions alone (bitwise eager's), so ResNet-18-small's stem sets
    a floor that the batch-split algorithms lower (on an H200 at batch 32768 every budget below keep-all failed
    there). The error keeps its own minimum and says which algorithms lower the floor and to what; offered them,
    the budget that failed profiles within itself. Where they are offered already, it says nothing of them."""
    from benchmarks.workloads import resnet18_small

    torch.set_num_threads(2)
    work = resnet18_small(batch_size=2048)
    args = tuple(work.inputs)
    with pytest.raises(BudgetError) as failed:
        profile_step(copy.deepcopy(work.model), args, work.loss_fn, work.targets, budget_bytes=60 << 20,
                     repeats=1, warmup=0, algorithms=("native",))
    message = str(failed.value)
    assert "node 'conv1/convolution_backward:bwd'" in message, message
    offered = ("native", "batch-split", "batch-split-sum")
    assert f"algorithms={offered!r}" in message, message
    floor = failed.value.minimum_budget_bytes
    split_floor = int(re.search(r"to [\d.]+ [KMG]iB \((\d+) bytes\)", message).group(1))
    assert split_floor < 0.95 * floor, (split_floor, floor)
    budget = floor - 1
    with AllocationTrace() as trace:
        profile_step(work.model, args, work.loss_fn, work.targets, budget_bytes=budget, repeats=1, warmup=0,
                     algorithms=offered)
    assert trace.peak_bytes + _resident_bytes(work.model, args, {}, work.targets) <= budget
    with pytest.raises(BudgetError) as offered_already:
        profile_step(copy.deepcopy(work.model), args, work.loss_fn, work.targets, budget_bytes=split_floor - 1,
                     repeats=1, warmup=0, algorithms=offered)
    assert "algorithms=" not in str(offered_already.value), str(offered_already.value)


class _Speech(torch.nn.Module):
    """wav2vec2's shape: strided 1-D convolutions over a waveform, then a grouped positional convolution over the
    transposed features."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv1d(1, 64, 10, stride=5)
        self.b = torch.nn.Conv1d(64, 64, 3, stride=2)
        self.proj = torch.nn.Linear(64, 64)
        self.pos = torch.nn.Conv1d(64, 64, 16, padding=8, groups=4)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, wave):
        import torch.nn.functional as F

        h = F.gelu(self.b(F.gelu(self.a(wave.unsqueeze(1)))))
        h = self.proj(h.transpose(1, 2))
        h = h + F.gelu(self.pos(h.transpose(1, 2))[:, :, :-1]).transpose(1, 2)
        return self.head(h).mean(1)


def test_one_dimensional_convolutions_are_measured_within_the_budget_their_floor_names():
    """1-D convolutions were counted no scratch beyond a kernel's allowance, while oneDNN's layout copies and
    columns took up to 64x their results: the budget named measured 6.5 MB (63%) over itself, then was refused. The
    formula now bounds them as the 2-D convolutions of height 1 they are."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = _Speech()
    x, y = torch.randn(4, 16000), torch.randint(0, 8, (4,))
    options = dict(targets=y, time_limit_s=3, workers=1, progress=False, cache=False)
    with pytest.raises(BudgetError) as below:
        executor.optimize(model, (x,), F.cross_entropy, budget=1, **options)
    named = below.value.minimum_budget_bytes
    with AllocationTrace() as trace:
        planned = executor.optimize(model, (x,), F.cross_entropy, budget=named, **options)
    assert trace.peak_bytes + _resident_bytes(model, (x,), {}, y) <= named
    assert planned.profiled_peak_bytes <= named


def test_an_attention_step_needs_less_than_plain_pytorch_at_its_floor():
    """Attention's softmax and its backward make no scratch where their operands are contiguous, and are allowed
    none there: allowed one more score matrix each, a BERT without attention dropout (as CLIP and Llama are) had a
    floor 1.19x plain PyTorch's whole step, and CLIP's smallest budget was 1.14x what plain PyTorch needs. The
    budget named now measures within it."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.set_num_threads(1)
    config = BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=1024, num_labels=4, attn_implementation="eager",
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 768), generator=generator)  # four score matrices of 4.5 MiB a layer
    labels = torch.randint(0, 4, (2,), generator=generator)

    def loss_fn(out, targets):
        return torch.nn.functional.cross_entropy(out.logits, targets)

    resident = _resident_bytes(model, (), {"input_ids": ids}, labels)
    with AllocationTrace() as trace:
        loss_fn(model(input_ids=ids), labels).backward()
    plain_bytes = trace.peak_bytes + resident
    model.zero_grad(set_to_none=True)
    with pytest.raises(BudgetError) as raised:
        profile_step(model, (), loss_fn, labels, kwargs={"input_ids": ids}, budget_bytes=1, repeats=1, warmup=0)
    named = raised.value.minimum_budget_bytes
    assert named < plain_bytes, (named, plain_bytes)
    with AllocationTrace() as trace:
        _, profiled = profile_step(model, (), loss_fn, labels, kwargs={"input_ids": ids}, budget_bytes=named,
                                   repeats=1, warmup=0)
    assert profiled.measuring.peak_bytes <= named
    assert trace.peak_bytes + resident <= named, (trace.peak_bytes + resident, named)


def test_a_bfloat16_loss_is_allowed_no_widening_scratch_and_its_smallest_budget_holds():
    """Under bf16 autocast a GPT-2's loss node (the gradient of log-softmax over the logits, cast to bf16) was
    allowed twice its cast's bytes for widening that its kernels never do (measured: tests/test_scratch_allowance.py),
    and that node set the floor, 1.37x float32's. Now it is allowed none, and the smallest budget named for the
    bf16 step holds in live storage through profiling and training."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from executor.capture import autocast
    from executor.measure.measuring import SCRATCH_SLACK_BYTES, scratch_allowance_bytes
    from executor.measure.profiler import plan_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=2000, n_positions=128))
    ids = torch.randint(0, 2000, (8, 128), generator=torch.Generator().manual_seed(0))

    def loss_fn(out):
        return out.loss

    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = autocast.autocast_state()
    planning = plan_step(model, (ids,), {"labels": ids}, None, loss_fn, state).planning
    loss_group = next(group for group in planning.groups
                      if any(str(op.target) == "aten.nll_loss_backward.default" for op in group.ops))
    assert scratch_allowance_bytes(planning, loss_group) == SCRATCH_SLACK_BYTES

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    resident = _resident_bytes(model, (ids,), {"labels": ids}, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(BudgetError) as raised:
            executor.optimize(model, (ids,), loss_fn, kwargs={"labels": ids}, budget=1, progress=False, cache=False)
        named = raised.value.minimum_budget_bytes
        with AllocationTrace() as trace:
            planned = executor.optimize(model, (ids,), loss_fn, kwargs={"labels": ids}, budget=named, repeats=1,
                                        warmup=0, time_limit_s=5, workers=1, progress=False, cache=False)
            loss = planned(ids, labels=ids)
            loss.backward()
            optimizer.step()
            del loss
    assert trace.peak_bytes + resident <= named, (trace.peak_bytes + resident, named)


class _DropoutAfterAFrozenLayer(torch.nn.Module):
    """LoRA's shape: a dropout over what a frozen layer made, read by a trainable one. No backward goes through the
    dropout, so nothing reads its mask: the kernel makes it all the same and frees it as it returns."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(512, 512).requires_grad_(False)
        self.dropout = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(512, 10)

    def forward(self, x):
        return self.head(self.dropout(self.frozen(x)))


class _MixedPrecisionResidual(torch.nn.Module):
    """Under bf16 autocast: a float32 stream plus a bf16 projection, scaled by a float32 vector (DoRA's magnitude):
    elementwise kernels on operands of two types, which the CPU's TensorIterator first copies to one."""

    def __init__(self):
        super().__init__()
        self.projection = torch.nn.Linear(512, 512)
        self.magnitude = torch.nn.Parameter(torch.ones(512))
        self.head = torch.nn.Linear(512, 10)

    def forward(self, x):
        return self.head(x + self.magnitude * self.projection(x))


class _ChannelsLastDepthwise(torch.nn.Module):
    """ConvNeXt's block: a 7x7 depthwise convolution over a channels-last input, whose filter gradient oneDNN
    computes with each channel padded to a block of 16 (transformers' ConvNeXt at its named budget went 1.12x over
    it while measuring: 809 KB of scratch counted as 373)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 4, stride=4)
        self.depthwise = torch.nn.Conv2d(16, 16, 7, padding=3, groups=16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        hidden = self.stem(x).contiguous(memory_format=torch.channels_last)
        return self.head(self.depthwise(hidden).mean((2, 3)))


@pytest.mark.parametrize("case", ["unread dropout mask", "mixed precision elementwise", "channels-last depthwise"])
def test_every_nodes_provisional_workspace_covers_the_measured_one(case):
    """The provisional workspaces bound what the measuring passes may hold; a node measured above its bound broke
    the budget while measuring (warned, after the fact). LoRA's dropout over a frozen layer's output: the mask
    nothing reads was left out (transformers' Mistral with LoRA on every linear layer went 4.55 MiB of 4.54). Under
    bf16 autocast, elementwise kernels over float32 and bf16 operands were allowed no scratch, and a transposed
    bf16 operand of a product no copy (peft's DoRA on Qwen2 went 3.08 MiB of 2.88)."""
    import contextlib

    import torch.nn.functional as F
    from torch.utils._pytree import tree_flatten

    from executor.measure.profiler import provisional_profile

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = {"unread dropout mask": _DropoutAfterAFrozenLayer, "mixed precision elementwise": _MixedPrecisionResidual,
             "channels-last depthwise": _ChannelsLastDepthwise}[case]()
    region = torch.autocast("cpu", dtype=torch.bfloat16) if case.startswith("mixed") else contextlib.nullcontext()
    x = torch.randn(8, 3, 16, 16) if case == "channels-last depthwise" else torch.randn(64, 512)
    y = torch.randint(0, 10, (x.shape[0],))
    with region:
        profile, profiled = profile_step(model, (x,), F.cross_entropy, y, repeats=1, warmup=0,
                                         algorithms=("native",))
    provisional = provisional_profile(profiled, tree_flatten((((x,), {}, y), {}))[0], torch.device("cpu"), "sgd",
                                      ("native",), None, None, case, None, lambda message: None)
    over = {node.id: (node.implementations[0].workspace_bytes,
                      provisional.node_by_id[node.id].implementations[0].workspace_bytes)
            for node in profile.nodes
            if node.implementations[0].workspace_bytes > provisional.node_by_id[node.id].implementations[0]
            .workspace_bytes}
    assert not over, f"measured above the provisional workspace: {over}"

"""Plans kept across runs (executor.plan.cache): a restarted process starts at its first step, and never from a plan made
for another model. Every run here is a fresh process, as a restart is; each counts the captures and solves it ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent

MODEL = '''
import torch
from torch import nn

from cached_helpers import activation


class Net(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(96, 96) for _ in range(depth))
        self.head = nn.Linear(96, 10)

    def forward(self, x):
        for layer in self.layers:
            x = activation(layer(x))
        return self.head(x)


def build(depth=8):
    torch.manual_seed(0)
    return Net(depth)
'''

HELPERS = '''
import torch


def activation(x):
    return torch.tanh(x)
'''

RUN = '''
import copy, json, sys, time
import torch
import torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import executor.replay.optimize
import executor.measure.profiler
from cached_model import build

calls = {"capture": 0, "solve": 0}
real_capture, real_plan = executor.measure.profiler.capture, executor.replay.optimize.plan

def counted_capture(*args, **kwargs):
    calls["capture"] += 1
    return real_capture(*args, **kwargs)

def counted_plan(*args, **kwargs):
    calls["solve"] += 1
    return real_plan(*args, **kwargs)

executor.measure.profiler.capture, executor.replay.optimize.plan = counted_capture, counted_plan
model = build(int(sys.argv[2]))
plain = copy.deepcopy(model)
x = torch.randn(1024, 96, generator=torch.Generator().manual_seed(1))
y = torch.randint(0, 10, (1024,), generator=torch.Generator().manual_seed(2))
messages = []
started = time.perf_counter()
planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=0.6, time_limit_s=3, workers=1,
                            progress=messages.append)
loss = planned(x, targets=y)
loss.backward()
first_step_s = time.perf_counter() - started
F.cross_entropy(plain(x), y).backward()
same = torch.equal(loss, F.cross_entropy(plain(x), y)) and all(
    torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))
print(json.dumps({"calls": calls, "messages": messages, "bitwise": same, "first_step_s": first_step_s,
                  "budget": planned.schedule.budget_bytes}))
'''


@pytest.fixture
def project(tmp_path):
    """A user's model in files of their own, and a script that trains it once with optimize()."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "cached_model.py").write_text(MODEL)
    (code / "cached_helpers.py").write_text(HELPERS)
    (tmp_path / "run.py").write_text(RUN)
    return tmp_path


def run(project: Path, depth: int = 8) -> dict:
    result = subprocess.run([sys.executable, str(project / "run.py"), str(project / "code"), str(depth)],
                            capture_output=True, text=True, cwd=REPO, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def kept_entries() -> list[Path]:
    plans = Path(os.environ["MOSOS_CACHE_DIR"]) / "plans-v1"
    return sorted(p for p in plans.iterdir() if not p.name.startswith(".")) if plans.exists() else []


def test_a_second_process_starts_from_the_kept_plan_without_capture_or_solve(project):
    first = run(project)
    assert first["calls"] == {"capture": 1, "solve": 1}
    assert first["bitwise"]
    assert any("plan kept for later runs" in m for m in first["messages"])
    assert len(kept_entries()) == 1

    second = run(project)
    assert second["calls"] == {"capture": 0, "solve": 0}, second["messages"]
    assert any("no profile or solve" in m for m in second["messages"])
    assert second["bitwise"]  # the rebuilt graph computes exactly what plain PyTorch does
    assert second["budget"] == first["budget"]


def test_a_model_changed_by_one_layer_is_not_served_the_old_plan(project):
    run(project, depth=8)
    deeper = run(project, depth=9)
    assert deeper["calls"] == {"capture": 1, "solve": 1}
    assert deeper["bitwise"]
    assert len(kept_entries()) == 2


def test_a_changed_source_file_makes_the_kept_plan_stale(project):
    run(project)
    # the model's modules look the same; the code it runs through does not
    (project / "code" / "cached_helpers.py").write_text(HELPERS.replace("torch.tanh(x)", "torch.sigmoid(x)"))
    changed = run(project)
    assert changed["calls"] == {"capture": 1, "solve": 1}, changed["messages"]
    assert changed["bitwise"]  # against plain PyTorch running the new code
    again = run(project)
    assert again["calls"] == {"capture": 0, "solve": 0}


def test_two_processes_planning_the_same_model_at_once_both_train_and_leave_one_valid_entry(project):
    def start():
        return subprocess.Popen([sys.executable, str(project / "run.py"), str(project / "code"), "8"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env=dict(os.environ))

    racing = [start(), start()]  # both find the cache empty, both plan, both write the same entry
    for process in racing:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["bitwise"]
    assert len(kept_entries()) == 1
    plans = Path(os.environ["MOSOS_CACHE_DIR"]) / "plans-v1"
    assert [p.name for p in plans.iterdir() if p.name.startswith(".")] == []  # no staging directory left behind
    after = run(project)
    assert after["calls"] == {"capture": 0, "solve": 0}, after["messages"]  # the entry left is whole
    assert after["bitwise"]


@pytest.mark.parametrize("damage", ["truncated capture", "schedule of another profile", "torn entry",
                                    "traced file changed", "budget raised", "budget below its peak"])
def test_a_corrupt_entry_is_said_removed_and_planned_again(project, damage):
    first = run(project)
    (entry,) = kept_entries()
    if damage == "truncated capture":
        text = (entry / "capture.json").read_text()
        (entry / "capture.json").write_text(text[: len(text) // 2])
    elif damage == "schedule of another profile":
        schedule = json.loads((entry / "schedule.json").read_text())
        schedule["profile_digest"] = "0" * 64
        (entry / "schedule.json").write_text(json.dumps(schedule))
    elif damage == "torn entry":
        (entry / "profile.json").unlink()
    elif damage in ("budget raised", "budget below its peak"):
        # valid JSON, another plan: ten times the budget was trusted, and under memory_ratio it raised the budget
        # of every later input signature (31% over on a transformer); a budget below the plan's peak was not seen
        schedule = json.loads((entry / "schedule.json").read_text())
        peak = schedule["summary"]["peak_memory_bytes"]
        schedule["budget_bytes"] = schedule["budget_bytes"] * 10 if damage == "budget raised" else peak // 2
        (entry / "schedule.json").write_text(json.dumps(schedule))
    else:  # a file the capture traced through, changed without changing the key
        capture = json.loads((entry / "capture.json").read_text())
        traced = next(path for path in capture["source_files"] if path.endswith("cached_model.py"))
        capture["source_files"][traced] = "0" * 64
        (entry / "capture.json").write_text(json.dumps(capture))
    result = run(project)
    assert result["calls"] == {"capture": 1, "solve": 1}
    assert any("is not usable" in m and "planning again" in m for m in result["messages"]), result["messages"]
    if damage == "traced file changed":
        assert any("cached_model.py changed since the capture" in m for m in result["messages"])
    if damage == "budget raised":
        assert any("made for a budget of" in m and "memory_ratio=0.6 gives here" in m for m in result["messages"])
    if damage == "budget below its peak":
        assert any("over the budget" in m for m in result["messages"]), result["messages"]
    assert result["budget"] == first["budget"]  # what memory_ratio gives, not what the entry said
    assert result["bitwise"]
    assert run(project)["calls"] == {"capture": 0, "solve": 0}  # the entry was made again, whole


def test_cache_off_keeps_nothing_and_the_cli_lists_and_clears(project, tmp_path):
    import torch
    import torch.nn.functional as F

    import executor

    sys.path.insert(0, str(project / "code"))
    try:
        from cached_model import build
    finally:
        sys.path.remove(str(project / "code"))
    x, y = torch.randn(16, 96), torch.randint(0, 10, (16,))
    executor.optimize(build(2), (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all", cache=False,
                      progress=False)
    assert kept_entries() == []
    elsewhere = tmp_path / "elsewhere"
    executor.optimize(build(2), (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all",
                      cache=elsewhere, progress=False)
    assert kept_entries() == [] and len(list((elsewhere / "plans-v1").iterdir())) == 1

    def mosos(*args):
        return subprocess.run([sys.executable, "-m", "cli", "cache", *args], capture_output=True, text=True,
                              cwd=REPO, timeout=120)

    listed = mosos("list", "--dir", str(elsewhere))
    assert listed.returncode == 0, listed.stderr
    assert "Net" in listed.stdout and "float32[16,96]" in listed.stdout and "keep-all" in listed.stdout
    cleared = mosos("clear", "--dir", str(elsewhere))
    assert cleared.returncode == 0 and "removed 1 kept plan" in cleared.stdout
    assert "no plans kept" in mosos("list", "--dir", str(elsewhere)).stdout
    assert "no plans kept" in mosos("list").stdout  # $MOSOS_CACHE_DIR: this test's own, still empty


@pytest.mark.parametrize("algorithms, kept", [(("native",), False), ("all", True)])
def test_a_plan_from_the_cache_whose_picks_decide_the_rounding_is_not_replanned_on_timings(tmp_path, monkeypatch,
                                                                                          algorithms, kept):
    """Compiled steps (or convolution algorithms beyond ATen's own) round by the plan's picks. A restart that took
    the kept plan, found its timed steps 10% off (timing noise) and re-planned ran other bits from its third step
    than a restart that did not (a helper's GPT-2 under compile=True, three processes sharing the cache). Such a
    plan from the cache is kept as it is; the eager replay, bitwise whatever the plan, still re-plans. In one
    process here, every step counted as off."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import executor
    from executor.measure import measured

    monkeypatch.setattr(measured, "REPLAN_OFF", -1.0)  # every timed step is "off"
    x, y = torch.randn(256, 32), torch.randint(0, 4, (256,))

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        messages: list[str] = []
        planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, memory_ratio=1.0, algorithms=algorithms,
                                    cache=tmp_path, time_limit_s=3, workers=1, progress=messages.append)
        for _ in range(5):  # two timed steps, a re-plan, the new plan's two timed steps
            assert planned.wait_for_replan(60)  # the re-plan runs beside the steps: taken as soon as it is there
            planned(x, y).backward()
        return planned, messages

    made, made_messages = run()
    assert made.report().history[0].replanned  # a plan this process made re-plans as before
    loaded, loaded_messages = run()
    assert any("no profile or solve" in m for m in loaded_messages)
    report = loaded.report()
    if kept:
        assert report.replan_kept and not report.replanned and not report.history
        assert any("kept as it is" in m for m in loaded_messages) and "kept as it is" in report.describe()
    else:
        assert report.history[0].replanned and not report.replan_kept


def test_plans_of_one_step_at_other_budgets_share_the_step_digest_and_nothing_else_does():
    """The step digest names the profile, which any budget's plan can use: the budget, the strategy, the
    measuring strategy and where the plan is solved leave it alone; the model, the inputs and what the profile
    holds (the algorithms measured, the loss split, on the CPU the thread count, by which oneDNN's scratch grows)
    change it."""
    import torch
    from torch import nn

    from executor.plan.cache import plan_key

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    inputs = (torch.randn(2, 4),)
    settings = {"measuring": "auto", "planner": "local", "algorithms": ["native"]}

    def key(model=model, inputs=inputs, budget=None, strategy="mosos", **changed):
        return plan_key(model, None, inputs, None, None, device=torch.device("cpu"),
                        budget=budget or {"bytes": 1 << 20}, strategy=strategy, optimizer=None,
                        settings=settings | changed)

    base = key()
    for same in (key(budget={"bytes": 1 << 19}), key(budget={"memory_ratio": 0.5}), key(strategy="recompute-only"),
                 key(measuring="frugal"), key(planner="service")):
        assert same.step_digest == base.step_digest and same.digest != base.digest
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        more_threads = key()
    finally:
        torch.set_num_threads(threads)
    for other in (key(algorithms=["native", "batch-split"]), key(split_loss=True),
                  key(model=nn.Sequential(nn.Linear(4, 4), nn.ReLU())), key(inputs=(torch.randn(3, 4),)),
                  more_threads):
        assert other.step_digest != base.step_digest and other.digest != base.digest


def test_the_kept_profile_of_a_step_is_the_newest_whole_one_that_describes_this_capture(tmp_path, offload_profile):
    """Entries of the same step at other budgets, newest first: a damaged profile is said and passed over, one whose
    traced source changed or that describes another graph is passed over in silence, another step's is never
    looked at, and the entry of this very key is load()'s, not this."""
    import json
    import types

    from executor.plan.cache import PlanCache, PlanKey

    cache = PlanCache(tmp_path)
    step = types.SimpleNamespace(structure_sha256=lambda: "graph-a")
    source = tmp_path / "model.py"
    source.write_text("x = 1\n")

    def keep(name: str, created: float, step_digest: str, graph: str = "graph-a", profile_text: str | None = None,
             changed_source: bool = False) -> None:
        entry = cache.plans / name
        entry.mkdir(parents=True)
        provenance = offload_profile.provenance.model_copy(update={"model_structure_sha256": graph})
        profile = offload_profile.model_copy(update={"provenance": provenance, "name": name})
        (entry / "profile.json").write_text(profile_text if profile_text is not None else profile.model_dump_json())
        files = {str(source): "0" * 64} if changed_source else {}
        (entry / "capture.json").write_text(json.dumps({"source_files": files}))
        summary = {"model": "M", "inputs": "", "device": "cpu", "budget": {"bytes": 1}, "strategy": "mosos"}
        (entry / "entry.json").write_text(json.dumps({"key": {"summary": summary}, "created": created,
                                                      "step_digest": step_digest}))

    keep("a-oldest", 1.0, "step")
    keep("b-newest-whole", 2.0, "step")
    keep("c-another-graph", 3.0, "step", graph="graph-b")
    keep("d-source-changed", 4.0, "step", changed_source=True)
    keep("e-damaged", 5.0, "step", profile_text="{not json")
    keep("f-another-step", 6.0, "other-step")
    keep("this-key", 7.0, "step")
    said = []
    found = cache.measured_profile(PlanKey({}, "this-key", "step"), step, said.append)
    assert found is not None and found[0].name == "b-newest-whole" and found[1].name == "b-newest-whole"
    assert len(said) == 1 and "e-damaged" in said[0] and "passed over" in said[0]
    assert cache.measured_profile(PlanKey({}, "this-key", "nothing-kept"), step, said.append) is None
    assert cache.measured_profile(PlanKey({}, "this-key", ""), step, said.append) is None

"""Bad arguments to the Python APIs end in the project's own errors, with a sentence that says what is wrong."""

from __future__ import annotations

import re

import pytest

from planner import plan
from planner.errors import BudgetError, MososError
from planner.plot import plot_memory
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_schedule


@pytest.mark.parametrize(
    ("budget", "ratio", "fragment"),
    [
        (2**70, None, "larger than any memory"),
        (True, None, "whole number of bytes, not bool"),
        (1.5, None, "whole number of bytes, not float"),
        (None, "0.5", "memory ratio is a number in (0, 1], not str"),
    ],
)
def test_plan_refuses_budgets_that_are_not_sizes(offload_profile, budget, ratio, fragment):
    with pytest.raises(BudgetError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        plan(offload_profile, budget, memory_ratio=ratio, strategy="checkmate-auto", time_limit_s=5)


@pytest.mark.parametrize(("size", "fragment"), [
    (4.5, "a size in bytes is a whole number, not 4.5: give a unit for a fraction (4.5 GiB is '4.5GiB')"),
    ("4.5", "a size in bytes is a whole number, not '4.5'"),
    ("4.5B", "a size in bytes is a whole number, not '4.5B'"),
    (float("nan"), "a size is a finite number of bytes, not nan"),
    (float("inf"), "a size is a finite number of bytes, not inf"),
])
def test_a_size_with_a_fraction_of_a_byte_is_refused(size, fragment):
    """optimize(budget=4.5) took it as 4 bytes, silently (a unit left out, most likely)."""
    from planner.units import parse_bytes

    with pytest.raises(BudgetError, match=re.escape(fragment)):
        parse_bytes(size)
    assert parse_bytes(4.0) == parse_bytes("4.0") == 4 and parse_bytes("4.5KB") == 4500


def test_a_profile_name_with_dollars_is_drawn_as_text(offload_profile, tmp_path):
    named = offload_profile.model_copy(update={"name": "a $\\badcommand{$ b $x^$"})
    result = simulate(named, keep_all_schedule(named))
    plot_memory(result, tmp_path / "memory.png", title=named.name)
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_executor_refuses_what_it_would_get_wrong():
    torch = pytest.importorskip("torch")
    pytest.importorskip("models")
    import executor
    from executor.errors import ReplayError
    from models import get_model

    spec = get_model("vgg19", small=True)
    torch.manual_seed(0)
    model = spec.build()
    inputs, targets = spec.example_inputs(8)
    with pytest.raises(MososError, match="unknown optimizer 'bogus'"):
        executor.optimize(model, inputs, spec.loss, targets=targets, optimizer="bogus", progress=False)
    with pytest.raises(BudgetError, match=re.escape("give either a budget (budget='2MiB') or a memory ratio "
                                                    "(memory_ratio=0.9), not both")):
        executor.optimize(model, inputs, spec.loss, "2MiB", targets=targets, memory_ratio=0.9, progress=False)
    with pytest.raises(MososError, match=re.escape("(optimize(..., optimizer=opt), opt = AdamW(model.parameters(), "
                                                   "...)) or its kind as a word ('adamw'), not the class AdamW")):
        executor.optimize(model, inputs, spec.loss, targets=targets, optimizer=torch.optim.AdamW, progress=False)
    with pytest.raises(MososError, match=re.escape("d2h_gb_per_s is a copy bandwidth in GB/s, a positive number, "
                                                   "not -1.0")):
        executor.optimize(model, inputs, spec.loss, targets=targets, d2h_gb_per_s=-1.0, progress=False)
    with pytest.raises(MososError, match="needs loss_fn"):
        executor.optimize(model, inputs, None, targets=targets, progress=False)
    with pytest.raises(MososError, match="not ndarray"):
        executor.optimize(model, inputs.numpy(), spec.loss, targets=targets, progress=False)
    with pytest.raises(MososError, match="no trainable parameters"):
        executor.optimize(torch.nn.Sequential(torch.nn.Flatten()), inputs, lambda out, t: out.sum(), targets=targets,
                          progress=False)
    planned = executor.optimize(model, inputs, spec.loss, targets=targets, memory_ratio=1.0, strategy="keep-all",
                                progress=False, repeats=1, warmup=0)
    with pytest.raises(ReplayError, match="requires a gradient"):
        planned(inputs.clone().requires_grad_(), targets)
    loss = planned(inputs, targets)
    loss.backward()
    with pytest.raises(ReplayError, match="backward has already run"):
        loss.backward()

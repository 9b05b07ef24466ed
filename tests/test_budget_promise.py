"""The model that does not fit: profile, plan and train within the budget from the first allocation.

A device too small for the model is a process under RLIMIT_AS (tests/capped_step.py): the cap is what the process
holds once the model is built, plus the budget, plus a fixed headroom for what is not tensor storage (the
interpreter's heap during capture, OR-Tools' library). A plain step fails under that cap with the allocator's
error; `optimize(budget=B)` profiles, plans and trains three steps under it, bitwise equal to plain PyTorch's
three steps computed without a cap.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "capped_step.py"
HEADROOM_MIB = 320
# every block of 64 KiB or more its own mapping, returned when freed: address space then follows live storage
# instead of keeping freed blocks in glibc's heap (as benchmarks/real_memory.py runs its children)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "2"}


def _run(tmp_path: Path, model: str, mode: str, budget_mib: int) -> dict:
    out = tmp_path / f"{model}-{mode}.pt"
    environment = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run([sys.executable, str(SCRIPT), model, mode, str(budget_mib), str(HEADROOM_MIB), str(out)],
                               capture_output=True, text=True, env=environment, timeout=600)
    assert completed.returncode == 0 and out.exists(), f"{model} {mode} failed:\n{completed.stderr[-3000:]}"
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "budget_mib"), [("tanh", 640), ("bert", 800)])
def test_a_model_whose_plain_step_does_not_fit_is_profiled_planned_and_trained_within_the_cap(tmp_path, model,
                                                                                             budget_mib):
    plain = _run(tmp_path, model, "plain", budget_mib)
    capped = _run(tmp_path, model, "plain-capped", budget_mib)
    assert capped["error"] is not None and "can't allocate memory" in capped["error"], (
        f"the plain step ran under the cap, so the cap proves nothing: {capped}")
    planned = _run(tmp_path, model, "planned", budget_mib)
    assert planned["measuring"] != "keep-all" and "keep-all" not in planned["measuring"].split(" (")[0]
    assert planned["budget_bytes"] == budget_mib << 20
    assert planned["ledger_peak_bytes"] <= planned["budget_bytes"]
    assert len(planned["losses"]) == len(plain["losses"]) == 3
    for step, (expected, actual) in enumerate(zip(plain["losses"], planned["losses"])):
        assert torch.equal(expected, actual), f"step {step}: loss {actual} != plain {expected}"
    for step, (expected, actual) in enumerate(zip(plain["gradients"], planned["gradients"])):
        assert expected.keys() == actual.keys()
        for name in expected:
            assert torch.equal(expected[name], actual[name]), f"step {step}: gradient of {name} differs"

"""A plan that fits fits in the process's real memory (issue 11): benchmarks/real_memory.py, in CI.

Each planned step runs in a fresh process; its peak RSS rise after a warm-up step and the peak of live
allocations (torch.profiler's memory events, an independent count) stay within the budget minus fixed
memory, plus 2% and 4 MiB, for every strategy that finds a plan on the elementwise model of the issue
(12 x tanh(x * s), 32 MiB float32 activations). A profile that hides the workspace of its nodes gives a
plan that the same measurement catches over its budget: the check can fail.
"""

from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not Path("/proc/self/clear_refs").exists():
    pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS", allow_module_level=True)

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_memory.py"
_spec = importlib.util.spec_from_file_location("real_memory_bench", _SCRIPT)
real_memory = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = real_memory
_spec.loader.exec_module(real_memory)

pytestmark = pytest.mark.slow

SPEC = "benchmarks/workloads.py:elementwise"
MIB = 2**20


@pytest.fixture(scope="module")
def profile():
    return real_memory.measured_profile(SPEC)


def test_every_plan_fits_in_real_memory(profile):
    planned = 0
    with ThreadPoolExecutor(2) as pool:  # one measuring process per plan, two at a time (their RSS is their own)
        rows = list(pool.map(lambda strategy: real_memory.check(
            SPEC, profile, strategy, None if strategy == "keep-all" else 0.5, time_limit_s=3), real_memory.STRATEGIES))
    for strategy, row in zip(real_memory.STRATEGIES, rows):
        if not row.planned:
            continue
        planned += 1
        assert row.ledger_bytes == row.simulated_bytes <= row.allowed_bytes, strategy
        assert row.rss_rise_bytes <= row.limit_bytes, (
            f"{strategy}: RSS rose {row.rss_rise_bytes / MIB:.1f} MiB, allowed {row.allowed_bytes / MIB:.1f}")
        assert row.storage_rise_bytes <= row.limit_bytes, (
            f"{strategy}: live storage rose {row.storage_rise_bytes / MIB:.1f} MiB, allowed {row.allowed_bytes / MIB:.1f}")
        # the two measurements agree with each other and with the ledger (the step is its ATen ops, nothing else)
        assert abs(row.rss_rise_bytes - row.storage_rise_bytes) <= 0.02 * row.storage_rise_bytes + 4 * MIB, strategy
        assert abs(row.storage_rise_bytes - row.ledger_bytes) <= 0.02 * row.ledger_bytes + 4 * MIB, strategy
    assert planned >= 4  # keep-all, mosos, recompute-only, checkmate-auto at least


def test_the_measurement_catches_a_profile_that_hides_workspace(profile):
    """The old ledger's blind spot: every node's workspace (the product x * s) set to 0 (its arena part too)."""
    hidden = profile.model_copy(update={"nodes": [
        node.model_copy(update={"implementations": [
            i.model_copy(update={"workspace_bytes": 0, "arena_workspace_bytes": None}) for i in node.implementations]})
        for node in profile.nodes]})
    assert sum(n.fastest.workspace_bytes for n in profile.nodes) > 0
    row = real_memory.check(SPEC, hidden, "recompute-only", 0.5)
    assert row.planned
    assert row.ledger_bytes <= row.allowed_bytes  # what the hidden profile's ledger believes
    assert row.rss_rise_bytes > row.limit_bytes and row.storage_rise_bytes > row.limit_bytes

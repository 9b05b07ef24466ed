"""The executor's memory ledger follows the simulator's rules, including at equal times."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from executor.engine.accountant import Accountant  # noqa: E402
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_schedule
from tests.conftest import make_profile, node


def test_a_zero_time_node_counts_as_in_the_simulator():
    profile = make_profile(
        [
            node("a", output_bytes=100, time_ms=1.0),
            node("b", inputs=["a"], output_bytes=1000, time_ms=0.0),  # measured as 0 ms: its output still exists
            node("c", inputs=["b"], output_bytes=10, time_ms=1.0),
        ],
        fixed_bytes=5,
    )
    ledger = Accountant(profile, profile.fixed_bytes)
    for operation in (op for stage in keep_all_schedule(profile).stages for op in stage.operations):
        if operation.op == "compute":
            n = profile.node_by_id[operation.node]
            ledger.compute(n.id, n.fastest.time_ms, n.size_bytes, n.fastest.workspace_bytes)
        else:
            ledger.free(operation.tensor)
    # At t=1, in program order: b's output (+1000), then a is freed (-100): the peak holds a and b.
    assert simulate(profile, keep_all_schedule(profile)).peak_memory_bytes == 5 + 100 + 1000
    assert ledger.peak_bytes() == 5 + 100 + 1000

"""planner.max_batch: the search over batch sizes against brute force, the overhead limit, the time limit, the
messages when no batch fits, and monotonicity violations reported (torch-free: profiles built in code)."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.builder import certify
from planner.errors import BudgetError
from planner.max_batch import MaxBatchError, max_batch
from planner.planning import InfeasibleBudget, plan
from planner.strategies.keep_all import keep_all_schedule
from tests.conftest import make_profile, node

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chain(batch: int, per_sample=(3000, 2000, 4000, 1000), fixed=50_000, time_per_sample_ms=0.5, bandwidth=None):
    """A forward chain whose tensors and times grow linearly with the batch, a loss, and its backward."""
    nodes, previous = [], None
    for i, size in enumerate(per_sample):
        nodes.append(node(f"f{i}", inputs=[previous] if previous else [], output_bytes=size * batch,
                          time_ms=time_per_sample_ms * batch, op_type="conv2d" if i % 2 == 0 else "relu"))
        previous = f"f{i}"
    nodes.append(node("loss", kind="loss", inputs=[previous], output_bytes=8, time_ms=0.01))
    gradient = "loss"
    for i in reversed(range(len(per_sample))):
        reads = [gradient, f"f{i}"] if i % 2 else [gradient] + ([f"f{i - 1}"] if i else [])
        nodes.append(node(f"f{i}:bwd", kind="backward", inputs=reads, output_bytes=per_sample[i] * batch,
                          time_ms=2 * time_per_sample_ms * batch, forward_node=f"f{i}" if len(reads) > 1 else None))
        gradient = f"f{i}:bwd"
    return make_profile(nodes, fixed_bytes=fixed, d2h=bandwidth, h2d=bandwidth, capacity=10**9, name=f"chain batch {batch}")


def brute_force(profile_for_batch, budget, strategy, top):
    fitting = []
    for batch in range(1, top + 1):
        try:
            schedule = plan(profile_for_batch(batch), budget, strategy=strategy)
        except BudgetError:
            continue
        if schedule.summary.peak_memory_bytes <= budget:
            fitting.append(batch)
    return fitting


@SETTINGS
@given(
    sizes=st.lists(st.integers(100, 5000), min_size=2, max_size=5),
    budget=st.integers(60_000, 400_000),
    strategy=st.sampled_from(["keep-all", "checkpoint-all", "chen-sqrt"]),
)
def test_the_largest_batch_is_brute_forces_on_small_ranges(sizes, budget, strategy):
    profiles = lambda batch: chain(batch, per_sample=tuple(sizes))  # noqa: E731
    result = max_batch(profiles, budget, strategies=[strategy], max_overhead=None, time_limit_s=60, batch_limit=64,
                       throughput_probes=0)
    answer = result.strategies[0]
    fitting = brute_force(profiles, budget, strategy, 65)
    expected = max((b for b in fitting if b <= 64), default=None)
    assert fitting == list(range(1, len(fitting) + 1)), "these heuristics are monotone in the batch"
    assert answer.max_batch_size == expected
    assert answer.complete and answer.monotone
    if expected is not None and expected < 64:
        assert answer.first_failing_batch_size == expected + 1
    assert len(answer.probes) <= 2 * math.ceil(math.log2(64)) + 2  # exponential then binary, not a scan


class Predicate:
    """A fake solver: batch b fits iff `fits(b)`; counts its calls."""

    def __init__(self, fits):
        self.fits, self.calls = fits, []

    def __call__(self, profile, budget_bytes, *, strategy, time_limit_s, workers, seed, should_stop):
        batch = int(profile.name.rsplit(" ", 1)[1])
        self.calls.append(batch)
        if not self.fits(batch):
            raise InfeasibleBudget(f"batch {batch} does not fit", minimum_budget_bytes=budget_bytes + 1)
        return certify(profile, keep_all_schedule(profile, budget_bytes), strategy)


def small_chain(batch):
    return chain(batch, per_sample=(1, 1), fixed=0)


@SETTINGS
@given(threshold=st.integers(0, 70), limit=st.integers(1, 70))
def test_a_monotone_predicate_gives_its_threshold(threshold, limit):
    solve = Predicate(lambda b: b <= threshold)
    result = max_batch(small_chain, 10**8, strategies=["keep-all"], max_overhead=None, batch_limit=limit, solve=solve,
                       throughput_probes=0)
    answer = result.strategies[0]
    expected = min(threshold, limit) or None
    assert answer.max_batch_size == expected
    assert answer.complete and answer.monotone and not answer.violations
    assert len(set(solve.calls)) == len(solve.calls), "no batch is solved twice"
    if expected is None:
        assert "no batch fits" in answer.reason


@SETTINGS
@given(pattern=st.lists(st.booleans(), min_size=1, max_size=40), probes=st.integers(0, 6))
def test_any_predicate_gives_a_fitting_batch_whose_successor_fails_and_reports_violations(pattern, probes):
    solve = Predicate(lambda b: b <= len(pattern) and pattern[b - 1])
    result = max_batch(small_chain, 10**8, strategies=["keep-all"], max_overhead=None, batch_limit=len(pattern),
                       solve=solve, throughput_probes=probes)
    answer = result.strategies[0]
    evaluated = {p.batch_size: p.fits for p in answer.probes}
    if answer.max_batch_size is None:
        assert not pattern[0] and evaluated == {1: False}
        return
    assert pattern[answer.max_batch_size - 1]
    assert answer.max_batch_size == len(pattern) or evaluated[answer.max_batch_size + 1] is False
    wrong = [b for b, fits in evaluated.items() if not fits and b < answer.max_batch_size]
    assert answer.monotone == (not wrong) and len(answer.violations) == len(wrong)


def test_the_overhead_limit_is_over_each_batchs_own_lower_bound():
    profiles = lambda batch: chain(batch, per_sample=(3000, 2000) * 5)  # noqa: E731
    budget = 500_000
    free = max_batch(profiles, budget, strategies=["chen-sqrt"], max_overhead=None, batch_limit=64,
                     throughput_probes=0).strategies[0]
    assert free.max_batch_size is not None and free.at_max.overhead > 0  # chen-sqrt always recomputes
    limited = max_batch(profiles, budget, strategies=["chen-sqrt"], max_overhead=free.at_max.overhead / 2,
                        batch_limit=64, throughput_probes=0).strategies[0]
    assert limited.max_batch_size is None
    assert "no batch fits within the overhead limit" in limited.reason and "keep-all runs batch 1" in limited.reason
    assert limited.first_batch_minimum_budget_bytes > 0
    forward = max_batch(profiles, budget, strategies=["chen-sqrt"], max_overhead="forward", batch_limit=64,
                        throughput_probes=0).strategies[0]
    assert forward.at_max.overhead <= forward.at_max.overhead_limit + 1e-9
    assert forward.at_max.overhead_limit == pytest.approx(1 / 3, rel=1e-3)  # forward: a third of the step in `chain`


def test_a_budget_below_anything_says_what_batch_1_needs():
    result = max_batch(chain, 1000, strategies=["keep-all", "chen-sqrt"], time_limit_s=10)
    assert result.floor_batch_size == 0 and "below what any plan needs at batch 1" in result.floor_reason
    for answer in result.strategies:
        assert answer.max_batch_size is None and answer.probes == []
        assert "no batch fits" in answer.reason and answer.first_batch_minimum_budget_bytes > 1000


def test_batches_above_the_floor_are_never_solved():
    solve = Predicate(lambda b: True)
    result = max_batch(chain, 200_000, strategies=["keep-all"], max_overhead=None, solve=solve, throughput_probes=0)
    floor = result.floor_batch_size
    assert 0 < floor < 100 and max(solve.calls) == floor
    assert result.strategies[0].max_batch_size == floor and result.strategies[0].complete


def test_the_best_throughput_is_a_fitting_batch_with_the_highest_samples_per_second():
    result = max_batch(chain, 150_000, strategies=["keep-all", "chen-sqrt"], max_overhead=None, batch_limit=64)
    for answer in result.strategies:
        fitting = [p for p in answer.probes if p.fits]
        assert answer.best_throughput_samples_per_s == max(p.throughput_samples_per_s for p in fitting)
    assert result.best_throughput["samples_per_s"] == max(a.best_throughput_samples_per_s for a in result.strategies)


def test_the_time_limit_bounds_the_whole_search_and_a_short_one_is_said():
    def slow(profile, budget_bytes, *, strategy, time_limit_s, workers, seed, should_stop):
        deadline = time.monotonic() + time_limit_s
        while time.monotonic() < deadline and not should_stop():
            time.sleep(0.01)
        return certify(profile, keep_all_schedule(profile, budget_bytes), strategy)

    started = time.monotonic()
    result = max_batch(small_chain, 10**8, strategies=["keep-all", "chen-sqrt"], max_overhead=None, time_limit_s=3,
                       solve=slow)
    elapsed = time.monotonic() - started
    assert elapsed < 3 + 1.0
    for answer in result.strategies:
        assert not answer.complete and "time limit ran out" in answer.stopped_by
        assert answer.max_batch_size is not None  # what was found is kept
        assert all(p.time_limit_s <= answer.time_share_s + 1e-9 for p in answer.probes)


def test_a_stop_request_ends_the_search_with_what_it_found():
    calls = []

    def stop():
        return len(calls) >= 3

    def solve(profile, budget_bytes, **options):
        calls.append(1)
        return certify(profile, keep_all_schedule(profile, budget_bytes), options["strategy"])

    result = max_batch(small_chain, 10**8, strategies=["keep-all", "chen-sqrt"], max_overhead=None, solve=solve,
                       should_stop=stop)
    assert result.stopped and len(calls) == 3
    assert result.strategies[0].max_batch_size == 4 and result.strategies[1].probes == []


def test_a_solve_cut_short_by_a_stop_request_is_not_a_failing_batch():
    """A cancel during a solve used to record that batch as 'infeasible' ("not solved: cancelled by request") and
    report it as the first failing batch, though it was never answered."""
    stopped = []

    def solve(profile, budget_bytes, **options):
        batch = int(profile.name.rsplit(" ", 1)[1])
        if batch == 8:
            stopped.append(batch)  # the cancel arrives while this batch is solved: the solve gives up without a plan
            raise InfeasibleBudget("not solved: cancelled by request", minimum_budget_bytes=None)
        return certify(profile, keep_all_schedule(profile, budget_bytes), options["strategy"])

    result = max_batch(small_chain, 10**8, strategies=["keep-all"], max_overhead=None, solve=solve,
                       should_stop=lambda: bool(stopped), throughput_probes=0)
    answer = result.strategies[0]
    assert answer.max_batch_size == 4 and answer.first_failing_batch_size is None
    assert answer.stopped_by == "stopped on request" and not answer.complete
    assert [probe.batch_size for probe in answer.probes] == [1, 2, 4]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(strategies=["nope"]), "unknown strategy 'nope'"),
        (dict(strategies=[]), "at least one strategy"),
        (dict(max_overhead=-0.1), "overhead limit"),
        (dict(max_overhead="lots"), "overhead limit"),
        (dict(time_limit_s=0), "time limit"),
        (dict(batch_limit=0), "batch limit"),
        (dict(strategies=["vdnn-all"]), "no transfer bandwidth"),
    ],
)
def test_bad_arguments_are_errors_before_any_work(options, message):
    with pytest.raises(MaxBatchError, match=message):
        max_batch(chain, 10**6, **options)


def test_the_default_budget_is_the_devices_memory():
    result = max_batch(chain, None, strategies=["keep-all"], batch_limit=8, throughput_probes=0)
    assert result.budget_bytes == 10**9 and result.strategies[0].max_batch_size == 8


def test_offloading_beats_recomputing_where_the_link_hides_it():
    """With a link fast enough to hide the copies, mosos fits more than recompute-only within 10% overhead."""
    profiles = lambda batch: chain(batch, per_sample=(3000, 3000, 3000, 3000, 3000, 3000), bandwidth=50.0)  # noqa: E731
    result = max_batch(profiles, 200_000, strategies=["recompute-only", "mosos"], max_overhead=0.1, time_limit_s=60,
                       workers=1, batch_limit=64, throughput_probes=0)
    recompute, mosos = result.strategies
    assert mosos.max_batch_size > recompute.max_batch_size
    assert mosos.at_max.schedule.summary.offloaded_bytes > 0


def test_a_batch_left_unsolved_by_a_time_limit_is_not_called_infeasible():
    def unsolved(profile, budget_bytes, **options):
        raise InfeasibleBudget("no plan found (UNKNOWN) within the time limit", proven=False)

    answer = max_batch(small_chain, 10**8, strategies=["keep-all"], max_overhead=None, solve=unsolved,
                       time_limit_s=5).strategies[0]
    assert answer.max_batch_size is None and not answer.complete
    assert answer.reason.startswith("no batch found to fit: batch 1 was not solved within its")

    def up_to_ten(profile, budget_bytes, **options):
        batch = int(profile.name.rsplit(" ", 1)[1])
        if batch > 10:
            raise InfeasibleBudget("no plan found (UNKNOWN) within the time limit", proven=False)
        return certify(profile, keep_all_schedule(profile, budget_bytes), options["strategy"])

    answer = max_batch(small_chain, 10**8, strategies=["keep-all"], max_overhead=None, solve=up_to_ten,
                       time_limit_s=5, throughput_probes=0).strategies[0]
    assert answer.max_batch_size == 10 and not answer.complete
    assert answer.unsettled_next().batch_size == 11


def test_a_search_that_ran_out_of_time_before_its_first_batch_says_so_not_that_none_fits():
    """`mosos max-batch --time-limit 5` spent its time building profiles and said "no batch fits"."""
    import time as clock

    def slow(batch):
        clock.sleep(0.4)
        return small_chain(batch)

    answer = max_batch(slow, 10**8, strategies=["keep-all"], max_overhead=None, time_limit_s=0.3,
                       throughput_probes=0).strategies[0]
    assert answer.max_batch_size is None and not answer.complete
    assert answer.reason.startswith("no batch found in time: the search stopped before batch 1 was solved"), answer


def test_solve_limits_below_the_first_ladder_step_are_the_smallest_solve():
    """Limits of 0.2155 and 0.2423 s made two runs of one question ask different solves (and miss the store)."""
    from planner.max_batch import MIN_SOLVE_S, _quantized

    assert _quantized(0.2155) == _quantized(0.2423) == MIN_SOLVE_S
    assert _quantized(0.3) == 0.25 and _quantized(7.9) == 6


@pytest.mark.parametrize("text, expected", [("10%", 0.1), ("0.1", 0.1), ("1", 1.0), ("150%", 1.5),
                                            ("forward", "forward"), ("none", None)])
def test_overhead_limits_read_as_written(text, expected):
    from planner.max_batch import parse_overhead

    assert parse_overhead(text) == expected


def test_a_bare_overhead_above_one_is_refused_as_a_percentage_without_its_sign():
    """`--max-overhead 10` was read as 1000% with no word: the search then allowed any recomputation."""
    from planner.max_batch import MaxBatchError, parse_overhead

    with pytest.raises(MaxBatchError, match=r"'10' as an overhead limit is 10 times the lower bound \(1000%\), most "
                                            r"likely a percentage without its sign: write 10% for 10 percent"):
        parse_overhead("10")

"""A command's --time-limit (cli/time_limit.py): the work stops at the limit even where it catches every
Exception, the message says what it was doing, and the process' alarm is left as it was found."""

from __future__ import annotations

import signal
import time

import pytest

from cli.time_limit import time_limited
from planner.errors import TimeLimitReached


def test_work_that_catches_every_exception_still_stops_at_the_limit():
    started = time.monotonic()
    with pytest.raises(TimeLimitReached) as raised:
        with time_limited(0.3, started) as watch:
            watch.note("compiling kernel 3")
            while time.monotonic() - started < 5:
                try:
                    sum(range(10_000))
                except Exception:  # noqa: BLE001 - as an export or an Inductor refusal handler does
                    pass
    took_s = time.monotonic() - started
    assert 0.3 <= took_s < 0.6, took_s
    message = str(raised.value)
    assert message.startswith("--time-limit 0.3 s ran out after 0.3 s: stopped while compiling kernel 3")
    assert message.endswith("nothing was written") and raised.value.exit_code == 4


def test_a_search_that_kept_to_the_deadline_is_told_as_the_limit():
    started = time.monotonic()
    with pytest.raises(TimeLimitReached, match="^--time-limit 60 s ran out after 0.0 s: no measuring schedule"):
        with time_limited(60, started):
            raise TimeLimitReached("no measuring schedule within the budget was found in the time left")


def test_the_alarm_is_left_as_it_was_found():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGALRM, mine)
    try:
        with time_limited(30, time.monotonic()) as watch:
            assert signal.getitimer(signal.ITIMER_REAL)[0] > 0 and watch.deadline is not None
        assert signal.getsignal(signal.SIGALRM) is mine and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        with time_limited(None, time.monotonic()) as watch:  # no limit: no alarm at all
            assert signal.getsignal(signal.SIGALRM) is mine and watch.deadline is None
    finally:
        signal.signal(signal.SIGALRM, previous)

"""A command's `--time-limit` over work that cannot take a deadline all the way down (a capture, an Inductor
compile, a measuring pass): at the limit the command stops where it is, says what it was doing, and has written
nothing.

The stop is SIGALRM's handler raising in the main thread, between two Python bytecodes, so a kernel or a solver
call that is running finishes first (the searches that can take a deadline get it as well, and end in time). What
it raises is a BaseException, as KeyboardInterrupt is: code that catches every Exception (an export failure made a
message, an Inductor refusal run eagerly) lets it through; and it repeats every half second after the limit, for
code that catches even that.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from planner.errors import MososError, TimeLimitReached

REPEAT_S = 0.5


# The process's start as a time.monotonic() instant, set by `mosos` itself (cli.app.main) before anything else;
# None where the commands run inside a longer process (tests, a notebook), which count from the command's start.
_process_started: float | None = None
STARTUP_AT_MOST_S = 30.0  # an older start is not this command's: it was not started as `mosos ...`


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc), so that a limit counts Python's start-up and imports
    as `time mosos ...` does: about 0.3 s before a command's first line runs. None where it cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        start_ticks = int(fields[19])  # field 22 of proc(5), counted from field 3
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):
        return None
    return age_s if 0.0 <= age_s <= STARTUP_AT_MOST_S else None


@contextmanager
def counted_from_process_start() -> Iterator[None]:
    """The commands run within it count their limits from the process's start (`mosos` itself runs them so)."""
    global _process_started
    age_s = process_age_s()
    _process_started = None if age_s is None else time.monotonic() - age_s
    try:
        yield
    finally:
        _process_started = None


def command_started() -> float:
    """Where a command's --time-limit counts from: the process's start when it runs as `mosos`, else now."""
    return time.monotonic() if _process_started is None else _process_started


class _TimeUp(BaseException):
    pass


class Stopwatch:
    """What the command is doing, for the message at the limit, and the limit as a `time.monotonic()` instant."""

    def __init__(self, started: float, seconds: float | None):
        self.started, self.seconds = started, seconds
        self.doing = "starting"

    @property
    def deadline(self) -> float | None:
        return None if self.seconds is None else self.started + self.seconds

    def note(self, doing: str) -> None:
        self.doing = doing


@contextmanager
def time_limited(seconds: float | None, started: float, option: str = "--time-limit") -> Iterator[Stopwatch]:
    """Run the block within `seconds` counted from `started` (`time.monotonic()`); None: no limit. At the limit,
    TimeLimitReached names the option, the time taken and what the block was doing."""
    watch = Stopwatch(started, seconds)
    if seconds is None:
        yield watch
        return
    if not hasattr(signal, "SIGALRM"):
        raise MososError(f"{option} needs SIGALRM, which this system does not have (Windows): leave it out")
    if threading.current_thread() is not threading.main_thread():
        raise MososError(f"{option} works only in a program's main thread (it stops the work with SIGALRM)")

    def stop(signum, frame):
        raise _TimeUp()

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(1e-3, watch.deadline - time.monotonic()), REPEAT_S)
    try:
        yield watch
    except (_TimeUp, TimeLimitReached) as error:  # the alarm's, or a search's that kept to the deadline
        signal.setitimer(signal.ITIMER_REAL, 0)
        what = f"stopped while {watch.doing}" if isinstance(error, _TimeUp) else str(error)
        raise TimeLimitReached(f"{option} {seconds:g} s ran out after {time.monotonic() - started:.1f} s: {what}; "
                               "nothing was written") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

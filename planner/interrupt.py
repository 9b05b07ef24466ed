"""Ctrl-C during `plan()`: stop every solve at once, then raise KeyboardInterrupt (a command exits 130, writes nothing).

CP-SAT catches SIGINT itself by default and ends only the solve it is in, as if its time limit had come, so a
strategy of many solves (baselines, the window search) went on to the next and `mosos plan` wrote its plan and
exited 0 after the whole limit; our solvers leave SIGINT alone (`planner.cpsat.callback.new_solver`). Python alone
cannot do it either: it runs its signal handlers in the main thread between bytecodes, not while CP-SAT searches in
C++, and with one worker a KeyboardInterrupt raised inside a solution callback is swallowed by OR-Tools. Here the
signal's byte, written by Python's C-level handler to a wakeup file descriptor the moment it arrives, is read by a
thread that sets an event; the solves' `should_stop` polls it (`StopWatcher`) and they stop within a fraction of a
second. Phases between the solves that run in Python (a reordering, the greedy pass, a bound's linear programs, on
a 2,000-node graph several seconds each) poll nothing, so while the block has not ended after Ctrl-C, KeyboardInterrupt
is raised in the main thread every NUDGE_S (`_thread.interrupt_main`): such a phase ends at its next bytecode (a
nudge swallowed by a solution callback is followed by the next). A second Ctrl-C raises KeyboardInterrupt at once.
Only in the main thread, and only where SIGINT is Python's KeyboardInterrupt.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
from collections.abc import Iterator

NUDGE_S = 0.25  # after Ctrl-C, how often the main thread is interrupted until the block ends


@contextlib.contextmanager
def stop_on_interrupt() -> Iterator[threading.Event]:
    """An event set by Ctrl-C (SIGINT) while the block runs; KeyboardInterrupt at the block's end if it was (also in
    place of whatever a stopped solve ended with). Outside the main thread, an event nothing sets."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        # signals are the main thread's only; and a process that ignores SIGINT (the service's solve processes) or
        # handles it its own way (a training script's graceful stop) keeps what it chose
        yield interrupted
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    ended = threading.Event()
    nudging = threading.Lock()  # no nudge once the block has ended

    def on_sigint(signum, frame) -> None:
        if interrupted.is_set():
            raise KeyboardInterrupt  # asked twice: at once, without waiting for the solver
        interrupted.set()

    def nudge() -> None:
        while not ended.wait(NUDGE_S):
            if interrupted.is_set():
                with nudging:
                    if not ended.is_set():
                        _thread.interrupt_main()  # runs on_sigint in the main thread: KeyboardInterrupt

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return  # the write end was closed: the block is over
            if signal.SIGINT in data:
                interrupted.set()

    previous_handler = signal.signal(signal.SIGINT, on_sigint)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="mosos-interrupt", daemon=True)
    nudger = threading.Thread(target=nudge, name="mosos-interrupt-nudge", daemon=True)
    watcher.start()
    nudger.start()
    try:
        yield interrupted
    except BaseException:
        if interrupted.is_set():  # what a stopped solve ended with ("no plan in time") is not the answer
            raise KeyboardInterrupt from None
        raise
    finally:
        while True:  # a nudge delivered as the block ends is taken here, not in the caller's code
            try:
                with nudging:
                    ended.set()
                break
            except KeyboardInterrupt:
                pass
        nudger.join(timeout=1.0)
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handler)
        os.close(write_fd)
        watcher.join(timeout=1.0)
        os.close(read_fd)
    if interrupted.is_set():
        raise KeyboardInterrupt

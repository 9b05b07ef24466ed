"""Live tensor storage on the CPU, from the allocator's own events, across the profiler's sessions.

On a GPU `torch.cuda.max_memory_allocated` answers "how much did this hold at
most"; on the CPU only torch.profiler's memory events (`profile_memory=True`)
see every allocation and free of c10's CPU allocator, tensor storages and
kernels' scratch alike. Kineto runs one session at a time, and the executor's
profiler needs its own session to measure each node's workspace. So an
`AllocationTrace` is a chain of sessions: when the profiler wants its own, the
trace stops its session, the profiler's session's events are handed to it as
well, and it starts a new one afterwards. The running sum over the chained
events is the rise of live storage since the trace began (nothing is allocated
in the instants between sessions but the profiler's own bookkeeping).

    with AllocationTrace() as trace:
        planned = executor.optimize(model, ...)
        planned(x).backward()
    trace.peak_bytes  # the most held at once beyond what was held when it began
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

_active: list["AllocationTrace"] = []
_lock = threading.Lock()


def _allocations(event_tree) -> list[tuple[int, int]]:
    """(time ns, signed bytes) of every CPU allocation and free in a kineto event tree."""
    found: list[tuple[int, int]] = []

    def visit(event):
        fields = event.extra_fields
        if hasattr(fields, "alloc_size") and str(getattr(fields, "device", "cpu")).startswith("cpu"):
            found.append((event.start_time_ns, fields.alloc_size))
        for child in event.children:
            visit(child)

    for root in event_tree:
        visit(root)
    return found


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null for the duration (kineto logs a line when a session starts and stops)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _Session:
    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self.recorder = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def start(self) -> None:
        with quiet_stderr():
            self.recorder.__enter__()

    def stop(self):
        with quiet_stderr():
            self.recorder.__exit__(None, None, None)
        return self.recorder.profiler.kineto_results.experimental_event_tree()


class AllocationTrace:
    """The peak rise of live CPU tensor storage over a block of code (see the module's docstring)."""

    def __init__(self):
        self.events: list[tuple[int, int]] = []
        self._session: _Session | None = None

    def __enter__(self) -> "AllocationTrace":
        with _lock:
            if _active:
                raise RuntimeError("an AllocationTrace is already running: kineto allows one session at a time")
            _active.append(self)
        self._session = _Session()
        self._session.start()
        return self

    def __exit__(self, *exc) -> None:
        self._pause()
        with _lock:
            _active.remove(self)

    def _pause(self) -> None:
        if self._session is not None:
            self.events.extend(_allocations(self._session.stop()))
            self._session = None

    def _resume(self) -> None:
        self._session = _Session()
        self._session.start()

    @property
    def peak_bytes(self) -> int:
        running = peak = 0
        for _, size in sorted(self.events, key=lambda item: item[0]):
            running += size
            peak = max(peak, running)
        return peak

    @property
    def held_bytes(self) -> int:
        """Still allocated at the end, of what was allocated inside."""
        return sum(size for _, size in self.events)


@contextlib.contextmanager
def memory_events() -> Iterator[list]:
    """A profiler session of the caller's own (the event tree is appended to the yielded list when it ends); an
    AllocationTrace running around it is paused for the duration and given the same events."""
    outer = _active[0] if _active else None
    if outer is not None:
        outer._pause()
    session = _Session()
    trees: list = []
    session.start()
    try:
        yield trees
    finally:
        tree = session.stop()
        trees.append(tree)
        if outer is not None:
            outer.events.extend(_allocations(tree))
            outer._resume()


def cpu_workspace_bytes(event_tree, groups: int) -> dict[int, int]:
    """From torch.profiler's event tree: per node scope, the peak of the running allocation total inside it less
    what is still allocated at its end (transient memory beyond what the node keeps)."""
    result: dict[int, int] = {}

    def allocations(event, found):
        for child in event.children:
            fields = child.extra_fields
            if hasattr(fields, "alloc_size") and str(getattr(fields, "device", "cpu")).startswith("cpu"):
                found.append((child.start_time_ns, fields.alloc_size))
            allocations(child, found)
        return found

    def visit(event):
        name = event.name
        if name.startswith("mosos-node:"):
            group = int(name.split(":", 1)[1])
            events = sorted(allocations(event, []), key=lambda e: e[0])
            running = peak = 0
            for _, size in events:
                running += size
                peak = max(peak, running)
            result[group] = max(0, peak - running)
            return
        for child in event.children:
            visit(child)

    for root in event_tree:
        visit(root)
    return result


__all__ = ["AllocationTrace", "cpu_workspace_bytes", "memory_events", "quiet_stderr"]

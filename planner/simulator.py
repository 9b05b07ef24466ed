"""The referee: replays a schedule on three streams and tracks memory to the byte.

Model (the executor follows the same rules):

- The compute stream runs compute operations in program order; `wait` makes it
  idle until a copy ends, and that idle time is stall.
- `offload j` starts on the device-to-host stream when both the compute stream
  reaches it and the stream is free; copies on one stream run one at a time.
- `prefetch j` allocates j's device buffer when the compute stream reaches it,
  and starts copying when the host-to-device stream is free and j's offload has
  finished. A computation may read j only after a `wait` for that prefetch.
- A compute allocates its output and its implementation's workspace when it
  starts; the workspace is released when it ends.
- `free j` releases j's device memory at once, or when the offload reading j
  ends if that is later.
- At equal times, events keep program order: a buffer freed before an
  allocation is issued is reusable by it, and a zero-time node's output still
  counts.

Peak memory is fixed memory plus the largest sum of live buffers at any
instant. A schedule that breaks a rule or the budget is rejected with the
first violation.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from planner.errors import BudgetError, ScheduleRejected
from planner.profile import GraphProfile
from planner.schedule import Compute, Free, Offload, Prefetch, Schedule, Wait

STREAMS = ("compute", "d2h", "h2d")


SpanKind = Literal["compute", "recompute", "offload", "prefetch", "stall"]


class Span(BaseModel):
    """One interval on one stream; `node` is the node computed, or the tensor copied or waited for."""

    stream: str
    label: str
    start_ms: float
    end_ms: float
    stage: int
    kind: SpanKind
    node: str
    implementation: str | None = None


class MemoryPoint(BaseModel):
    time_ms: float
    used_bytes: int


class SimulationFigures(BaseModel):
    """The headline numbers of one replay."""

    step_time_ms: float
    stall_time_ms: float
    compute_busy_ms: float
    d2h_busy_ms: float
    h2d_busy_ms: float
    recompute_time_ms: float
    peak_memory_bytes: int
    peak_time_ms: float
    fixed_memory_bytes: int
    budget_bytes: int | None
    offloaded_bytes: int
    prefetched_bytes: int
    implementations_changed: int


class SimulationResult(SimulationFigures):
    """The figures plus what a trace or a plot needs."""

    memory_timeline: list[MemoryPoint] = Field(default_factory=list)
    spans: list[Span] = Field(default_factory=list)

    def figures(self) -> dict:
        """The headline numbers, without timeline and spans."""
        return self.model_dump(exclude={"memory_timeline", "spans"})


@dataclass
class _MemoryEvent:
    time_ms: float
    delta_bytes: int
    sequence: int
    stage: int
    operation_index: int
    operation_object: object  # described only if a rejection names it (formatting every one is costly)
    tensor: str
    workspace: bool = False
    placed_bytes: int | None = None  # a workspace's part in the arena (its profile's arena_workspace_bytes)

    @property
    def arena_delta_bytes(self) -> int:
        """The change in what the arena holds: a workspace's placed part, else the whole buffer."""
        if self.placed_bytes is None:
            return self.delta_bytes
        return self.placed_bytes if self.delta_bytes > 0 else -self.placed_bytes

    @property
    def operation(self) -> str:
        text = self.operation_object.describe()
        return text + " (workspace)" if self.workspace else text


@dataclass
class _TensorState:
    on_device: bool = False
    prefetch_end_ms: float | None = None  # set while a prefetch has not been waited for
    offload_end_ms: float | None = None  # end of the latest offload
    has_host_copy: bool = False
    computed: bool = False


@dataclass
class _Replay:
    profile: GraphProfile
    budget_bytes: int | None
    compute_ms: float = 0.0
    d2h_ms: float = 0.0
    h2d_ms: float = 0.0
    compute_busy_ms: float = 0.0
    d2h_busy_ms: float = 0.0
    h2d_busy_ms: float = 0.0
    recompute_ms: float = 0.0
    offloaded_bytes: int = 0
    prefetched_bytes: int = 0
    implementations_changed: int = 0
    tensors: dict[str, _TensorState] = field(default_factory=dict)
    events: list[_MemoryEvent] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    computed_order: list[str] = field(default_factory=list)
    keep_spans: bool = True  # spans only when the caller keeps the timeline (a pydantic object per operation)

    def memory(self, time_ms, delta, stage, index, operation, tensor, workspace=False, placed_bytes=None):
        self.events.append(_MemoryEvent(time_ms, delta, len(self.events), stage, index, operation, tensor, workspace,
                                        placed_bytes))

    def span(self, stream: str, label, start_ms: float, end_ms: float, stage: int, kind: str, node: str,
             implementation: str | None = None) -> None:
        """`label`: a callable, formatted only when spans are kept."""
        if self.keep_spans:
            self.spans.append(Span(stream=stream, label=label(), start_ms=start_ms, end_ms=end_ms, stage=stage, kind=kind,
                                   node=node, implementation=implementation))


def _reject(reason: str, stage: int, index: int, operation, tensor: str | None = None, **extra) -> ScheduleRejected:
    return ScheduleRejected(
        reason, stage=stage, operation_index=index, operation=operation.describe(), tensor=tensor, **extra
    )


def simulate(
    profile: GraphProfile,
    schedule: Schedule,
    budget_bytes: int | None = None,
    *,
    check_digest: bool = True,
    keep_timeline: bool = True,
) -> SimulationResult:
    """Replay `schedule`; the budget defaults to the schedule's own."""
    if check_digest and schedule.profile_digest != profile.digest():
        raise ScheduleRejected(
            f"the schedule was made for another profile ({schedule.profile_name!r}, digest "
            f"{schedule.profile_digest[:12]}) than this one ({profile.name!r}, digest {profile.digest()[:12]})"
        )
    budget = schedule.budget_bytes if budget_bytes is None else budget_bytes
    if budget is not None and budget < 0:
        raise BudgetError(f"a memory budget cannot be negative: {budget} bytes")
    try:
        return _replay_schedule(profile, schedule, budget, keep_timeline)
    except ScheduleRejected as rejection:
        path = schedule.path_of(rejection.operation_index) if rejection.operation_index is not None else None
        if path is None or rejection.path is not None:
            raise
        raise rejection.located(path) from None


def _replay_schedule(profile: GraphProfile, schedule: Schedule, budget: int | None, keep_timeline: bool) -> SimulationResult:
    replay = _run_operations(profile, schedule, budget, keep_timeline)
    result = _finish(replay, keep_timeline)
    if schedule.arena_bytes is not None:
        _check_addresses(replay, schedule)
    return result


def _run_operations(profile: GraphProfile, schedule: Schedule, budget: int | None, keep_timeline: bool) -> _Replay:
    replay = _Replay(
        profile, budget, tensors={node_id: _TensorState() for node_id in profile.order}, keep_spans=keep_timeline
    )
    handlers = {Compute: _compute, Offload: _offload, Prefetch: _prefetch, Wait: _wait, Free: _free}
    try:
        for stage, index, operation in schedule.operations():
            handlers[type(operation)](replay, stage, index, operation)
        _check_complete(profile, schedule, replay)
    except ScheduleRejected as rejection:
        # an earlier operation may already have passed the budget: that is the first violation
        raise _over_budget_so_far(replay) or rejection from None
    return replay


@dataclass(frozen=True)
class Allocation:
    """One buffer the step allocates on the device: a computation's output or workspace, or a prefetched copy.
    `start` and `end` count memory events in the simulator's order (time, then program order): the buffer is live
    from its allocation's event up to, not including, its release's; `end` None: still live when the step ends."""

    operation_index: int  # in program order, as Schedule.operations() counts
    stage: int
    tensor: str
    workspace: bool
    size_bytes: int
    start: int
    end: int | None


def allocations(profile: GraphProfile, schedule: Schedule) -> list[Allocation]:
    """Every buffer of a valid schedule with its lifetime, in allocation order: what planned addresses place."""
    replay = _run_operations(profile, schedule, None, keep_timeline=False)
    return _allocations(replay)


def _allocations(replay: _Replay) -> list[Allocation]:
    events = sorted(replay.events, key=lambda e: (e.time_ms, e.sequence))
    # a free releases the oldest copy of its tensor: a prefetch issued while the offload of the copy it replaces
    # still runs holds a second copy until that offload ends
    opened: dict[tuple[str, bool], deque[int]] = defaultdict(deque)
    found: list[tuple[_MemoryEvent, int, int | None]] = []
    for position, event in enumerate(events):
        key = (event.tensor, event.workspace)
        if event.arena_delta_bytes > 0:
            opened[key].append(len(found))
            found.append((event, position, None))
        elif event.arena_delta_bytes < 0:
            slot = opened[key].popleft()
            found[slot] = (found[slot][0], found[slot][1], position)
        # a zero-byte buffer needs no place
    return [Allocation(e.operation_index, e.stage, e.tensor, e.workspace, e.arena_delta_bytes, start, end)
            for e, start, end in found]


def _check_addresses(replay: _Replay, schedule: Schedule) -> None:
    """Planned addresses hold: every buffer has an offset, lies inside the arena, overlaps no live buffer, and
    fixed memory plus the arena fits the budget (the arena is allocated whole, whatever is live in it)."""
    arena = schedule.arena_bytes
    fixed = replay.profile.fixed_bytes
    budget = replay.budget_bytes
    if budget is not None and fixed + arena > budget:
        raise ScheduleRejected(
            f"the arena of planned addresses ({arena} bytes) and fixed memory ({fixed} bytes) take {fixed + arena} "
            f"bytes, {fixed + arena - budget} bytes over the budget of {budget} bytes",
            over_budget_bytes=fixed + arena - budget, path="arena_bytes")
    live_starts: list[int] = []  # offsets of live buffers, sorted; they never overlap one another
    live: dict[int, tuple[int, str]] = {}  # offset -> (end offset, what)
    where: dict[tuple[str, bool], deque[int]] = defaultdict(deque)  # the offsets of each tensor's copies, oldest first
    for event in replay.events:  # _finish sorted them (time, then program order)
        key = (event.tensor, event.workspace)
        size_bytes = event.arena_delta_bytes  # a workspace takes its placed part of the arena
        if size_bytes < 0:
            offset = where[key].popleft()
            live.pop(offset)
            live_starts.pop(bisect_left(live_starts, offset))
            continue
        if size_bytes == 0:
            continue
        operation = event.operation_object
        offset = operation.workspace_offset_bytes if event.workspace else operation.offset_bytes
        def reject(reason: str, event=event) -> ScheduleRejected:
            field_name = "workspace_offset_bytes" if event.workspace else "offset_bytes"
            return ScheduleRejected(reason, stage=event.stage, operation_index=event.operation_index,
                                    operation=event.operation, tensor=event.tensor,
                                    path=f"{schedule.path_of(event.operation_index)}.{field_name}")

        what = f"{'the workspace of ' if event.workspace else ''}{event.tensor!r}"
        if offset is None:
            raise reject(f"the schedule has planned addresses (arena_bytes) but {what} ({size_bytes} bytes) "
                         "has no offset")
        end = offset + size_bytes
        if end > arena:
            raise reject(f"{what} at offset {offset} ends at {end} bytes, past the arena of {arena} bytes")
        k = bisect_left(live_starts, offset)
        neighbours = ([live_starts[k - 1]] if k else []) + ([live_starts[k]] if k < len(live_starts) else [])
        for other in neighbours:
            other_end, other_what = live[other]
            if other < end and offset < other_end:
                raise reject(f"{what} at [{offset}, {end}) overlaps {other_what} at [{other}, {other_end}), "
                             "which is still live")
        live_starts.insert(k, offset)
        live[offset] = (end, what)
        where[key].append(offset)


def _check_complete(profile: GraphProfile, schedule: Schedule, replay: _Replay) -> None:
    never = [node_id for node_id in profile.order if not replay.tensors[node_id].computed]
    if never:
        raise ScheduleRejected(f"node {never[0]!r} is never computed ({len(never)} node(s) missing)")
    if replay.computed_order != schedule.compute_order:
        mismatch = next(
            (
                i
                for i, (a, b) in enumerate(zip(replay.computed_order, schedule.compute_order))
                if a != b
            ),
            min(len(replay.computed_order), len(schedule.compute_order)),
        )
        def at(order: list[str]) -> str:
            return repr(order[mismatch]) if mismatch < len(order) else "nothing more"

        raise ScheduleRejected(
            f"compute_order disagrees with the operations at position {mismatch}: the operations compute "
            f"{at(replay.computed_order)} there, compute_order lists {at(schedule.compute_order)} "
            f"({len(replay.computed_order)} computations against {len(schedule.compute_order)})"
        )


def _check_random_order(replay: _Replay, node, stage: int, index: int, operation: Compute) -> None:
    """A node that draws random numbers first runs after every such node listed before it: drawing in another order
    gives each other numbers than the step's (a recomputation draws its first run's again)."""
    drawing = replay.profile.drawing_order
    k = drawing.index(node.id)
    if k and not replay.tensors[drawing[k - 1]].computed:  # the one before was checked against its own, and so on
        earlier = next(other for other in drawing[:k] if not replay.tensors[other].computed)
        raise _reject(f"{node.id!r} draws random numbers before {earlier!r}, which draws first in the step",
                      stage, index, operation, node.id)


def _compute(replay: _Replay, stage: int, index: int, operation: Compute) -> None:
    node = replay.profile.node_by_id.get(operation.node)
    if node is None:
        raise _reject(f"{operation.node!r} is not a node of the profile", stage, index, operation, operation.node)
    try:
        implementation = node.implementation(operation.implementation)
    except KeyError:
        known = ", ".join(impl.name for impl in node.implementations)
        raise _reject(
            f"node {node.id!r} has no implementation {operation.implementation!r} (it has: {known})",
            stage,
            index,
            operation,
            node.id,
        ) from None
    for source in dict.fromkeys(node.inputs):
        state = replay.tensors[source]
        if not state.on_device:
            raise _reject(
                f"missing input: {node.id!r} reads {source!r}, which is not on the device", stage, index, operation, source
            )
        if state.prefetch_end_ms is not None:
            raise _reject(
                f"{node.id!r} reads {source!r} before waiting for its prefetch", stage, index, operation, source
            )
    state = replay.tensors[node.id]
    if node.draws_random and not state.computed:
        _check_random_order(replay, node, stage, index, operation)
    if node.kind == "backward" and not state.computed:
        waiting = next((loss for loss in replay.profile.loss_ids if not replay.tensors[loss].computed), None)
        if waiting is not None:
            raise _reject(f"backward node {node.id!r} is computed before the loss {waiting!r}: the backward pass starts "
                          "from the loss", stage, index, operation, node.id)
    if state.on_device:
        raise _reject(f"{node.id!r} is computed while its output is still on the device", stage, index, operation, node.id)
    if state.prefetch_end_ms is not None:
        raise _reject(f"{node.id!r} is computed while its prefetch is in flight", stage, index, operation, node.id)
    start = replay.compute_ms
    end = start + implementation.time_ms
    replay.memory(start, node.size_bytes, stage, index, operation, node.id)
    if implementation.workspace_bytes:
        placed = implementation.arena_workspace_bytes
        replay.memory(start, implementation.workspace_bytes, stage, index, operation, node.id, workspace=True,
                      placed_bytes=placed)
        replay.memory(end, -implementation.workspace_bytes, stage, index, operation, node.id, workspace=True,
                      placed_bytes=placed)
    recomputed = state.computed
    if recomputed:
        replay.recompute_ms += implementation.time_ms
    if implementation.name != node.fastest.name:
        replay.implementations_changed += 1
    state.computed = True
    state.on_device = True
    replay.compute_ms = end
    replay.compute_busy_ms += implementation.time_ms
    replay.computed_order.append(node.id)
    replay.span("compute", lambda: f"{node.label} [{implementation.name}]", start, end, stage,
                "recompute" if recomputed else "compute", node.id, implementation.name)


def _known_tensor(replay: _Replay, stage: int, index: int, operation, tensor: str) -> _TensorState:
    state = replay.tensors.get(tensor)
    if state is None:
        raise _reject(f"{tensor!r} is not a node of the profile", stage, index, operation, tensor)
    return state


def _offload(replay: _Replay, stage: int, index: int, operation: Offload) -> None:
    hardware = replay.profile.hardware
    if hardware.d2h_bandwidth_gb_per_s is None:
        raise _reject("the profile has no device-to-host bandwidth, so nothing can be offloaded", stage, index, operation, operation.tensor)
    state = _known_tensor(replay, stage, index, operation, operation.tensor)
    if not state.on_device:
        raise _reject(f"{operation.tensor!r} is offloaded but is not on the device", stage, index, operation, operation.tensor)
    if state.prefetch_end_ms is not None:
        raise _reject(f"{operation.tensor!r} is offloaded before its prefetch was waited for", stage, index, operation, operation.tensor)
    size = replay.profile.node_by_id[operation.tensor].size_bytes
    start = max(replay.compute_ms, replay.d2h_ms)
    duration = hardware.offload_time_ms(size)
    end = start + duration
    replay.d2h_ms = end
    replay.d2h_busy_ms += duration
    replay.offloaded_bytes += size
    state.offload_end_ms = end
    state.has_host_copy = True
    replay.span("d2h", lambda: f"offload {operation.tensor}", start, end, stage, "offload", operation.tensor)


def _prefetch(replay: _Replay, stage: int, index: int, operation: Prefetch) -> None:
    hardware = replay.profile.hardware
    if hardware.h2d_bandwidth_gb_per_s is None:
        raise _reject("the profile has no host-to-device bandwidth, so nothing can be prefetched", stage, index, operation, operation.tensor)
    state = _known_tensor(replay, stage, index, operation, operation.tensor)
    if not state.has_host_copy:
        raise _reject(f"{operation.tensor!r} is prefetched but was never offloaded", stage, index, operation, operation.tensor)
    if state.on_device:
        raise _reject(f"{operation.tensor!r} is prefetched while already on the device", stage, index, operation, operation.tensor)
    size = replay.profile.node_by_id[operation.tensor].size_bytes
    replay.memory(replay.compute_ms, size, stage, index, operation, operation.tensor)
    start = max(replay.compute_ms, replay.h2d_ms, state.offload_end_ms or 0.0)
    duration = hardware.prefetch_time_ms(size)
    end = start + duration
    replay.h2d_ms = end
    replay.h2d_busy_ms += duration
    replay.prefetched_bytes += size
    state.on_device = True
    state.prefetch_end_ms = end
    replay.span("h2d", lambda: f"prefetch {operation.tensor}", start, end, stage, "prefetch", operation.tensor)


def _wait(replay: _Replay, stage: int, index: int, operation: Wait) -> None:
    state = _known_tensor(replay, stage, index, operation, operation.tensor)
    if operation.transfer == "prefetch":
        if state.prefetch_end_ms is None:
            raise _reject(f"there is no prefetch of {operation.tensor!r} in flight to wait for", stage, index, operation, operation.tensor)
        end = state.prefetch_end_ms
        state.prefetch_end_ms = None
    else:
        if state.offload_end_ms is None:
            raise _reject(f"{operation.tensor!r} was never offloaded, so there is nothing to wait for", stage, index, operation, operation.tensor)
        end = state.offload_end_ms
    if end > replay.compute_ms:
        replay.span("compute", lambda: f"stall: {operation.describe()}", replay.compute_ms, end, stage, "stall",
                    operation.tensor)
        replay.compute_ms = end


def _free(replay: _Replay, stage: int, index: int, operation: Free) -> None:
    state = _known_tensor(replay, stage, index, operation, operation.tensor)
    if not state.on_device:
        raise _reject(f"{operation.tensor!r} is freed but is not on the device", stage, index, operation, operation.tensor)
    if state.prefetch_end_ms is not None:
        raise _reject(f"{operation.tensor!r} is freed while its prefetch is in flight", stage, index, operation, operation.tensor)
    release = max(replay.compute_ms, state.offload_end_ms or 0.0)
    size = replay.profile.node_by_id[operation.tensor].size_bytes
    replay.memory(release, -size, stage, index, operation, operation.tensor)
    state.on_device = False


def _fixed_over_budget(fixed: int, budget: int | None) -> ScheduleRejected | None:
    if budget is None or fixed <= budget:
        return None
    return ScheduleRejected(
        f"fixed memory alone ({fixed} bytes) is {fixed - budget} bytes over the budget ({budget} bytes)",
        over_budget_bytes=fixed - budget,
        time_ms=0.0,
    )


def _event_over_budget(event: _MemoryEvent, used: int, budget: int) -> ScheduleRejected:
    return ScheduleRejected(
        f"memory reaches {used} bytes at {event.time_ms:.6g} ms, {used - budget} bytes over the budget "
        f"of {budget} bytes",
        stage=event.stage,
        operation_index=event.operation_index,
        operation=event.operation,
        tensor=event.tensor,
        over_budget_bytes=used - budget,
        time_ms=event.time_ms,
    )


def _over_budget_so_far(replay: _Replay) -> ScheduleRejected | None:
    """The budget passed by the operations replayed so far. Final: whatever comes later in the schedule releases
    memory no earlier than the compute stream's time when it is issued, so it can undo no moment already passed."""
    budget = replay.budget_bytes
    if budget is None:
        return None
    used = replay.profile.fixed_bytes
    if (fixed := _fixed_over_budget(used, budget)) is not None:
        return fixed
    for event in sorted(replay.events, key=lambda e: (e.time_ms, e.sequence)):
        if event.time_ms > replay.compute_ms:
            break  # a workspace's release at the end of the computation that was running
        used += event.delta_bytes
        if event.delta_bytes > 0 and used > budget:
            return _event_over_budget(event, used, budget)
    return None


def peak_at_optimizer_step(profile: GraphProfile, result: SimulationFigures) -> bool:
    """Whether the peak is the optimizer step's moment, its temporaries on what the backward left."""
    step_bytes = profile.fixed_memory.optimizer_step_bytes
    return bool(step_bytes) and result.peak_time_ms == result.step_time_ms and (
        result.peak_memory_bytes >= profile.fixed_bytes + step_bytes)


def _optimizer_step(used: int, step_bytes: int, step_ms: float, budget: int | None, peak: int,
                    peak_time_ms: float) -> tuple[int, float]:
    """The optimizer's step at the end, its temporaries on what the backward left: the new peak and its time."""
    during = used + step_bytes
    if budget is not None and during > budget:
        raise ScheduleRejected(
            f"the optimizer's step takes {step_bytes} bytes of temporaries after the backward: memory reaches "
            f"{during} bytes at {step_ms:.6g} ms, {during - budget} bytes over the budget of {budget} bytes",
            operation="optimizer step", over_budget_bytes=during - budget, time_ms=step_ms,
        )
    return (during, step_ms) if during > peak else (peak, peak_time_ms)


def _finish(replay: _Replay, keep_timeline: bool) -> SimulationResult:
    fixed = replay.profile.fixed_bytes
    budget = replay.budget_bytes
    if (rejection := _fixed_over_budget(fixed, budget)) is not None:
        raise rejection
    replay.events.sort(key=lambda e: (e.time_ms, e.sequence))
    used = fixed
    peak, peak_time = fixed, 0.0
    timeline = [MemoryPoint(time_ms=0.0, used_bytes=fixed)] if keep_timeline else []
    for event in replay.events:
        used += event.delta_bytes
        if event.delta_bytes > 0 and budget is not None and used > budget:
            raise _event_over_budget(event, used, budget)
        if used > peak:
            peak, peak_time = used, event.time_ms
        if keep_timeline:
            timeline.append(MemoryPoint(time_ms=event.time_ms, used_bytes=used))
    step = max(replay.compute_ms, replay.d2h_ms, replay.h2d_ms)
    if step_bytes := replay.profile.fixed_memory.optimizer_step_bytes:
        peak, peak_time = _optimizer_step(used, step_bytes, step, budget, peak, peak_time)
        if keep_timeline:
            timeline += [MemoryPoint(time_ms=step, used_bytes=used + step_bytes),
                         MemoryPoint(time_ms=step, used_bytes=used)]
    return SimulationResult(
        step_time_ms=step,
        stall_time_ms=max(0.0, step - replay.compute_busy_ms),
        compute_busy_ms=replay.compute_busy_ms,
        d2h_busy_ms=replay.d2h_busy_ms,
        h2d_busy_ms=replay.h2d_busy_ms,
        recompute_time_ms=replay.recompute_ms,
        peak_memory_bytes=peak,
        peak_time_ms=peak_time,
        fixed_memory_bytes=fixed,
        budget_bytes=budget,
        offloaded_bytes=replay.offloaded_bytes,
        prefetched_bytes=replay.prefetched_bytes,
        implementations_changed=replay.implementations_changed,
        memory_timeline=timeline,
        spans=replay.spans if keep_timeline else [],
    )

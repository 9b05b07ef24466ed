"""Decision variables: the copies of each tensor and its offload.

A *copy* is one stay of a tensor in device memory, as an interval of
positions [start, end]: the first computation (stage j), a recomputation
(some later stage), or a prefetch (buffer from the start of its stage). This
is MO-SOS's R/S/P/FREE information in O(n) variables per tensor: R[t,k,v] is
"copy of k with stage t and implementation v", S[t,j] is "some copy of j
covers the start of stage t", FREE is the end of a copy. Copies that can
never be useful are not created (pruning).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from planner.cpsat.data import ModelData


@dataclass
class Copy:
    tensor: int
    kind: str  # "original", "recompute" or "prefetch"
    rank: int
    present: cp_model.IntVar
    stage: cp_model.IntVar | int  # compute stage, or the stage where the prefetch is issued
    start: cp_model.LinearExprT
    end: cp_model.IntVar
    interval: cp_model.IntervalVar
    # compute copies: one Boolean per implementation
    implementations: list[cp_model.IntVar] = field(default_factory=list)
    ready_stage: cp_model.IntVar | None = None  # prefetch copies: first stage that may read it without waiting
    early: cp_model.IntVar | None = None  # prefetch copies: read before ready_stage, the wait charged in full
    stage_low: int = 0
    stage_high: int = 0
    # transfer copies: the stages allowed and the index of the one chosen (element constraints index by it)
    stage_choices: list[int] = field(default_factory=list)
    choice: cp_model.IntVar | None = None
    # a copy of a tensor fixed to an incumbent's value (window search): every field above is a constant
    fixed: bool = False

    @property
    def computes(self) -> bool:
        return self.kind != "prefetch"


@dataclass
class Offload:
    tensor: int
    present: cp_model.IntVar
    stage: cp_model.IntVar
    done_stage: cp_model.IntVar
    stage_low: int = 0
    stage_choices: list[int] = field(default_factory=list)
    choice: cp_model.IntVar | None = None
    fixed: bool = False


@dataclass
class FixedPart:
    """Tensors whose copies and offload are fixed to a known solution (the rest of the model is free).

    `copies[j]`: the copies of tensor j that the solution has (absent ones are simply not created), with
    their stage, end, implementation and early flag; `offloads[j]`: the stage of j's offload, if it has one.
    """

    copies: dict[int, list] = field(default_factory=dict)
    offloads: dict[int, int] = field(default_factory=dict)

    def __contains__(self, tensor: int) -> bool:
        return tensor in self.copies


@dataclass
class Variables:
    model: cp_model.CpModel
    copies: list[list[Copy]]
    offloads: dict[int, Offload]
    capacity: cp_model.IntVar | int
    uses: dict[tuple[int, int, int], list[tuple[Copy, cp_model.IntVar]]] = field(default_factory=dict)
    # (reader copy id, input tensor) -> candidate serving copies with their choice literal
    # proto indices of the variables that describe tensor j's copies and offload (what fixing j means)
    tensor_vars: list[range] = field(default_factory=list)
    fixed: FixedPart = field(default_factory=FixedPart)

    def is_fixed(self, tensor: int) -> bool:
        return tensor in self.fixed


def _last_true(low: int, high: int, holds) -> int | None:
    """The largest x in [low, high] where `holds` (true on a prefix of the range, then false), or None."""
    if low > high or not holds(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if holds(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _offload_window(data: ModelData, j: int) -> tuple[int, int] | None:
    """Stages at which offloading j can still pay off (a prefetch completes before a reader), or None.

    The stage timing only grows with the issue stage, so the stages that pay off are a prefix: a binary search.
    """
    if not data.transfers or not data.users[j] or data.max_prefetches(j) < 1:
        return None
    last_reader_stage = max(data.last_stage_of_copies(u) for u in data.users[j])

    def pays_off(a: int) -> bool:
        done = data.offload_done(j, a)
        return done < data.n and data.prefetch_done(j, done) <= last_reader_stage

    last = _last_true(j + 1, data.n - 1, pays_off)
    return None if last is None else (j + 1, last)


def _prefetch_window(data: ModelData, j: int, first_offload_stage: int) -> tuple[int, int] | None:
    last_reader_stage = max(data.last_stage_of_copies(u) for u in data.users[j])
    first = data.offload_done(j, first_offload_stage)
    last = _last_true(first, data.n - 1, lambda p: data.prefetch_done(j, p) <= last_reader_stage)
    return None if last is None else (first, last)


# Transfers start only at a few stages each: the right after its computation (offload) and just in
# time for each reader (prefetch), plus a little slack for the one-copy-at-a-time streams. This keeps
# the element constraints of the stage timing small; a wider choice buys little and costs presolve.
OFFLOAD_CHOICES = 3
PREFETCH_SLACK = 2
# ... and a few later (offload) or earlier (prefetch) stages, further and further apart, so that a copy can
# queue behind others on a busy link (what the swap heuristics' plans do, and what fills the link).
QUEUE_OFFSETS = (5, 8, 13, 21)


def _offload_stages(data: ModelData, j: int, window: tuple[int, int]) -> list[int]:
    chosen = set(range(window[0], min(window[1], window[0] + OFFLOAD_CHOICES - 1) + 1))
    chosen.update(window[0] + offset - 1 for offset in QUEUE_OFFSETS if window[0] + offset - 1 <= window[1])
    chosen.update(a for a in data.extensions.offload_stages.get(data.ids[j], ()) if window[0] <= a <= window[1])
    return sorted(chosen)


def _prefetch_stages(data: ModelData, j: int, window: tuple[int, int]) -> list[int]:
    low, high = window
    chosen: set[int] = set()
    for u in data.users[j]:
        latest = _last_true(low, min(high, u), lambda p: data.prefetch_done(j, p) <= u)
        if latest is not None:
            chosen.update(p for p in range(latest - PREFETCH_SLACK, latest + 1) if p >= low)
            chosen.update(latest - offset for offset in QUEUE_OFFSETS if latest - offset >= low)
        if low <= u <= high:
            chosen.add(u)  # issued in the reader's own stage: read early, the wait charged
    chosen.update(p for p in data.extensions.prefetch_stages.get(data.ids[j], ()) if low <= p <= high)
    return sorted(p for p in chosen if data.prefetch_done(j, p) <= data.n)  # one that never lands is no choice


def _stage_choice(model: cp_model.CpModel, stages: list[int], name: str):
    """(stage variable, index variable) over a few allowed stages; the index keeps element constraints short."""
    index = model.new_int_var(0, len(stages) - 1, f"{name}_choice")
    stage = model.new_int_var_from_domain(cp_model.Domain.from_values(stages), name)
    model.add_element(index, stages, stage)
    return stage, index


def _implementation_literals(model: cp_model.CpModel, data: ModelData, k: int, present, name: str) -> list:
    if len(data.impls[k]) == 1:
        return [present]
    literals = [model.new_bool_var(f"{name}_impl{i}") for i in range(len(data.impls[k]))]
    model.add(sum(literals) == present)
    return literals


KIND_ORDER = {"original": 0, "recompute": 1, "prefetch": 2}


def _fixed_tensor(model: cp_model.CpModel, data: ModelData, j: int, fixed: FixedPart) -> tuple[list[Copy], Offload | None]:
    """Tensor j's copies and offload as constants: fixed intervals in the memory and transfer constraints."""
    tensor_copies = []
    for solved in sorted(fixed.copies[j], key=lambda c: (KIND_ORDER[c.kind], c.rank)):
        interval = model.new_fixed_size_interval_var(
            solved.start, solved.end + 1 - solved.start, f"fixed_{j}_{solved.kind}{solved.rank}"
        )
        copy = Copy(j, solved.kind, solved.rank, 1, solved.stage, solved.start, solved.end, interval,
                    stage_low=solved.stage, stage_high=solved.stage, fixed=True)
        if copy.computes:
            copy.implementations = [int(i == solved.implementation) for i in range(len(data.impls[j]))]
        else:
            copy.ready_stage = data.prefetch_done(j, solved.stage)
            copy.early = int(solved.early)
            copy.stage_choices = [solved.stage]
        tensor_copies.append(copy)
    offload = None
    if j in fixed.offloads:
        stage = fixed.offloads[j]
        offload = Offload(j, 1, stage, data.offload_done(j, stage), stage_low=stage, stage_choices=[stage], fixed=True)
    return tensor_copies, offload


def create_variables(model: cp_model.CpModel, data: ModelData, fixed: FixedPart | None = None) -> Variables:
    """The model's variables; the tensors in `fixed` get constants instead (a window of the window search)."""
    fixed = fixed or FixedPart()
    n = data.n
    capacity: cp_model.IntVar | int = data.capacity_units
    if data.features.minimize_memory:
        capacity = model.new_int_var(0, data.capacity_units, "capacity")
    copies: list[list[Copy]] = []
    offloads: dict[int, Offload] = {}
    tensor_vars: list[range] = []
    for j in range(n):
        if j % 64 == 0:
            data.check_time()
        first_var = len(model.proto.variables)
        if j in fixed:
            tensor_copies, offload = _fixed_tensor(model, data, j, fixed)
            copies.append(tensor_copies)
            if offload is not None:
                offloads[j] = offload
            tensor_vars.append(range(first_var, first_var))
            continue
        last_use = data.last_use_position(j)
        window = _offload_window(data, j)
        hold = data.offload_done(j, window[1]) * data.stride - 1 if window else -1
        start = data.pos(j, j)
        end = model.new_int_var(start, max(start, last_use, hold), f"end_{j}_0")
        one = model.new_bool_var(f"present_{j}_0")
        model.add(one == 1)
        original = Copy(j, "original", 0, one, j, start, end, None, stage_low=j, stage_high=j)  # type: ignore[arg-type]
        original.interval = model.new_interval_var(start, end + 1 - start, end + 1, f"mem_{j}_0")
        original.implementations = _implementation_literals(model, data, j, one, f"c_{j}_0")
        tensor_copies = [original]
        if data.features.recompute and data.recomputable[j]:
            last_stage = max(data.last_stage_of_copies(u) for u in data.users[j])
            for r in range(1, data.max_recomputes(j) + 1):
                if j + 1 > last_stage:
                    break
                present = model.new_bool_var(f"present_{j}_r{r}")
                stage = model.new_int_var(j + 1, last_stage, f"stage_{j}_r{r}")
                start_expr = stage * data.stride + 1 + j
                end_r = model.new_int_var(data.pos(j + 1, j), max(data.pos(j + 1, j), last_use), f"end_{j}_r{r}")
                size = model.new_int_var(0, max(1, last_use - data.pos(j + 1, j) + 1), f"size_{j}_r{r}")
                interval = model.new_optional_interval_var(start_expr, size, end_r + 1, present, f"mem_{j}_r{r}")
                copy = Copy(j, "recompute", r, present, stage, start_expr, end_r, interval,
                            stage_low=j + 1, stage_high=last_stage)
                copy.implementations = _implementation_literals(model, data, j, present, f"c_{j}_r{r}")
                tensor_copies.append(copy)
        if window:
            offload_present = model.new_bool_var(f"offload_{j}")
            offload_stages = _offload_stages(data, j, window)
            stage, choice = _stage_choice(model, offload_stages, f"offload_stage_{j}")
            done = model.new_int_var(0, n, f"offload_done_{j}")
            model.add_element(choice, [data.offload_done(j, a) for a in offload_stages], done)
            offloads[j] = Offload(j, offload_present, stage, done, stage_low=offload_stages[0],
                                  stage_choices=offload_stages, choice=choice)
            prefetch_window = _prefetch_window(data, j, window[0])
            prefetch_stages = _prefetch_stages(data, j, prefetch_window) if prefetch_window else []
            for p in range(1, data.max_prefetches(j) + 1 if prefetch_stages else 1):
                low, high = prefetch_stages[0], prefetch_stages[-1]
                present = model.new_bool_var(f"present_{j}_p{p}")
                stage, choice = _stage_choice(model, prefetch_stages, f"prefetch_stage_{j}_p{p}")
                ready = model.new_int_var(0, n, f"prefetch_ready_{j}_p{p}")
                model.add_element(choice, [data.prefetch_done(j, a) for a in prefetch_stages], ready)
                start_expr = stage * data.stride
                end_p = model.new_int_var(data.stage_slot(low), max(data.stage_slot(low), last_use), f"end_{j}_p{p}")
                size = model.new_int_var(0, max(1, last_use - data.stage_slot(low) + 1), f"size_{j}_p{p}")
                interval = model.new_optional_interval_var(start_expr, size, end_p + 1, present, f"mem_{j}_p{p}")
                early = model.new_bool_var(f"early_{j}_p{p}")
                model.add_implication(early, present)
                tensor_copies.append(
                    Copy(j, "prefetch", p, present, stage, start_expr, end_p, interval,
                         ready_stage=ready, early=early, stage_low=low, stage_high=high,
                         stage_choices=prefetch_stages, choice=choice)
                )
        copies.append(tensor_copies)
        tensor_vars.append(range(first_var, len(model.proto.variables)))
    return Variables(model, copies, offloads, capacity, tensor_vars=tensor_vars, fixed=fixed)

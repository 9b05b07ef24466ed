"""One function per constraint family of MO-SOS (numbers refer to ../shared/design/MO-SOS.md).

(2)/(3) one implementation per computation and the first computation in its
own stage are built into the variables (`variables.py`); the families below
add the rest.
"""

from __future__ import annotations

from ortools.sat.python import cp_model

from planner.cpsat.data import ModelData
from planner.cpsat.variables import Copy, Variables


def _max_stage(data: ModelData, copy: Copy) -> int:
    return copy.stage_high


def _min_stage(copy: Copy) -> int:
    return copy.stage_low


def _only_if(model: cp_model.CpModel, condition, literals) -> None:
    """`condition` enforced by `literals`; a condition between two constants (fixed copies) is a plain bool."""
    if isinstance(condition, bool):
        if not condition:
            model.add_bool_or([~literal for literal in literals])
        return
    model.add(condition).only_enforce_if(literals)


def add_copy_shapes(model: cp_model.CpModel, data: ModelData, v: Variables) -> None:
    """A present copy ends at or after it starts; an absent one is pinned (no symmetric twins)."""
    for j, tensor_copies in enumerate(v.copies):
        if v.is_fixed(j):
            continue
        for copy in tensor_copies[1:]:
            model.add(copy.end >= copy.start).only_enforce_if(copy.present)
            model.add(copy.stage == _min_stage(copy)).only_enforce_if(~copy.present)
            model.add(copy.end == copy.start).only_enforce_if(~copy.present)


def add_symmetry_breaking(model: cp_model.CpModel, data: ModelData, v: Variables) -> None:
    """Recomputations (and prefetches) of a tensor are used in order: the r-th exists only after the (r-1)-th."""
    for j, tensor_copies in enumerate(v.copies):
        if v.is_fixed(j):
            continue
        for kind in ("recompute", "prefetch"):
            same = [c for c in tensor_copies if c.kind == kind]
            for first, second in zip(same, same[1:]):
                model.add_implication(second.present, first.present)
                model.add(second.stage > first.stage).only_enforce_if(second.present)


def add_inputs_present(model: cp_model.CpModel, data: ModelData, v: Variables) -> None:
    """(4) every computation finds each input on the device: one copy of it covers the computation."""
    for k, tensor_copies in enumerate(v.copies):
        if k % 16 == 0:
            data.check_time()
        reader_fixed = v.is_fixed(k)
        for reader in tensor_copies:
            if not reader.computes:
                continue
            reader_pos = reader.start
            reader_max = _max_stage(data, reader)
            for j in data.inputs[k]:
                if reader_fixed and v.is_fixed(j):
                    continue  # both sides fixed to a solution: satisfied already
                candidates = []
                for source in v.copies[j]:
                    if source.kind == "recompute" and _min_stage(source) > reader_max:
                        continue
                    if source.kind == "prefetch" and _min_stage(source) > reader_max:
                        continue
                    literal = model.new_bool_var(f"use_{k}_{reader.kind}{reader.rank}_{j}_{source.kind}{source.rank}")
                    if not source.fixed:
                        model.add_implication(literal, source.present)
                    _only_if(model, source.end >= reader_pos, [literal])
                    if source.kind == "recompute":
                        _only_if(model, source.stage <= reader.stage, [literal])
                    elif source.kind == "prefetch":
                        _only_if(model, source.stage <= reader.stage, [literal])
                        if not source.fixed:
                            _only_if(model, source.ready_stage <= reader.stage, [literal, ~source.early])
                        elif not source.early:
                            _only_if(model, source.ready_stage <= reader.stage, [literal])
                    candidates.append((source, literal))
                model.add(sum(lit for _, lit in candidates) == reader.present)
                v.uses[(k, reader.kind == "recompute" and reader.rank or 0, j)] = candidates


def add_one_copy_at_a_time(model: cp_model.CpModel, data: ModelData, v: Variables) -> None:
    """A tensor is never computed or prefetched while a copy of it is still on the device."""
    for j, tensor_copies in enumerate(v.copies):
        if len(tensor_copies) > 1 and not v.is_fixed(j):
            model.add_no_overlap([c.interval for c in tensor_copies])


def add_offload_rules(model: cp_model.CpModel, data: ModelData, v: Variables) -> None:
    """(6)-(9): one offload per tensor, prefetches only after it completes, device copy kept until then.

    MO-SOS forces every prefetch to land before the stage that reads it. We
    also let a prefetch be read in a stage before it lands ("early"): the
    compute stream then waits, and the objective is charged the whole
    transfer time, an upper bound on the wait (so the model stays safe).
    """
    for j, offload in v.offloads.items():
        if offload.fixed:
            continue
        original = v.copies[j][0]
        model.add(original.end >= offload.done_stage * data.stride - 1).only_enforce_if(offload.present)
        model.add(original.end >= offload.stage * data.stride).only_enforce_if(offload.present)
        prefetches = [c for c in v.copies[j] if c.kind == "prefetch"]
        for copy in prefetches:
            model.add_implication(copy.present, offload.present)
            model.add(copy.stage >= offload.done_stage).only_enforce_if(copy.present)
            # the buffer is kept at least until the copy lands, so waiting for it never stalls
            model.add(copy.end >= copy.ready_stage * data.stride - 1).only_enforce_if([copy.present, ~copy.early])
        # (8) no offload without a prefetch
        model.add(sum(c.present for c in prefetches) >= offload.present)
        model.add(offload.stage == offload.stage_low).only_enforce_if(~offload.present)


def add_transfer_streams(model: cp_model.CpModel, data: ModelData, v: Variables) -> None:
    """(10)-(13): one copy at a time per direction, in the time of the fastest stages (so always hidden)."""
    if not v.offloads:
        return
    horizon = data.stage_start[-1]
    d2h, h2d = [], []
    for j, offload in v.offloads.items():
        if offload.fixed:
            d2h.append(model.new_fixed_size_interval_var(data.stage_start[offload.stage], data.offload_units[j], f"d2h_{j}"))
            for copy in v.copies[j]:
                if copy.kind == "prefetch":
                    h2d.append(model.new_fixed_size_interval_var(
                        data.stage_start[copy.stage], data.prefetch_units[j], f"h2d_{j}_{copy.rank}"
                    ))
            continue
        start = model.new_int_var(0, horizon, f"offload_time_{j}")
        model.add_element(offload.choice, [data.stage_start[a] for a in offload.stage_choices], start)
        d2h.append(
            model.new_optional_fixed_size_interval_var(start, data.offload_units[j], offload.present, f"d2h_{j}")
        )
        for copy in v.copies[j]:
            if copy.kind != "prefetch":
                continue
            start = model.new_int_var(0, horizon, f"prefetch_time_{j}_{copy.rank}")
            model.add_element(copy.choice, [data.stage_start[a] for a in copy.stage_choices], start)
            h2d.append(
                model.new_optional_fixed_size_interval_var(
                    start, data.prefetch_units[j], copy.present, f"h2d_{j}_{copy.rank}"
                )
            )
    model.add_no_overlap(d2h)
    model.add_no_overlap(h2d)


def add_memory(model: cp_model.CpModel, data: ModelData, v: Variables) -> None:
    """(14)-(18): at every position, live copies + the running node's workspace fit in the budget."""
    intervals, demands = [], []
    for j, tensor_copies in enumerate(v.copies):
        for copy in tensor_copies:
            if data.size_units[j]:
                intervals.append(copy.interval)
                demands.append(data.size_units[j])
            if not copy.computes:
                continue
            for impl, literal in zip(data.impls[j], copy.implementations):
                if copy.fixed and literal and impl.workspace_units:
                    intervals.append(model.new_fixed_size_interval_var(copy.start, 1, f"ws_{j}_{copy.kind}{copy.rank}"))
                    demands.append(impl.workspace_units)
                elif not copy.fixed and impl.workspace_units:
                    intervals.append(
                        model.new_optional_fixed_size_interval_var(
                            copy.start, 1, literal, f"ws_{j}_{copy.kind}{copy.rank}_{impl.name}"
                        )
                    )
                    demands.append(impl.workspace_units)
    model.add_cumulative(intervals, demands, v.capacity)


ALL_FAMILIES = (
    add_copy_shapes,
    add_symmetry_breaking,
    add_inputs_present,
    add_one_copy_at_a_time,
    add_offload_rules,
    add_transfer_streams,
    add_memory,
)

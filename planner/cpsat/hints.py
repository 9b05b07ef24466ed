"""Warm starts: read a baseline Schedule back into model values and hand them to CP-SAT as a hint.

The reading is best effort (a baseline may do things the model cannot say,
such as more recomputations than the model allows); CP-SAT repairs or drops
an inconsistent hint, so a poor hint costs time, never correctness.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.cpsat.callback import new_solver
from planner.cpsat.data import ModelData, ModelExtensions
from planner.cpsat.extract import Solution, SolvedCopy
from planner.cpsat.variables import Variables
from planner.schedule import Compute, Free, Offload, Prefetch, Schedule


@dataclass
class _Open:
    kind: str
    rank: int
    stage: int
    start: int
    implementation: int | None
    end: int | None = None


def schedule_to_solution(data: ModelData, schedule: Schedule) -> Solution:
    index = {node_id: i for i, node_id in enumerate(data.ids)}
    impl_index = [{impl.name: i for i, impl in enumerate(impls)} for impls in data.impls]
    fastest = [data.profile.node_by_id[node_id].fastest.name for node_id in data.ids]
    current: dict[int, _Open] = {}
    finished: list[tuple[int, _Open]] = []
    counts: dict[tuple[int, str], int] = {}
    offloads: dict[int, int] = {}
    # The model starts each copy at a stage start, one at a time per direction, in its own timing (the
    # fastest stage durations): a copy the plan issues while the stream is busy starts, in the model,
    # at the first stage start after the stream frees up (a prefetch also after its offload has ended).
    stream_free = {"d2h": 0, "h2d": 0}

    def model_stage(direction: str, j: int, issued: int, earliest: int = 0) -> int:
        stage = max(issued, earliest)
        if stage < data.n and data.stage_start[stage] < stream_free[direction]:
            stage = bisect.bisect_left(data.stage_start, stream_free[direction], lo=stage, hi=data.n)
        if stage >= data.n:
            raise ValueError(f"a copy of {data.ids[j]!r} would start after the last stage in the model's timing")
        units = data.offload_units if direction == "d2h" else data.prefetch_units
        stream_free[direction] = data.stage_start[stage] + units[j]
        return stage

    t = 0
    for stage in schedule.stages:
        if stage.node is not None and stage.node in index:
            t = index[stage.node]
        position = data.stage_slot(t)
        computed_yet = False
        for op in stage.operations:
            if isinstance(op, Compute):
                k = index[op.node]
                if k in current and current[k].end is None:
                    current[k].end = position
                if (k, "original") not in counts:
                    counts[(k, "original")] = 0
                    kind, rank, copy_stage = "original", 0, k
                else:
                    rank = counts.get((k, "recompute"), 0) + 1
                    counts[(k, "recompute")] = rank
                    kind, copy_stage = "recompute", t
                position = data.pos(copy_stage, k)
                implementation = impl_index[k].get(op.implementation, impl_index[k].get(fastest[k], 0))
                if k in current:
                    finished.append((k, current[k]))
                current[k] = _Open(kind, rank, copy_stage, position, implementation)
                computed_yet = True
            elif isinstance(op, Offload):
                j = index[op.tensor]
                offloads[j] = model_stage("d2h", j, t + 1 if computed_yet else t) if data.transfers else t
            elif isinstance(op, Prefetch):
                j = index[op.tensor]
                stage_of_prefetch = t + 1 if computed_yet else t
                if data.transfers and j in offloads:
                    stage_of_prefetch = model_stage("h2d", j, stage_of_prefetch, data.offload_done(j, offloads[j]))
                rank = counts.get((j, "prefetch"), 0) + 1
                counts[(j, "prefetch")] = rank
                if j in current:
                    finished.append((j, current[j]))
                current[j] = _Open("prefetch", rank, stage_of_prefetch, data.stage_slot(stage_of_prefetch), None)
            elif isinstance(op, Free):
                j = index[op.tensor]
                if j in current:
                    current[j].end = max(position, current[j].start)
                    if j in offloads and current[j].kind == "original":
                        hold = data.offload_done(j, offloads[j]) * data.stride - 1 if data.transfers else position
                        current[j].end = max(current[j].end, hold, data.stage_slot(offloads[j]))
    finished += list(current.items())
    solution = Solution(offload_stage=offloads)
    for j, item in finished:
        # never freed: on the device to the end of the step; for the model, until its last reader
        end = item.end if item.end is not None else max(item.start, data.last_use_position(j))
        solution.copies.append(SolvedCopy(j, item.kind, item.rank, item.stage, item.start, end, item.implementation))
    return solution


def extensions_of(data: ModelData, solution: Solution) -> ModelExtensions:
    """The copies and copy stages `solution` uses, per node id: what the model needs to express it."""
    extensions = ModelExtensions()
    for copy in solution.copies:
        node_id = data.ids[copy.tensor]
        if copy.kind == "recompute":
            extensions.recomputes[node_id] = max(extensions.recomputes.get(node_id, 0), copy.rank)
        elif copy.kind == "prefetch":
            extensions.prefetches[node_id] = max(extensions.prefetches.get(node_id, 0), copy.rank)
            extensions.prefetch_stages.setdefault(node_id, set()).add(copy.stage)
    for j, stage in solution.offload_stage.items():
        extensions.offload_stages.setdefault(data.ids[j], set()).add(stage)
    return extensions


def add_hint(model: cp_model.CpModel, data: ModelData, v: Variables, hint: Solution) -> None:
    by_key = {(c.tensor, c.kind, c.rank): c for c in hint.copies}
    for j, tensor_copies in enumerate(v.copies):
        if v.is_fixed(j):
            continue
        for copy in tensor_copies:
            solved = by_key.get((j, copy.kind, copy.rank))
            if copy.kind != "original":
                model.add_hint(copy.present, solved is not None)
                if solved is None:
                    continue
                if copy.stage_low <= solved.stage <= copy.stage_high:
                    model.add_hint(copy.stage, solved.stage)
            if solved is None:
                continue
            if solved.end >= 0:
                model.add_hint(copy.end, solved.end)
            if copy.computes and solved.implementation is not None:
                for i, literal in enumerate(copy.implementations):
                    if len(copy.implementations) > 1:
                        model.add_hint(literal, i == solved.implementation)
    for j, offload in v.offloads.items():
        if offload.fixed:
            continue
        stage = hint.offload_stage.get(j)
        model.add_hint(offload.present, stage is not None)
        if stage is not None:
            model.add_hint(offload.stage, stage)


def fix_variables(model: cp_model.CpModel, indices, values, check: bool = True) -> bool:
    """Fix the variables at proto `indices` to `values` by shrinking their domains (a constraint each costs more).

    False (the model left partly fixed) if a value lies outside its variable's domain: no solution has it.
    `check=False` for values taken from a solution of this model (always inside).
    """
    variables = model.proto.variables
    for index, value in zip(indices, values):
        domain = variables[index].domain
        if check:
            bounds = list(domain)
            if not any(bounds[i] <= value <= bounds[i + 1] for i in range(0, len(bounds), 2)):
                return False
        domain.clear()
        domain.extend((value, value))
    return True


def set_full_hint(model: cp_model.CpModel, values: list[int]) -> None:
    """Hint every variable (values in proto order) in one go."""
    model.clear_hints()
    hint = model.proto.solution_hint
    hint.vars.extend(range(len(values)))
    hint.values.extend(values)


def complete_hint(
    model: cp_model.CpModel, time_limit_s: float, seed: int, wall_limit_s: float | None = None,
    keep_objective: bool = False,
) -> list[int] | None:
    """Turn the partial hint into a full assignment, so that CP-SAT starts from a solution at once.

    A copy of the model with the hinted variables fixed is solved briefly; its
    answer becomes the hint for every variable and is returned (values in proto
    order). If that copy is infeasible (the baseline did something the model
    cannot express) the partial hint stays and the answer is None.
    """
    proto = model.proto
    if not proto.solution_hint.vars:
        return None
    fixed = model.clone()
    if not fix_variables(fixed, list(proto.solution_hint.vars), list(proto.solution_hint.values)):
        return None
    if not keep_objective:  # kept: what the hint leaves open (which prefetch read waits) is chosen at least cost
        fixed.clear_objective()
    fixed.clear_hints()
    solver = new_solver()
    solver.parameters.max_deterministic_time = time_limit_s  # same answer on a busy machine
    solver.parameters.max_time_in_seconds = 3 * time_limit_s + 1
    if wall_limit_s is not None:
        solver.parameters.max_time_in_seconds = max(0.01, min(solver.parameters.max_time_in_seconds, wall_limit_s))
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    status = solver.solve(fixed)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    values = list(solver.response_proto.solution)
    set_full_hint(model, values)
    return values

"""PlannedModule: a training step that follows a schedule, generated once as code.

`loss = planned(*inputs, targets=targets, **kwargs); loss.backward()` runs
the model's captured joint graph (executor.capture.capture) in the schedule's order:
the generated code (executor.engine.codegen) computes each planning node's ATen
operations, offloads, prefetches, waits, frees and recomputes exactly where
the schedule says. One custom autograd Function wraps the step: its forward
runs the code up to the first backward computation and returns the loss, its
backward runs the rest with the incoming gradient of the loss as the joint
graph's tangent (so `(loss * 3).backward()` scales every gradient exactly as
plain PyTorch does) and fills `.grad` as AccumulateGrad does, so any
optimizer works unchanged.

- Gradients with the native algorithms are bitwise plain PyTorch's: the code
  calls the same ATen operators in the same order as an eager step.
- Recomputation restores the RNG state of the node's first computation
  (dropout draws the same mask); buffers (BatchNorm statistics) and mutated
  inputs are written back once, at the end of the step, from staging buffers.
- Offload and prefetch go through executor.engine.transfers (CUDA streams, pinned
  host buffers, events; plain copies on the CPU).
- The ledger (executor.engine.accountant), on by default on the CPU, counts the real
  bytes of every planning node's storages and stands in for
  `torch.cuda.max_memory_allocated`: `planned.peak_memory_bytes`.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import threading
import time
import weakref
from collections import OrderedDict
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from executor.engine.arena import Arena
from executor.engine.accountant import Accountant
from executor.engine.device_memory import DeviceMemory, HeldRecord, device_memory_of
from executor.capture.capture import tensor_signature
from executor.engine.codegen import CodeGenerator, Modes, Op, Program, rng_state_bytes, schedule_operations
from executor.engine.compiled_nodes import CompiledNodes, NodeCompiler
from executor.replay import optimizer_state
from executor.replay.gradient_edges import (PlannedLoss, accumulation_signals, edge_anchor, hooks_wait_for_accumulation,
                                            note_anchored, refuse_hooks_added_since_forward, refuse_other_backwards)
from executor.capture import autocast
from executor.capture.python_state import describe_change, python_state
from executor.errors import CaptureError, ProfileMismatch, ReplayError
from executor.capture.feeds import Feeder
from executor.measure.measured import StepReport, measured_profile, node_differences
from executor.measure.profiler import ProfiledStep, as_tuple, cpu_clock, plan_step
from executor.engine.runtime import StepRuntime, TimedStepRuntime
from planner.errors import BudgetError, MososError, ScheduleRejected
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies.keep_all import keep_all_schedule
from planner.planning import addressed
from planner.simulator import simulate
from planner.units import format_bytes


def check_model(profiled: ProfiledStep, profile: GraphProfile) -> None:
    """Refuse a profile measured on another model, saying what differs."""
    expected = profile.provenance.model_structure_sha256
    if expected is None:
        raise ProfileMismatch(
            f"profile {profile.name!r} carries no model structure hash (provenance.model_structure_sha256): "
            "only profiles measured by executor.profile_model / `mosos profile` can be replayed on a model"
        )
    actual = profiled.step.structure_sha256()
    profiled_nodes = [(n.id, n.op_type) for n in profile.nodes]
    here = [(g.id, g.op_type) for g in profiled.planning.groups]
    if actual == expected and profiled_nodes == here:
        return
    for position, (a, b) in enumerate(zip(profiled_nodes, here)):
        if a != b:
            raise ProfileMismatch(
                f"profile {profile.name!r} was made for another model: planning node {position} is {a[0]!r} ({a[1]}) "
                f"in the profile but {b[0]!r} ({b[1]}) in this model"
            )
    if len(profiled_nodes) != len(here):
        raise ProfileMismatch(
            f"profile {profile.name!r} was made for another model: it has {len(profiled_nodes)} planning nodes, "
            f"this model has {len(here)}"
        )
    raise ProfileMismatch(
        f"profile {profile.name!r} was made for another model: same planning nodes, but operation arguments or "
        f"parameter shapes differ (structure hash {expected[:12]} in the profile, {actual[:12]} here)"
    )


def check_inputs(profile: GraphProfile, inputs: tuple, kwargs: dict, targets) -> None:
    signatures = (
        ("inputs", tensor_signature(inputs, kwargs), profile.provenance.input_signature),
        ("targets", tensor_signature(targets) if targets is not None else None, profile.provenance.target_signature),
    )
    for what, actual, expected in signatures:
        if expected is None and actual is None:
            continue
        if expected is None and what == "inputs":
            continue
        if (actual or "") != (expected or ""):
            raise ProfileMismatch(
                f"profile {profile.name!r} was measured with {what} {expected or '(none)'}, "
                f"but this step got {actual or '(none)'}: profile the model again for these shapes"
            )


# kinds of compiled region one planned step may use, the most useful first (executor.engine.codegen): the keep-all plan
# of a 4-layer GPT-2 has 11 (a recompute plan more), the first 8 cover most of its node computations, and each
# costs 0.3-0.8 s to compile on 2 CPU cores
MAX_REGION_KERNELS = 8


class _Prepared:
    """Everything a step needs that does not change between steps."""

    def __init__(self, planned: "PlannedModule", profiled: ProfiledStep, timed: bool = False):
        profile, schedule = planned.profile, planned.schedule
        self.timed = timed
        self.clock = None
        check_model(profiled, profile)
        self.profiled = profiled
        step, planning, feeder = profiled.step, profiled.planning, profiled.feeder
        groups = planning.groups
        index_of = {group.id: group.index for group in groups}
        self.operations = schedule_operations(profile, schedule, index_of)
        kinds = [group.kind for group in groups]
        self.split = next((k for k, op in enumerate(self.operations)
                           if op.kind == "compute" and kinds[op.group] == "backward"), len(self.operations))
        _check_random_order(self.operations, planning)
        self.device = planned.device
        # the planned model's own tensors (the capture may have been made on another copy of the same model)
        self.feeder = feeder = Feeder(step, planned.model, planned.loss_fn)
        compiler = NodeCompiler(planned._say, max_region_kernels=MAX_REGION_KERNELS) if planned.compile else None
        # planned addresses: the eager replay writes each node's outputs into its slot of the module's arena
        self.arena_bytes = schedule.arena_bytes if planned.arena_enabled and compiler is None else None
        modes = Modes(ledger=planned.ledger_enabled, strict=planned.strict, timing=timed,
                      direct_writes=feeder.in_place_candidates(), arena=self.arena_bytes is not None)
        nodes = profile.node_by_id
        implementations = {(g.index, impl.name): (impl.time_ms, impl.workspace_bytes)
                           for g in groups for impl in nodes[g.id].implementations}
        planned_bytes = [nodes[g.id].size_bytes for g in groups]
        region_memory = ((planned_bytes, lambda group, name: implementations[(group, name)][1])
                         if planned.compile_regions else None)

        def generator_for(modes: Modes) -> CodeGenerator:
            return CodeGenerator(planning, modes, cuda=self.device.type == "cuda", compiler=compiler,
                                 region_memory=region_memory)

        name = "planned step (timed)" if timed else "planned step"
        self.program: Program = generator_for(modes).program(self.operations, self.split, name=name)
        # the arena, and beside it what the allocator still holds (the program's allowances), must fit the budget
        # with fixed memory; where they do not, the step goes through the allocator, and `arena_refused` says why
        self.arena_refused: str | None = None
        if planned.arena_enabled and self.arena_bytes is None:
            self.arena_refused = (
                "compiled nodes allocate their own outputs" if compiler is not None else
                "the plan carries no planned addresses (its buffers did not place within its budget, even planned "
                "again within less, or it was made without them)")
            planned._say(f"not writing into the arena: {self.arena_refused}")
        if self.arena_bytes is not None and schedule.budget_bytes is not None:
            held = profile.fixed_bytes + self.arena_bytes + self.program.outside_arena_bytes
            if held > schedule.budget_bytes:
                self.arena_refused = (
                    f"the arena ({format_bytes(self.arena_bytes)}) and what the allocator would still hold beside it "
                    f"({format_bytes(self.program.outside_arena_bytes)}: {len(self.program.allowances)} nodes it "
                    f"names) pass the budget of {format_bytes(schedule.budget_bytes)} with fixed memory "
                    f"({format_bytes(profile.fixed_bytes)}): the step goes through the allocator, as planned")
                planned._say(f"not writing into the arena: {self.arena_refused}")
                self.arena_bytes = None
                modes = dataclasses.replace(modes, arena=False)
                self.program = generator_for(modes).program(self.operations, self.split, name=name)
        self.compiled: CompiledNodes | None = compiler.record if compiler is not None else None
        # The ledger counts the real bytes of every node, which repeat exactly from step to step of one program
        # (the same operations on inputs of the same shapes): it checks the first step of each program and each
        # pattern of gradients already held (an addition into .grad holds a transient), and the steps after it run a
        # program without its calls (a tiny-layer model's steps spent 40% of their time in it). `strict` and timed
        # steps keep it on every step; compiled steps too (their kernels are generated once, with it).
        self.ledger = modes.ledger
        self.unchecked_program: Program | None = None
        self.checked: dict[tuple, Accountant] = {}  # gradients held (per parameter) -> the ledger of its step
        self._unchecked_generator = None
        if modes.ledger and not modes.strict and not timed and compiler is None:
            unchecked_modes = dataclasses.replace(modes, ledger=False)
            self._unchecked_generator = lambda: generator_for(unchecked_modes)
        node_ids = [g.id for g in groups]
        if timed:
            self.clock = cpu_clock(self.device)[0]
            self.runtime = TimedStepRuntime(self.device, feeder.staging_buffers(self.device), node_ids, self.clock)
        else:
            self.runtime = StepRuntime(self.device, feeder.staging_buffers(self.device), node_ids)
        self.runtime.implementation_of = lambda group, name: implementations[(group, name)]
        self.runtime.planned_bytes = planned_bytes
        if planned.strict:
            self.runtime.expected_bytes = planned_bytes
        self.tangent_index = feeder.tangent_index
        self.input_spec = step.input_spec
        self.constant_leaves = step.constant_leaves

    @property
    def source(self) -> str:
        return self.program.source

    def bind(self, program: Program, arena: Arena) -> None:
        """Before a step of `program`: its slots as views of the arena (made again only where the program or the
        arena's buffer changed)."""
        if self.arena_bytes is not None:
            self.runtime.bind_arena(arena, program.slots, self.arena_bytes)

    @property
    def checks_once(self) -> bool:
        """Whether the ledger checks one step of each pattern of gradients held, then steps aside."""
        return self._unchecked_generator is not None

    def program_for(self, ledger_key: tuple | None) -> tuple[Program, bool]:
        """(the program to run, whether it keeps the ledger): the ledger's, until a step with these gradients held
        (`ledger_key`; None where the ledger is on every step or never) has been checked."""
        if ledger_key is None or ledger_key not in self.checked:
            return self.program, self.ledger
        if self.unchecked_program is None:
            self.unchecked_program = self._unchecked_generator().program(self.operations, self.split,
                                                                          name="planned step (checked)")
        return self.unchecked_program, False


def arena_reserve_bytes(profile: GraphProfile, profiled: ProfiledStep, device: torch.device,
                        any_order: bool = True) -> int:
    """What a step writing into its arena holds beside it, at most, under any plan of `profile` (a plan for the
    arena is made within the budget less this): every node's computation appears in the keep-all plan, whose
    program bounds it for any order (Program.outside_arena_any_order_bytes), here with each node's largest
    workspace over its implementations and a generator state for every random node (recomputed ones keep theirs).
    `any_order=False`: what the keep-all step holds beside it in its own order, a smaller figure that another plan
    may pass (a guess to plan within, whose plan `arena_outside_bytes` then checks)."""
    program = _arena_program(profile, profiled, keep_all_schedule(profile), device, largest_workspace=True)
    randoms = sum(1 for group in profiled.planning.groups if group.random)
    states = (randoms + 1) * rng_state_bytes(device.type == "cuda") if randoms else 0
    return (program.outside_arena_any_order_bytes if any_order else program.outside_arena_bytes) + states


def arena_outside_bytes(profile: GraphProfile, profiled: ProfiledStep, schedule: Schedule,
                        device: torch.device) -> int:
    """What the step of `schedule` would hold beside its arena at once (Program.outside_arena_bytes), as the
    replay counts it before writing into the arena."""
    return _arena_program(profile, profiled, schedule, device).outside_arena_bytes


def workspaces_in_the_arena(profile: GraphProfile) -> GraphProfile:
    """`profile` with each workspace cut to its arena part (`arena_workspace_bytes`): what a plan for a step writing
    into its arena counts, where the room left beside the arena holds the rest (a kernel's own scratch, which
    `arena_reserve_bytes` counts there). `profile` itself where no part is less than its workspace."""
    if not any(i.arena_workspace_bytes is not None and i.arena_workspace_bytes < i.workspace_bytes
               for node in profile.nodes for i in node.implementations):
        return profile
    data = profile.model_dump(mode="json")
    for node in data["nodes"]:
        for implementation in node["implementations"]:
            part = implementation.pop("arena_workspace_bytes", None)  # all of what is left: a plain profile, which
            if part is not None:  # a planner service older than the field reads too
                implementation["workspace_bytes"] = part
    return GraphProfile.model_validate(data)


def _for_the_profile(profile: GraphProfile, view: GraphProfile, schedule: Schedule, budget_bytes: int) -> Schedule:
    """A plan made on `view` (workspaces cut to their arena parts) as a plan of `profile` within `budget_bytes`:
    the same operations and addresses (a workspace's place is its arena part in both), and the peak counting every
    workspace whole, which the simulator checks against the budget."""
    if view is profile:
        return schedule.model_copy(update={"budget_bytes": budget_bytes})
    moved = schedule.model_copy(update={"profile_digest": profile.digest(), "profile_name": profile.name,
                                        "budget_bytes": budget_bytes})
    result = simulate(profile, moved, keep_timeline=False)  # ScheduleRejected where it passes the budget
    if moved.summary is not None:
        moved = moved.model_copy(update={"summary": moved.summary.model_copy(
            update={"peak_memory_bytes": result.peak_memory_bytes})})
    return moved


def plan_beside_the_arena(profile: GraphProfile, budget_bytes: int, reserve_bytes: int,
                          solve: Callable[[GraphProfile, int], Schedule], say: Callable[[str], None],
                          in_order: tuple[Callable[[], int], Callable[[Schedule], int]] | None = None,
                          ) -> tuple[Schedule | None, int]:
    """A plan for a step writing into its arena within `budget_bytes`, and the room it was made to leave beside
    the arena; (None, `reserve_bytes`) where no plan leaves it. `solve` plans a profile within a budget (BudgetError
    where nothing fits; without addresses where its buffers do not place within it); the schedule says
    `budget_bytes`. At most one solve finds a plan: the others fail at once.

    The solver plans on the profile with each workspace cut to its arena part (`workspaces_in_the_arena`): the
    room beside the arena holds the rest, which would otherwise count twice. First within the budget less
    `reserve_bytes`, the room for any order of the nodes (`arena_reserve_bytes`), which every plan's step fits.
    `in_order` gives what the keep-all step holds beside the arena in its own order (nodes kept out of the arena
    are beside it only while they live: a third of that room for the zoo's in-place CNN) and what a given plan's
    step holds in its own. With it, where no plan leaves the room, one is made within the budget less the
    keep-all step's figure; and a plan whose buffers did not place within what it was made within is placed again
    within the budget less what its own step holds. A plan whose own step does not fit with its arena comes back
    as it is, where it fits the budget with every workspace counted whole: the replay then goes through the
    allocator and says why."""
    view = workspaces_in_the_arena(profile)
    say(f"planning within {format_bytes(budget_bytes - reserve_bytes)}: the budget less the "
        f"{format_bytes(reserve_bytes)} the allocator may hold beside the arena")
    room_bytes = reserve_bytes
    try:
        schedule = solve(view, budget_bytes - reserve_bytes)
    except BudgetError as error:
        say(f"no plan leaves that room ({error})")
        in_order_bytes = in_order[0]() if in_order is not None else reserve_bytes
        # a room a hundredth of the budget smaller or less would not turn a plan that does not fit into one
        if reserve_bytes - in_order_bytes <= budget_bytes // 100:
            return None, reserve_bytes
        say(f"planning within {format_bytes(budget_bytes - in_order_bytes)}: the budget less the "
            f"{format_bytes(in_order_bytes)} the keep-all step holds beside the arena in its own order")
        try:
            schedule = solve(view, budget_bytes - in_order_bytes)
        except BudgetError as error:
            say(f"no plan leaves that room either ({error})")
            return None, reserve_bytes
        room_bytes = in_order_bytes
    if in_order is not None and (schedule.arena_bytes is None or room_bytes < reserve_bytes):
        arena_bytes = schedule.arena_bytes if schedule.arena_bytes is not None else (
            schedule.summary.arena_bytes if schedule.summary is not None else None)
        if arena_bytes is not None:
            outside_bytes = in_order[1](schedule)
            held_bytes = profile.fixed_bytes + arena_bytes + outside_bytes
            if held_bytes <= budget_bytes and schedule.arena_bytes is None:
                # placed again with the room its own step needs beside the arena
                schedule = addressed(view, schedule.model_copy(
                    update={"budget_bytes": budget_bytes - outside_bytes}))
            if held_bytes <= budget_bytes and schedule.arena_bytes is not None:
                room_bytes = outside_bytes
            else:
                say(f"its step would hold {format_bytes(outside_bytes)} beside its arena of "
                    f"{format_bytes(arena_bytes)}: {format_bytes(held_bytes)} with fixed memory, over the budget")
    try:
        return _for_the_profile(profile, view, schedule, budget_bytes), room_bytes
    except ScheduleRejected as error:
        # planned within the keep-all step's room, for a step that cannot write into its arena after all
        say(f"with every workspace counted whole, that plan does not fit the budget through the allocator ({error})")
        return None, reserve_bytes


def _arena_program(profile: GraphProfile, profiled: ProfiledStep, schedule: Schedule, device: torch.device,
                   largest_workspace: bool = False) -> Program:
    """The program of `schedule` writing into an arena, generated to be read, not run: any address will do (what
    it would hold beside the arena does not depend on where the slots are); `largest_workspace`: each node with its
    largest workspace over its implementations, and its smallest workspace slot (the rest is beside the arena)."""
    planning = profiled.planning
    groups = planning.groups
    operations = schedule_operations(profile, schedule, {group.id: group.index for group in groups})
    split = next((k for k, op in enumerate(operations)
                  if op.kind == "compute" and groups[op.group].kind == "backward"), len(operations))
    nodes = profile.node_by_id
    if largest_workspace:
        largest = {g.index: max((i.workspace_bytes for i in nodes[g.id].implementations), default=0) for g in groups}
        smallest_slot = {g.index: min((i.placed_workspace_bytes for i in nodes[g.id].implementations), default=0)
                         for g in groups}
        workspace_of = lambda group, name: largest[group]  # noqa: E731
        slot_of = lambda group, name: smallest_slot[group]  # noqa: E731
    else:
        implementations = {(g.index, i.name): i for g in groups for i in nodes[g.id].implementations}
        workspace_of = lambda group, name: implementations[(group, name)].workspace_bytes  # noqa: E731
        slot_of = lambda group, name: implementations[(group, name)].placed_workspace_bytes  # noqa: E731
    operations = [dataclasses.replace(op, offset_bytes=0, workspace_offset_bytes=0,
                                      workspace_bytes=workspace_of(op.group, op.implementation),
                                      workspace_slot_bytes=slot_of(op.group, op.implementation))
                  if op.kind == "compute" else op for op in operations]
    generator = CodeGenerator(planning, Modes(arena=True), cuda=device.type == "cuda")
    return generator.program(operations, split, name="arena reserve")


def _check_random_order(operations: list[Op], planning) -> None:
    """Random operations draw from the generator in eager order only if their nodes first run in that order."""
    position = {node: i for i, node in enumerate(planning.step.graph.nodes)}
    first_random = {g.index: min(position[op] for op in g.ops if op in planning.facts.random_ops)
                    for g in planning.groups if g.random}
    seen: list[int] = []
    for op in operations:
        if op.kind == "compute" and op.group in first_random and op.group not in seen:
            if seen and first_random[seen[-1]] > first_random[op.group]:
                before, after = planning.groups[seen[-1]].id, planning.groups[op.group].id
                raise ReplayError(
                    f"the schedule first computes {before!r} before {after!r}, but the model draws {after!r}'s random "
                    f"numbers first: they would differ from plain PyTorch's"
                )
            seen.append(op.group)


class PlannedModule(nn.Module):
    """`model` trained as `schedule` says: `loss = planned(*inputs, targets=...)`, then `loss.backward()`.

    Give `example_inputs` (and `kwargs`, `targets`) to capture the model now and refuse a mismatch at once;
    without them it is captured at the first call. `ledger` (default: on the CPU) keeps the byte-exact
    ledger; `strict` also checks every node's real size against the profile and that freed memory is released.
    `compile` runs the planning nodes as Inductor kernels (executor.engine.compiled_nodes), for a profile measured so;
    `compiled_nodes` then says which ran eagerly and why. `compile_regions` also runs consecutive computations as
    one kernel where nothing but frees is scheduled between them (executor.engine.regions; not in strict mode, which
    checks node by node, nor in the timed steps, which time node by node).
    """

    def __init__(
        self,
        model: nn.Module,
        profile: GraphProfile,
        schedule: Schedule,
        loss_fn: Callable | None = None,
        *,
        example_inputs=None,
        kwargs: dict | None = None,
        targets=None,
        strict: bool = False,
        ledger: bool | None = None,
        profiled: ProfiledStep | None = None,
        timed_steps: int = 0,
        replan: Callable[[GraphProfile, Schedule, object], Schedule | None] | None = None,
        plan_signature: Callable[[tuple, dict, object], tuple] | None = None,
        max_signatures: int = 4,
        progress: Callable[[str], None] | None = None,
        plan_token: object = None,
        compile: bool = False,
        compile_regions: bool = True,
        device_memory: DeviceMemory | None | str = "auto",
        outside_allocator_bytes: int = 0,
        arena: bool = False,
    ):
        super().__init__()
        self.model = model
        # planned addresses (a schedule with them, the eager replay): one arena allocated at the first step and
        # kept, each node's outputs written into their slot (executor.engine.arena)
        self.arena_enabled = bool(arena)
        self._arena = Arena(next((p.device for p in model.parameters()), torch.device("cpu")))
        self.compile = compile  # planning nodes as Inductor kernels (the profile must have been measured so)
        # with compile: consecutive computations with nothing scheduled between them as one kernel (executor.engine.regions)
        self.compile_regions = compile_regions
        self.profile = profile
        self.schedule = schedule
        self.loss_fn = loss_fn or _output_is_the_loss
        self.strict = strict
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.ledger_enabled = (self.device.type == "cpu") if ledger is None else bool(ledger)
        self.ledger_enabled = self.ledger_enabled or strict
        # what the device holds around each step (the allocator's reserved segments, memory outside it): on a GPU by
        # default, a fake caching allocator in tests; none on the CPU, whose ledger counts what a step holds
        self.device_memory = device_memory_of(self.device) if device_memory == "auto" else device_memory
        # what the process held outside the allocator when optimize() began (deducted from a budget in bytes before
        # planning): the device may hold the plan's budget and that; a step over it starts a re-plan within less
        self.outside_allocator_bytes = outside_allocator_bytes
        self._device_budget_bytes = _device_budget(schedule, outside_allocator_bytes)
        self._held = HeldRecord(self._device_budget_bytes)
        if schedule.profile_digest != profile.digest():
            raise ProfileMismatch(
                f"the schedule was made for profile {schedule.profile_name!r} (digest {schedule.profile_digest[:12]}), "
                f"not for {profile.name!r} (digest {profile.digest()[:12]})"
            )
        simulated = simulate(profile, schedule, keep_timeline=False)  # raises ScheduleRejected on a bad plan
        optimizer_state.watch(self)  # an optimizer keeping more state than the plan counted is refused at its step
        self.simulated_peak_bytes = simulated.peak_memory_bytes
        self.simulated_step_time_ms = simulated.step_time_ms
        self.last_ledger: Accountant | None = None
        # the first `timed_steps` steps time every node, for report() and for one re-plan with `replan` (a
        # function of the re-measured profile) when the measured step is more than REPLAN_OFF off the simulated one
        self.timed_steps = timed_steps
        self._replan = replan
        self._steps_timed = 0
        self._timings: list[tuple[float, dict[int, float], int | None]] = []  # (step ms, node ms, peak bytes)
        self._reports: list[StepReport] = []
        self._timed: _Prepared | None = None
        self._prepared: _Prepared | None = None
        # another input signature (sequence length, last partial batch): `plan_signature(inputs, kwargs, targets)`
        # plans it once, as optimize() planned the first; the plans of the `max_signatures` last used are kept
        if max_signatures < 1:
            raise ReplayError(f"max_signatures must be at least 1, not {max_signatures}")
        self._plan_signature = plan_signature
        self.max_signatures = max_signatures
        self._say = progress or (lambda message: None)
        self._signature: tuple | None = None
        self._plans: OrderedDict[tuple, dict] = OrderedDict()
        # signatures whose planning was refused (a budget, a capture): the same refusal at once when they come back,
        # not a capture and measuring that end the same way each time
        self._refused: OrderedDict[tuple, MososError] = OrderedDict()
        self.signatures_planned = 0  # input signatures planned after the first (each once, unless evicted)
        self._plan_token = plan_token
        self._pending_replan: BackgroundReplan | None = None  # a re-plan running beside training
        self._held_replans = 0  # re-plans within less started by a step that held more than the device budget
        self._live_step: weakref.ref | None = None  # the last step begun, until its backward
        self._superseded_nodes: list[weakref.ref] = []  # autograd nodes of superseded steps' losses still referenced
        self._set_measuring(profiled)
        if profiled is not None:
            self._prepared = _Prepared(self, profiled)
            self._signature = _step_signature(profiled.step, python_state(model, self.loss_fn))
        elif example_inputs is not None:
            inputs = as_tuple(example_inputs)
            check_inputs(profile, inputs, dict(kwargs or {}), targets)
            self._prepared = _Prepared(self, plan_step(model, inputs, kwargs, targets, self.loss_fn))
            self._signature = _step_signature(self._prepared.profiled.step, python_state(model, self.loss_fn))

    def _set_measuring(self, profiled: ProfiledStep | None) -> None:
        measuring = getattr(profiled, "measuring", None)
        # how the profile was measured (keep-all, or a frugal schedule within the budget), when optimize() made it
        self.profiled_under: str | None = measuring.describe() if measuring is not None else None
        # the most the measuring passes held, by the measured figures (None: not profiled by optimize())
        self.profiled_peak_bytes: int | None = measuring.measured_peak_bytes if measuring is not None else None

    # -- one plan per input signature -------------------------------------------------------------------

    @property
    def signatures(self) -> list[str]:
        """The input signatures this module holds plans for, the one in use last."""
        held = list(self._plans) + ([self._signature] if self._signature is not None else [])
        return [signature[0] + (f" targets {signature[1]}" if signature[1] else "")
                + (f" ({autocast.describe(signature[-1])})" if signature[-1] else "") for signature in held]

    def _switch_to(self, signature: tuple, inputs: tuple, kwargs: dict, targets) -> None:
        """Make `signature`'s plan the one in use: kept from before, or planned now (once)."""
        self._plans[self._signature] = {name: getattr(self, name) for name in _PLAN_STATE}
        kept = self._plans.pop(signature, None)
        if kept is not None:
            for name, value in kept.items():
                setattr(self, name, value)
            self._signature = signature
            return
        refused = self._refused.get(signature)
        if refused is not None:
            again = copy.copy(refused)
            again.args = (f"{refused} (refused before in this run; nothing was planned again)", *refused.args[1:])
            raise again
        reason = None
        if self._signature is not None and _without_state(signature) == _without_state(self._signature):
            reason = (f"the model changed since its step was captured "
                      f"({describe_change(self._signature[_STATE], signature[_STATE])})")
            self._say(f"{reason}: planning it again (plans kept for the last {self.max_signatures} signatures)")
        else:
            what, advice = _what_is_new(self._signature, signature)
            self._say(f"{what}: planning it once (plans kept for the last {self.max_signatures} signatures)"
                      + (f"; {advice}" if advice else ""))
        while len(self._plans) >= self.max_signatures:  # the current one is about to join them
            evicted, _ = self._plans.popitem(last=False)
            self._say(f"dropping the plan for input signature {evicted[0]} (least recently used)")
        # until the new plan exists, no plan is in use: a failure below leaves the kept ones as they were
        self._signature, self._prepared, self._timed, self._pending_replan = None, None, None, None
        try:
            profile, schedule, profiled, token = self._plan_signature(inputs, kwargs, targets)
        except MososError as error:
            if reason is not None:  # a budget that held for the model as it was (model.to(torch.float64) after it)
                error.args = (f"{reason}, and planning it again failed: {error}", *error.args[1:])
            else:  # which call it was: the shapes, not only in a progress line
                error.args = (f"planning the {what} failed: {error}", *error.args[1:])
            if isinstance(error, (BudgetError, CaptureError)):  # the same answer next time: a time limit may differ
                self._refused[signature] = error
                while len(self._refused) > REFUSALS_KEPT:
                    self._refused.popitem(last=False)
            raise
        self._plans.pop(signature, None)
        self.profile, self.schedule, self._plan_token = profile, schedule, token
        self._device_budget_bytes = _device_budget(schedule, self.outside_allocator_bytes)
        self._held_replans = 0
        simulated = simulate(profile, schedule, keep_timeline=False)
        self.simulated_peak_bytes = simulated.peak_memory_bytes
        self.simulated_step_time_ms = simulated.step_time_ms
        self._steps_timed, self._timings, self._reports = 0, [], []
        self._set_measuring(profiled)
        self._prepared = _Prepared(self, profiled)
        self._signature = signature
        self.signatures_planned += 1

    def __deepcopy__(self, memo: dict) -> "PlannedModule":
        """A copy (an EMA model, a model soup) holds a copy of the model under the same plan and captures its own step
        at its first training call; the original's generated code, runtime and kept plans are its own. The copy
        plans no new input signatures (that goes through optimize(), which planned the original's model)."""
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name not in _NOT_COPIED:
                copied.__dict__[name] = copy.deepcopy(value, memo)
        copied._without_step()
        return copied

    def __getstate__(self) -> dict:
        """Pickled (torch.save of the whole module) as a deep copy is made: the model and its plan, not the
        generated code or the runtime, which the loaded module makes again at its first training call. Its
        progress messages are left behind (optimize()'s printer is a closure); the loaded module is quiet."""
        return {name: value for name, value in self.__dict__.items() if name not in (*_NOT_COPIED, "_say")}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._say = _quiet
        self._without_step()

    def _without_step(self) -> None:
        self._prepared = self._timed = self._live_step = self.last_ledger = None
        self._superseded_nodes = []
        self._plans = OrderedDict()
        self._refused = OrderedDict()
        self._plan_signature = self._replan = self._pending_replan = None
        self._arena = Arena(self.device)  # its own, made at its first step (a copy or a loaded module shares none)
        optimizer_state.watch(self)  # its own optimizer is checked against its plan too

    @property
    def code(self) -> str | None:
        """The generated step (None until the model is captured)."""
        return self._prepared.source if self._prepared is not None else None

    @property
    def peak_memory_bytes(self) -> int | None:
        """The ledger's peak of the last step (fixed memory included); None without the ledger."""
        return self.last_ledger.peak_bytes() if self.last_ledger is not None else None

    def forward(self, *args, targets=None, **kwargs):
        if targets is None and self.profile.provenance.target_signature is not None and len(args) >= 2:
            *args, targets = args
        inputs = tuple(args)
        if not torch.is_grad_enabled() or (not self.model.training
                                            and not any(p.requires_grad for p in self.model.parameters())):
            # evaluation (torch.no_grad(), or model.eval() with nothing to train): the model's own forward, which
            # saves nothing for a backward. model.eval() with gradients on is a step like another: planned for eval
            # mode (dropout off, BatchNorm's running statistics) as for any change of the model's Python state, since
            # the own forward would save every activation (a tiny GPT-2 at its smallest budget went 54% over)
            output = self.model(*inputs, **kwargs)
            return self.loss_fn(output, targets) if targets is not None else self.loss_fn(output)
        leaves, spec = tree_flatten(((inputs, kwargs, targets), {}))
        signature = _call_signature(inputs, kwargs, targets, leaves, spec, autocast.autocast_state(),
                                    python_state(self.model, self.loss_fn))
        if (self._plan_signature is None and self._signature is not None
                and signature[_STATE] != self._signature[_STATE]):
            raise ProfileMismatch(
                f"the model changed since its step was captured "
                f"({describe_change(self._signature[_STATE], signature[_STATE])}), and the replay runs the captured "
                "graph, not forward: plan it again (a module from optimize() does so by itself)")
        self._take_replan()
        if self._plan_signature is not None and signature != self._signature:
            if self._signature is None and self._plans:  # a failed planning of a new signature: say it again
                self._signature = next(reversed(self._plans))
                for name, value in self._plans.pop(self._signature).items():
                    setattr(self, name, value)
            if signature != self._signature:
                self._switch_to(signature, inputs, kwargs, targets)
                self._take_replan()  # one that came for this signature's plan while another ran
        check_inputs(self.profile, inputs, kwargs, targets)
        try:
            autocast.refuse_value_dependent_masks(kwargs, signature[-1])
        except CaptureError as error:
            raise ReplayError(str(error)) from None
        if self._signature is not None and signature[-1] != self._signature[-1]:
            raise ProfileMismatch(
                f"this step was captured with {autocast.describe(self._signature[-1])} but is called under "
                f"{autocast.describe(signature[-1])}: its casts would differ from eager's; plan it for this precision "
                "(a module from optimize() does so by itself)")
        wanting = [i for i, value in enumerate(leaves) if isinstance(value, torch.Tensor) and value.requires_grad]
        if wanting:
            raise ReplayError(
                f"input {wanting[0]} requires a gradient, but the replay computes the parameters' gradients only "
                "and would leave the input's .grad empty: pass it without requires_grad (or .detach() it)"
            )
        if self._prepared is None:
            self._prepared = _Prepared(self, plan_step(self.model, inputs, kwargs, targets, self.loss_fn))
        prepared = self._prepared
        if self.timing:
            if self._timed is None:
                self._timed = _Prepared(self, prepared.profiled, timed=True)
            prepared = self._timed
        if spec != prepared.input_spec:
            raise ProfileMismatch(f"this step's inputs are structured as {spec}, the captured step's as "
                                  f"{prepared.input_spec}: capture the model again for these inputs")
        for index, value in prepared.constant_leaves.items():
            if leaves[index] != value:
                raise ProfileMismatch(f"input leaf {index} is {leaves[index]!r} here but was {value!r} when the model "
                                      "was captured (non-tensor inputs are part of the graph): capture it again")
        # the parameters the graph computes gradients for (names resolved once: walking the module tree each step
        # costs as much as a tenth of a small model's step)
        parameters = prepared.feeder.parameters()
        if not any([p.requires_grad for p in parameters]):
            raise ReplayError("the model has no trainable parameters: there is nothing to plan a backward for")
        _refuse_gradient_hooks(self.model, parameters)
        _refuse_uncounted_gradient_buckets(self)
        self._supersede_live_step()
        feed = prepared.feeder.feed(leaves)
        ledger_key = tuple([p.grad is None for p in parameters]) if prepared.checks_once else None
        program, keeps_ledger = prepared.program_for(ledger_key)
        ledger = Accountant(self.profile, self.profile.fixed_bytes) if keeps_ledger else None
        prepared.bind(program, self._arena)
        prepared.runtime.begin_step(parameters, ledger)
        # a step without the ledger repeats the checked one's bytes: its ledger stands for this step's
        self.last_ledger = ledger if ledger is not None or ledger_key is None else prepared.checked[ledger_key]
        state = _StepState(prepared, feed, leaves, program)
        state.ledger_key = ledger_key if ledger is not None else None
        state.planned = self
        self._live_step = weakref.ref(state)
        if self.device_memory is not None:
            self.device_memory.begin_step()
        if hooks_wait_for_accumulation(parameters):  # their AccumulateGrad nodes must run: every parameter an edge
            return _StepFunction.apply(self, state, *parameters)
        state.anchored = parameters
        note_anchored(self.model)
        return _StepFunction.apply(self, state, edge_anchor())

    def _step_held(self) -> None:
        """After a step's backward: what the device held during it, against the budget."""
        if self.device_memory is None:
            return
        budget = self._held.budget_bytes = self._device_budget_bytes
        held = self.device_memory.end_step()
        over = self._held.add(held)
        if over and self._held.steps_over_budget == 1:
            self._say(f"warning: step {self._held.steps} held {format_bytes(held.held_peak_bytes)} on the device "
                      f"(allocator reserved {format_bytes(held.reserved_peak_bytes)}, outside the allocator "
                      f"{format_bytes(held.outside_allocator_bytes)}), more than the budget of "
                      f"{format_bytes(budget)}: report() counts such steps")
        if over:
            self._replan_within_less(held.held_peak_bytes - budget)

    def _replan_within_less(self, excess_bytes: int) -> None:
        """A step held more than the device's budget (the allocator's fragmentation, a library's workspace outside
        the plan): plan again, beside training, within the plan's budget less the excess, at most HELD_REPLANS times;
        the new plan is taken at a step boundary, as a re-plan on timings is."""
        if self._replan is None or self._pending_replan is not None or self._held_replans >= HELD_REPLANS:
            return
        lowered = self.schedule.budget_bytes - excess_bytes  # a step is over only where there is a budget
        self._held_replans += 1
        if lowered <= self.profile.fixed_bytes:
            self._held.replans.append(f"no re-plan within less: {format_bytes(excess_bytes)} over leaves nothing "
                                      "beside fixed memory")
            return
        self._say(f"re-planning within {format_bytes(lowered)} (the plan's budget less the "
                  f"{format_bytes(excess_bytes)} the step held over the device's), beside training")
        self._held.replans.append(f"re-planning within {format_bytes(lowered)} after a step "
                                  f"{format_bytes(excess_bytes)} over")
        self._pending_replan = BackgroundReplan(self._replan, self.profile,
                                                self.schedule.model_copy(update={"budget_bytes": lowered}),
                                                self._plan_token, None)

    @property
    def held_memory(self) -> HeldRecord | None:
        """Every step's held memory against the budget (None without a device to read: the CPU)."""
        return self._held if self.device_memory is not None else None

    def _supersede_live_step(self) -> None:
        """A step whose loss is still referenced but was not backed up (skipped, or kept for later) ends here: its
        saved tensors go, as the plan's budget holds one step at a time, and a later backward of it is refused."""
        live = self._live_step() if self._live_step is not None else None
        self._live_step = None
        if live is None or live.backward_done or live.superseded:
            return
        live.superseded = True
        live.feed, live.live = [], ()
        live.prepared.runtime.end_step()
        self._superseded_nodes = [node for node in self._superseded_nodes if node() is not None]
        if live.node is not None:
            self._superseded_nodes.append(live.node)

    def _refuse_backward_through_superseded(self) -> None:
        """One backward through this step's loss and a superseded one's (their sum): autograd runs the later step
        first, so refusing only when it reaches the earlier one would leave the later gradients written."""
        for reference in self._superseded_nodes:
            node = reference()
            if node is not None and torch._C._will_engine_execute_node(node):
                raise ReplayError(
                    "this backward also goes through an earlier call of this planned module, whose saved tensors "
                    "were freed when the next call began (the plan's budget holds one call at a time): call "
                    "backward() on each call's loss before the next call (gradients accumulate across calls, as in "
                    "eager PyTorch); a module used twice in one forward (weights shared) cannot be planned apart: "
                    "plan the module that contains both uses. No gradient of this planned module was written; the "
                    "rest of the model's, computed before autograd reached it, may have been: zero them before "
                    "the next step"
                )

    # -- measured against planned --------------------------------------------------------------------

    def _step_timed(self, runtime: TimedStepRuntime) -> None:
        """After a timed step's backward: keep its figures; after the last, compare and re-plan once if off."""
        self._steps_timed += 1
        peak = self.last_ledger.peak_bytes() if self.last_ledger is not None else (
            torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None)
        node_ms = runtime.node_times_ms()
        computations = sum(runtime.counts.values())
        if not runtime.cuda and computations:
            # the step's glue between nodes (frees, calls, the ledger), shared per computation as the profiler does
            glue_ms = max(0.0, runtime.step_ns / 1e6 - sum(ms * runtime.counts.get(g, 1) for g, ms in node_ms.items()))
            node_ms = {g: ms + glue_ms / computations for g, ms in node_ms.items()}
        self._timings.append((runtime.step_ns / 1e6, node_ms, peak))
        if self._steps_timed < self.timed_steps:
            return
        self._timed = None
        report = self._compare()
        self._reports.append(report)
        if report.off and self._replan is not None and not any(r.replanned or r.replan_failed or r.replan_kept
                                                                for r in self._reports[:-1]):
            profile = measured_profile(self.profile, self.schedule, self._measured_node_ms())
            self._say("the planned step is more than 10% off the simulated one: re-planning on the measured node "
                      "times, beside training")
            # the solver runs beside training: the steps go on under the current plan, which holds the budget, and
            # the new one is taken at the first step boundary after it is ready
            self._pending_replan = BackgroundReplan(self._replan, profile, self.schedule, self._plan_token, report)

    def _take_replan(self) -> None:
        """At a step boundary: the background re-plan's answer, if it has come."""
        pending = self._pending_replan
        if pending is None or not pending.done():
            return
        self._pending_replan = None
        report = pending.report  # None: a re-plan within less, started by a step over the device's budget
        if pending.error is not None:
            if not isinstance(pending.error, MososError):
                raise pending.error
            # a better plan not found (a solver's time limit, a planner service down) fails no step: the current
            # plan holds the budget, and the report says why it stays
            failed = f"{type(pending.error).__name__}: {pending.error}"
            if report is not None:
                report.replan_failed = failed
            else:
                self._held.replans.append(f"the re-plan within less found no plan ({failed})")
            self._say(f"re-planning found no plan; the current one stays: {pending.error}")
            return
        schedule = pending.schedule
        if schedule is None:  # kept on purpose (a plan from the cache whose picks decide the rounding)
            if report is not None:
                report.replan_kept = True
            return
        if report is not None:
            report.replanned = True
            report.replan_step_time_ms = schedule.summary.predicted_step_time_ms if schedule.summary else None
        else:
            self._held.replans.append(f"re-planned within {format_bytes(schedule.budget_bytes)}, taken at step "
                                      f"{self._held.steps + 1}")
        self._adopt(pending.profile, schedule)
        self._steps_timed = 0  # time the new plan's first steps too, and report them

    def wait_for_replan(self, timeout_s: float | None = None) -> bool:
        """Between steps: wait for a re-plan running beside training and take its plan now (a benchmark that wants
        its steady state on the final plan). False if one is still running after `timeout_s`."""
        pending = self._pending_replan
        if pending is not None and not pending.wait(timeout_s):
            return False
        self._take_replan()
        return True

    @property
    def replanning(self) -> bool:
        """Whether a re-plan is running beside training."""
        return self._pending_replan is not None

    def _measured_node_ms(self) -> dict[str, float]:
        """Per node: the least of its times over the timed steps (the first step may run cold)."""
        groups = self._prepared.profiled.planning.groups
        found: dict[str, float] = {}
        for _, times, _ in self._timings:
            for g, ms in times.items():
                found[groups[g].id] = min(ms, found.get(groups[g].id, float("inf")))
        return found

    def _compare(self) -> StepReport:
        measured_ms = min(step for step, _, _ in self._timings)
        peaks = [peak for _, _, peak in self._timings if peak is not None]
        return StepReport(
            strategy=self.schedule.summary.strategy if self.schedule.summary else "?",
            steps_timed=len(self._timings), measured_step_time_ms=measured_ms,
            simulated_step_time_ms=self.simulated_step_time_ms,
            measured_peak_bytes=max(peaks) if peaks else None, simulated_peak_bytes=self.simulated_peak_bytes,
            budget_bytes=self.schedule.budget_bytes,
            nodes=node_differences(self.profile, self.schedule, self._measured_node_ms()),
            compiled=self.compiled_nodes,
        )

    def _adopt(self, profile: GraphProfile, schedule: Schedule) -> None:
        profiled = self._prepared.profiled
        self.profile, self.schedule = profile, schedule
        simulated = simulate(profile, schedule, keep_timeline=False)
        self.simulated_peak_bytes = simulated.peak_memory_bytes
        self.simulated_step_time_ms = simulated.step_time_ms
        self._timings = []
        # the arena is made again at the new plan's size at its first step (a plan within less holds less)
        self._arena.release()
        self._prepared = _Prepared(self, profiled)

    @property
    def timing(self) -> bool:
        """Whether the next step is a timed one, run node by node (the first `timed_steps` steps, and as many again
        after a re-plan): a benchmark's steady state starts at the first step where this is False."""
        return self._steps_timed < self.timed_steps

    @property
    def compiled_nodes(self) -> CompiledNodes | None:
        """With `compile`: the nodes that run as Inductor kernels, and those that run eagerly with the reason."""
        prepared = self._prepared
        return prepared.compiled if prepared is not None else None

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena this module holds (0 without planned addresses in use)."""
        return self._arena.size_bytes

    @property
    def arena_refused(self) -> str | None:
        """With `arena=True`: why the step goes through the allocator instead (None: it writes into the arena, or
        the arena was not asked for)."""
        prepared = self._prepared
        return prepared.arena_refused if prepared is not None else None

    @property
    def arena_allowances(self) -> dict[str, str] | None:
        """With planned addresses in use: per node, what it allocates outside the arena and why (None: no arena)."""
        prepared = self._prepared
        if prepared is None or prepared.arena_bytes is None:
            return None
        return dict(prepared.program.allowances)

    @property
    def arena_kept_out(self) -> list[str]:
        """Nodes whose results a step kept where they were computed instead of copying them into their slot: their
        dtype in the run was not the trace's (a fake kernel's), and the copy would have cast them. Their bytes are
        beside the arena and not in its bound; empty where every copy matched."""
        prepared = self._prepared
        if prepared is None:
            return []
        return [prepared.runtime.node_ids[group] for group in sorted(prepared.runtime.kept_outside)]

    @property
    def attention_notes(self) -> list[str]:
        """Per attention with a mask in the captured step: taken out as eager passes none, or kept and why
        (executor.capture.attention)."""
        prepared = self._prepared
        return list(prepared.profiled.step.attention_notes) if prepared is not None else []

    @property
    def loss_notes(self) -> list[str]:
        """With optimize(..., split_loss=True): per cross-entropy in the captured step, split over chunks of rows or
        computed whole, and why (executor.capture.split_loss)."""
        prepared = self._prepared
        return list(prepared.profiled.step.loss_notes) if prepared is not None else []

    def report(self) -> StepReport | None:
        """Measured against planned: the step time and peak of the first timed steps beside the simulator's, and
        the nodes whose measured time differs most from the profile's (None until the timed steps have run).
        After a re-plan, the report of the new plan's timed steps, with `history` the earlier ones."""
        if not self._reports:
            return None
        latest = self._reports[-1]
        latest.history = self._reports[:-1]
        latest.held = self.held_memory
        return latest


# what belongs to one input signature's plan, kept with it while another signature runs; a re-plan running beside
# training is its plan's (taken onto another signature's step, it failed as "a profile made for another model")
_PLAN_STATE = ("profile", "schedule", "simulated_peak_bytes", "simulated_step_time_ms", "_steps_timed", "_timings",
               "_reports", "_timed", "_prepared", "profiled_under", "profiled_peak_bytes", "_plan_token",
               "_pending_replan", "_device_budget_bytes", "_held_replans")


def _quiet(message: str) -> None:
    pass


# Re-plans within less that steps over the device's budget may start, per input signature's plan: where a second one
# still holds too much, what grows is not the plan's to shrink, and the report says so
HELD_REPLANS = 2


def _device_budget(schedule: Schedule, outside_allocator_bytes: int) -> int | None:
    return schedule.budget_bytes + outside_allocator_bytes if schedule.budget_bytes is not None else None


# Set when the process exits: a re-plan still running beside training stops its solver (plan()'s should_stop), and
# exit waits for it. A solver's thread left running into the interpreter's finalization aborted the process (a
# two-step script whose re-plan began after its first steps ended with SIGABRT, its steps all done).
STOPPING = threading.Event()
_RUNNING: "weakref.WeakSet[BackgroundReplan]" = weakref.WeakSet()
_EXIT_WAIT_S = 30.0


@atexit.register
def _stop_replans() -> None:
    STOPPING.set()
    until = time.monotonic() + _EXIT_WAIT_S
    for replan in list(_RUNNING):
        replan.join(max(0.0, until - time.monotonic()))


class BackgroundReplan:
    """One re-plan on a thread of its own (CP-SAT releases the GIL while it searches), asked to stop when the
    process exits (`STOPPING`, which optimize()'s re-plan passes to plan() as should_stop)."""

    def __init__(self, replan: Callable, profile: GraphProfile, schedule: Schedule, token: object,
                 report: StepReport | None):
        self.profile = profile
        self.report = report
        self.schedule: Schedule | None = None
        self.error: BaseException | None = None
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(replan, profile, schedule, token),
                                        name="mosos-replan", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _run(self, replan, profile, schedule, token) -> None:
        try:
            self.schedule = replan(profile, schedule, token)
        except BaseException as error:  # noqa: BLE001 - handed to the training thread at the next step boundary
            self.error = error
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._finished.wait(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        """Until its thread has ended, not only its answer: at exit, nothing of it may still run when the
        interpreter finalizes."""
        self._thread.join(timeout_s)


def _output_is_the_loss(output):
    return output


_NOT_COPIED = ("_prepared", "_timed", "_live_step", "_superseded_nodes", "last_ledger", "_plans", "_plan_signature",
               "_replan", "_refused", "_pending_replan", "_arena")
REFUSALS_KEPT = 16
_STATE = 4  # where a signature holds the model's Python state (executor.capture.python_state)


def _signature_parts(input_signature: str, target_signature: str | None, spec, constants: dict,
                     autocast_state: tuple, model_state: tuple) -> tuple:
    return (input_signature, target_signature, str(spec), repr(sorted(constants.items())), model_state,
            tuple(autocast_state))


def _what_is_new(previous: tuple | None, signature: tuple) -> tuple[str, str | None]:
    """(why a call needs a plan of its own, against the signature in use; advice). A Python number among the inputs
    that changes every step (a mixup weight) plans every step, which the message says, with the cure."""
    new = f"new input signature {signature[0]}" + (
        f" under {autocast.describe(signature[-1])}" if signature[-1] else "")
    if previous is None or previous[:2] != signature[:2] or previous[-1] != signature[-1]:
        return new, None
    if previous[2] != signature[2]:
        return f"{new} (the inputs' structure changed: {_shortened(signature[2])})", None
    if previous[3] != signature[3]:
        return (f"{new} (an input that is not a tensor changed value: {_shortened(previous[3])} -> "
                f"{_shortened(signature[3])})",
                "each such value is a step of its own: one that changes every step (a mixup weight, a scale) is "
                "better passed as a 0-d tensor, planned once")
    return new, None


def _shortened(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _without_state(signature: tuple) -> tuple:
    return signature[:_STATE] + signature[_STATE + 1:]


def _step_signature(step, model_state: tuple) -> tuple:
    """What a captured step was made for (shapes, structure, the model's Python state, autocast): a call with another
    signature needs another capture and plan."""
    return _signature_parts(step.input_signature, step.target_signature, step.input_spec, step.constant_leaves,
                            step.autocast, model_state)


def _call_signature(inputs: tuple, kwargs: dict, targets, leaves: list, spec, autocast_state: tuple,
                    model_state: tuple) -> tuple:
    constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
    return _signature_parts(tensor_signature(inputs, kwargs),
                            tensor_signature(targets) if targets is not None else None, spec, constants,
                            autocast_state, model_state)


class _StepState:
    def __init__(self, prepared: _Prepared, feed: list, leaves: list, program: Program):
        self.prepared = prepared
        self.program = program
        self.ledger_key: tuple | None = None  # a step whose ledger, once its backward ends, checks its program
        self.feed = feed
        self.leaves = leaves
        self.live: tuple = ()
        self.backward_done = False
        self.superseded = False  # a later step began before this one's backward
        self.planned = None
        self.node: weakref.ref | None = None  # the loss's autograd node (the step function's context)
        # the parameters of a step whose one autograd input is the edge anchor (executor.replay.gradient_edges)
        self.anchored: list | None = None


class _StepFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, planned: PlannedModule, state: _StepState, *parameters):
        prepared = state.prepared
        started = prepared.clock() if prepared.timed else 0
        with autocast.disabled():  # the graph carries autocast's casts; the ambient autocast would cast again
            loss, state.live = state.program.parts[0](state.feed, prepared.runtime)
        if prepared.timed:
            prepared.runtime.part(started)
        if loss is None:
            raise ReplayError("the schedule's forward part never computed the loss")
        prepared.runtime.loss_storage = loss.untyped_storage().data_ptr()
        ctx.state = state
        state.node = weakref.ref(ctx)
        ctx.parameters = parameters
        return loss.as_subclass(PlannedLoss) if state.anchored is not None else loss

    @staticmethod
    def backward(ctx, grad_loss):
        state = ctx.state
        if state.superseded:
            raise ReplayError(
                "this step's backward comes after the planned module began a later step, which freed this one's "
                "saved tensors (the plan's budget holds one step at a time): call backward() on each loss before "
                "the next call (gradients accumulate across calls, as in eager PyTorch)"
            )
        # the AccumulateGrad nodes this step's graph holds, one per tensor input (the module and the state have
        # none; found through get_gradient_edge, they took 27 us a parameter at every step)
        refuse_other_backwards([node for node, _ in ctx.next_functions])
        if state.anchored is not None:
            refuse_hooks_added_since_forward(state.anchored)
        state.planned._refuse_backward_through_superseded()
        if state.backward_done:
            raise ReplayError(
                "this step's backward has already run and its saved tensors are freed as the plan says "
                "(retain_graph is not supported): call the planned module again for another step"
            )
        state.backward_done = True
        prepared = state.prepared
        runtime = prepared.runtime
        try:
            with torch.no_grad(), autocast.disabled():
                started = prepared.clock() if prepared.timed else 0
                if prepared.tangent_index is not None:
                    state.feed[prepared.tangent_index] = grad_loss
                if len(state.program.parts) > 1:
                    live, state.live = [state.live], ()
                    state.program.parts[1](state.feed, runtime, grad_loss, live)
                prepared.feeder.write_back(runtime.staging, state.leaves, state.program.direct)
                if prepared.timed:
                    runtime.part(started)
        finally:
            runtime.end_step()
            state.feed = []
            state.live = ()
        if state.ledger_key is not None and state.planned.last_ledger is not None:
            prepared.checked.setdefault(state.ledger_key, state.planned.last_ledger)
        state.planned._step_held()
        if prepared.timed:
            state.planned._step_timed(runtime)
        return (None, None) + accumulation_signals(ctx.parameters)


_BUCKETS_CHECKED: "weakref.WeakSet" = weakref.WeakSet()  # DistributedDataParallel wrappers whose buckets fit


def _refuse_uncounted_gradient_buckets(planned: PlannedModule) -> None:
    """DistributedDataParallel keeps a flat copy of every gradient in its buckets, beside the `.grad` tensors the
    plan counts, unless it was built with gradient_as_bucket_view=True (then `.grad` is a view of its buckets). One
    more copy of the gradients all step long, or, with bucket views, at the start of its second forward, where it
    rebuilds its buckets before any activation is held: refused where the budget has no room for it."""
    budget = planned.schedule.budget_bytes
    if budget is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)  # set while its forward runs ours
    if ddp is None or ddp in _BUCKETS_CHECKED:
        return
    copy_bytes = planned.profile.fixed_memory.gradients_bytes
    views = getattr(ddp, "gradient_as_bucket_view", False)
    over = (planned.profile.fixed_bytes if views else planned.simulated_peak_bytes) + copy_bytes - budget
    if over > 0:
        where = ("while it rebuilds its buckets, at the start of its second forward, with the fixed memory" if views
                 else "all step long, with the plan's peak")
        remedy = ("plan for a budget that leaves room for it" if views else
                  "build it with DistributedDataParallel(..., gradient_as_bucket_view=True): the gradients then live "
                  "in its buckets and nothing more is held")
        raise ReplayError(
            f"DistributedDataParallel keeps a copy of the gradients in its buckets, {copy_bytes} bytes "
            f"({format_bytes(copy_bytes)}) the plan does not count: {where}, {over} bytes over the budget of "
            f"{format_bytes(budget)}. To train within it, {remedy}")
    _BUCKETS_CHECKED.add(ddp)


def _refuse_gradient_hooks(model: nn.Module, parameters: list[torch.Tensor]) -> None:
    """A hook registered with Tensor.register_hook on a parameter sees (and may change) its gradient before it is
    accumulated; the replay writes gradients into `.grad` itself, so such a hook would see none."""
    hooked = next(iter([p for p in parameters if p._backward_hooks]), None)  # a list: no generator call a parameter
    if hooked is None:
        return
    name = next((name for name, p in model.named_parameters(remove_duplicate=False) if p is hooked), "a parameter")
    raise ReplayError(
        f"parameter {name!r} has a gradient hook (Tensor.register_hook): the replay writes each parameter's gradient "
        "into .grad itself, so the hook would never see it. Act on p.grad with "
        "register_post_accumulate_grad_hook (which the replay runs as eager does), or after backward()"
    )

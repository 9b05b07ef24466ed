"""Generate the planned training step as Python code, once per schedule.

The code calls the ATen operators of each planning node in schedule order,
with the schedule's offloads, prefetches, waits and frees, and
recomputations, inlined. Values are Python locals named after the joint
graph's nodes (`v_<name>`); a value is dropped (`v_x = None`) exactly where
the schedule frees its planning node, and a node's transient intermediates
right after their last use inside it. Views are not planned: each planning
node derives the views it reads from their storage's root when it runs.

The step is cut in two functions at the first backward computation:
`forward_part(F, S)` returns the loss and the values still live, and
`backward_part(F, S, tangent, live)` runs the rest. `F` is the list of the
graph's inputs (parameters, buffers, constants, the user's inputs) in
placeholder order; `S` is the runtime (transfers, RNG states, staging buffers
for written-back buffers, parameter gradients, and optionally the ledger and
the timing or memory hooks of the profiler).

With a node compiler, a node runs as its compiled kernel, and consecutive
computations with only frees between them as one compiled region
(executor.engine.regions): a region's code is one kernel call, then in schedule order
the graph outputs its nodes hand over, the ledger's entries (a node computed
and freed inside counts its planned size) and the frees.

Modes (each adds calls to the generated code, nothing to the fast path):
`ledger` (the byte-exact accountant), `strict` (real sizes checked against the
profile, freed memory checked to be released), `timing` and `memory` (the
profiler's hooks around every planning node).
"""

from __future__ import annotations

import linecache
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from executor.engine import arena, bindings, conv_algorithms
from executor.engine.arena import Layout
from executor.capture.capture import HAND_OFF, SHAPE_ONLY
from executor.engine.compiled_nodes import EAGER
from executor.capture.planning_graph import CONVOLUTION, CONVOLUTION_BACKWARD, Group, PlanningGraph, is_random
from executor.engine.regions import regions as region_ranges
from planner.addresses import aligned
from planner.schedule import Compute, Free, Offload, Prefetch, Schedule, Wait
from planner.strategies.per_block import layer_prefix

if TYPE_CHECKING:
    from executor.engine.compiled_nodes import NodeCompiler


BATCH_NORM_FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default
BATCH_NORM_IN_PLACE = torch.ops.aten._native_batch_norm_legit.default
_IDENTITY_VIEWS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


@dataclass(frozen=True)
class Op:
    """One operation of a program: compute (with an implementation), offload, prefetch, wait, free."""

    kind: str
    group: int
    implementation: str = "default"
    transfer: str = ""  # wait: offload | prefetch
    offset_bytes: int | None = None  # compute, prefetch: the planned address of its outputs (with Modes.arena)
    workspace_offset_bytes: int | None = None  # compute: the planned address of its workspace slot
    workspace_bytes: int = 0  # compute: the implementation's workspace in the profile (all it holds, wherever)
    workspace_slot_bytes: int = 0  # compute: its workspace slot in the arena (the profile's arena part of it)


@dataclass
class Modes:
    ledger: bool = False
    strict: bool = False
    timing: bool = False  # also reports each node's real output sizes
    memory: bool = False  # record_function scopes (CPU) or allocator statistics (CUDA) around each node
    # mutations (by index) that may be written straight into their tensor, where nothing later reads it, instead
    # of through a staging buffer and a copy at the end of the step (the replay: the model's own buffers)
    direct_writes: frozenset = frozenset()
    # write each node's outputs into its planned slot of the arena (executor.engine.arena), where the schedule has
    # planned addresses; the program names what it cannot place
    arena: bool = False


@dataclass
class Program:
    """Compiled parts of one step and what the runtime needs to call them."""

    source: str
    parts: list[Callable]
    live_after: list[list[str]]  # names handed from one part to the next
    computes: int
    constants: dict[str, Any] = field(default_factory=dict)
    direct: frozenset = frozenset()  # mutations written in place during the step (no write-back at its end)
    # with Modes.arena: the tensors of the slots it writes (S.slots, by index), and per node id what it allocates
    # outside the arena and why
    slots: list = field(default_factory=list)
    allowances: dict[str, str] = field(default_factory=dict)
    written: frozenset = frozenset()  # node ids whose outputs out= overloads write into their slots (no allocation)
    prefetched_into: frozenset = frozenset()  # node ids prefetched into their slots (no allocation)
    # per computation writing into the arena, in order: (node id, bytes it no longer asks the allocator for: its
    # outputs where out= overloads write them all, and the values made and dropped inside placed in its workspace)
    placed: list = field(default_factory=list)
    # what the allocator may hold beside the arena at once in this program: the most, over its operations, of the
    # nodes kept out of it that are live then and what that computation holds for itself (results copied in, the
    # workspace of operations that allocate their own)
    outside_arena_bytes: int = 0
    # the same for any order of these nodes' computations (every node kept out live at once, with the largest
    # computation's own): what a plan not yet made must leave room for
    outside_arena_any_order_bytes: int = 0


def _literal(value, constants: dict[str, Any]) -> str:
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return repr(value)
        return _constant(value, constants)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_literal(v, constants) for v in value)
        if isinstance(value, tuple):
            return f"({inner}{',' if len(value) == 1 else ''})"
        return f"[{inner}]"
    return _constant(value, constants)


def _constant(value, constants: dict[str, Any]) -> str:
    for name, existing in constants.items():
        if existing is value or (type(existing) is type(value) and not isinstance(value, torch.Tensor)
                                 and _same(existing, value)):
            return name
    name = f"c_{len(constants)}"
    constants[name] = value
    return name


def _same(a, b) -> bool:
    try:
        return bool(a == b) and repr(a) == repr(b)
    except Exception:  # noqa: BLE001 - incomparable constants are distinct
        return False


def local(node: fx.Node) -> str:
    return f"v_{node.name}"


class _Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.indent = 1

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.indent + line)


class CodeGenerator:
    """Emits the code of planning nodes; one instance per generated program."""

    def __init__(self, planning: PlanningGraph, modes: Modes, cuda: bool = False,
                 compiler: "NodeCompiler | None" = None,
                 region_memory: tuple[list[int], Callable[[int, str], int]] | None = None):
        self.planning = planning
        self.compiler = compiler  # planning nodes as Inductor kernels where it can (executor.engine.compiled_nodes)
        # with a compiler: each node's planned size and each implementation's workspace, to run consecutive
        # computations as one compiled region where that cannot raise the step's peak (executor.engine.regions)
        self.region_memory = region_memory
        self.step = planning.step
        self.modes = modes
        self.cuda = cuda
        self.constants: dict[str, Any] = {}
        self.op_names: dict[Any, str] = {}
        self.position = {node: i for i, node in enumerate(self.step.graph.nodes)}
        self.placeholders = [n for n in self.step.graph.nodes if n.op == "placeholder"]
        self.feed_index = {n: i for i, n in enumerate(self.placeholders)}
        graph = planning
        self.loss_root = graph.root_of[self.step.loss]
        self.gradient_index = {value: k for k, (value, _, _) in enumerate(self.step.gradients)}
        self.mutation_index = {value: k for k, (value, _) in enumerate(self.step.mutations)}
        # graph outputs are handled inside the planning node that owns their storage; outputs that are views of
        # a graph input (a gradient that is the loss's own gradient, expanded) at the start of the backward part
        self.direct: set[int] = set()
        self.in_place_values: set[fx.Node] = set()  # values an in-place operation left in their graph input
        self._position = 0  # of the operation being generated
        self.slots: list[Layout] = []  # with Modes.arena: the arena's views the program writes, by index
        self._slot_index: dict[Layout, int] = {}
        self.allowances: dict[str, str] = {}  # node id -> what it allocates outside the arena, and why
        self.written: set[str] = set()  # node ids whose outputs are all written into their slots by out= overloads
        self.prefetched_into: set[str] = set()  # node ids prefetched into their slots
        self.placed: list[tuple[str, int]] = []  # per computation in the arena: (node id, bytes the allocator is spared)
        self.transient: list[tuple[str, int]] = []  # per computation: (node id, bytes it holds beside the arena)
        self.kept_outside: dict[str, int] = {}  # nodes whose outputs stay with the allocator -> their bytes
        # with Modes.arena, while a program is generated: the nodes kept out of the arena live on the device (group
        # index -> bytes), and the most they and one computation's own hold beside the arena at once (None: a
        # compiled region ran, whose operations are not followed one by one)
        self._outside_live: dict = {}
        self._outside_peak: int | None = 0
        self._views_of: dict[int, set[int]] = {}  # group index -> the groups whose storage its outputs view
        self._viewed: dict[int, int] = {}  # group index -> how many nodes on the device view its outputs
        self._offloading: set[int] = set()  # groups whose offload was issued and not yet waited for
        self._sees_storage: dict[fx.Node, bool] = {}
        self.rng_states_kept = 0  # random nodes recomputed later: their generator states live until the step ends
        self._last_read: dict[fx.Node, int] = {}  # mutated placeholder -> position of the last compute reading it
        self.outputs_of: dict[int | None, list[fx.Node]] = {}
        for value in list(self.gradient_index) + list(self.mutation_index) + [self.step.loss]:
            owner = graph.group_of.get(graph.root_of[value])
            self.outputs_of.setdefault(owner, []).append(value)

    # -- names ---------------------------------------------------------------------------------------

    def op(self, target) -> str:
        name = self.op_names.get(target)
        if name is None:
            base = target._op if isinstance(target, torch._ops.OpOverload) else target
            name = f"op_{len(self.op_names)}"
            self.op_names[target] = name
            self.constants[name] = base
        return name

    def op_for(self, node: fx.Node) -> str:
        """The name `node`'s operator is called by: torch's public binding where it calls exactly this overload with
        these arguments (executor.engine.bindings: a microsecond or two less a call), else the operator itself."""
        binding = bindings.public_binding(node)
        return self.op(node.target) if binding is None else self.op(binding)

    def value(self, node: fx.Node) -> str:
        if node.op == "placeholder":
            return f"F[{self.feed_index[node]}]"
        if node.op == "get_attr":
            return _constant(getattr(self.step.graph_module, node.target), self.constants)
        return local(node)

    def argument(self, argument) -> str:
        if isinstance(argument, fx.Node):
            return self.value(argument)
        if isinstance(argument, (list, tuple)):
            inner = ", ".join(self.argument(a) for a in argument)
            if isinstance(argument, tuple):
                return f"({inner}{',' if len(argument) == 1 else ''})"
            return f"[{inner}]"
        return _literal(argument, self.constants)

    # -- one planning node ---------------------------------------------------------------------------

    def compute(self, w: _Writer, group: Group, implementation: str, first: bool, rng_later: bool,
                offset_bytes: int | None = None, workspace: tuple[int, int] | None = None,
                workspace_bytes: int = 0) -> None:
        """The code of one computation of `group`: its operations, graph outputs, and transient frees; with
        Modes.arena, its outputs written into the slot at `offset_bytes`, and what it makes and drops inside into its
        workspace slot ((offset, bytes)); `workspace_bytes`: all the workspace the implementation holds, in its slot
        or beside the arena."""
        graph = self.planning
        w(f"# compute {group.id} [{implementation}]" + ("" if first else " (recompute)"))
        if self.modes.timing:
            w(f"S.tick({group.index})")
        if self.modes.memory:
            w(f"S.memory_begin({group.index})")
        if group.random and first and rng_later:
            w(f"S.rng[{group.index}] = S.get_rng()")
            self.rng_states_kept += 1
        if group.random and not first:
            w("_rng_now = S.get_rng()")
            w(f"S.set_rng(S.rng[{group.index}])")
        derived: list[fx.Node] = []  # view locals made here (dropped at the end)
        members = set(group.ops)
        made: set = set()
        body: list[tuple[fx.Node, list[str]]] = []  # (node, code lines) in order, for last-use frees
        compiled = self._compiled_call(group, implementation, first) if self.compiler is not None else None
        if compiled is not None:
            line, bound = compiled
            made.update(bound)
            body.append((None, [line]))
        slot_of = self._slots(group, offset_bytes) if self.modes.arena and compiled is None else {}
        scratch_of = self._scratch(group, implementation, first, workspace) if slot_of else {}
        copied, spared, copied_bytes = False, 0, 0  # spared: bytes out= overloads write into the arena
        functional = False  # an operation left to allocate its own results (and whatever scratch it takes)
        in_place_seen = False
        for op in group.ops if compiled is None else ():
            lines: list[str] = []
            for argument in op.all_input_nodes:
                self._derive(argument, lines, derived, made)
            in_place = first and self._batch_norm_in_place(op)
            in_place_seen = in_place_seen or in_place
            written = self._written(op, group, implementation, {**slot_of, **scratch_of}) \
                if slot_of and not in_place else None
            if in_place:
                lines.append(f"{local(op)} = {self.op(BATCH_NORM_IN_PLACE)}({self._arguments(op)})")
            elif written is not None:
                lines.append(written)
                spared += sum(graph.facts.root_bytes[value] for value in self._results(op))
            else:
                lines.extend(self._call(op, group, implementation))
                functional = True
            for item in sorted((u for u in op.users if u.target is operator.getitem), key=self.position.__getitem__):
                if in_place and item.args[1] in (3, 4):
                    # the running statistics, updated in the model's buffers by the call itself
                    lines.append(f"{local(item)} = {self.value(op.args[item.args[1]])}")
                    self.in_place_values.add(item)
                    made.add(item)
                elif item in graph.facts.root_bytes or item in graph.facts.alias_of:
                    lines.append(f"{local(item)} = {local(op)}[{item.args[1]}]")
                    made.add(item)
            if slot_of and written is None:
                # computed where the allocator puts it, then copied into its slot: the result's allocation lives
                # only as long as the copy (the allowance the program names), the slot as long as the plan says
                for value in self._results(op):
                    if value in slot_of:  # an output (a value made and dropped inside gains nothing by a copy)
                        # only in the traced dtype: a copy would cast silently where a fake kernel gave the trace
                        # another dtype than the run's (kept as computed, and the step says so: S.kept_out)
                        k = slot_of[value]
                        name = local(value)
                        lines.append(f"{name} = S.slots[{k}].copy_({name}) if {name}.dtype is S.slot_dtypes[{k}] "
                                     f"else S.kept_out({group.index}, {name})")
                        copied = True
                        copied_bytes += graph.facts.root_bytes[value]
            made.add(op)
            body.append((op, lines))
        tail = self._owned_outputs(group, first, derived, made)  # graph outputs whose storage this node owns
        if slot_of and not copied:
            self.written.add(group.id)
        if slot_of:
            self.placed.append((group.id, spared))
        kept = set(group.outputs) | self.planning.fixed_roots
        # values made and dropped inside the node that its workspace slot does not take: the allocator's
        unplaced = [value for op in group.ops for value in self._results(op)
                    if value not in scratch_of and value not in kept] if slot_of else []
        unplaced_bytes = sum(graph.facts.root_bytes[value] for value in unplaced)
        if unplaced:
            self._allow(group, arena.INTERMEDIATES)
        if self.modes.arena and compiled is None:
            # what the allocator holds beside the arena while this computation runs: results computed elsewhere and
            # copied in, the values made inside that its workspace slot does not take, and where an operation
            # allocates for itself up to the node's measured workspace besides (an in-place CNN's convolution,
            # computed where the allocator puts it, then multiplied into the workspace slot: the convolution's
            # result and the kernel's own scratch, both beside the arena, where the allocator alone had the
            # output's room for one of them). Never more than the node takes through the allocator alone (its
            # outputs and measured workspace): what the arena does not take is a part of that. A node kept out of
            # the arena holds its outputs there for as long as the schedule keeps them.
            slot_bytes = workspace[1] if workspace is not None else 0
            # an operation written in place takes its scratch from the slot, but what the slot leaves out of the
            # workspace (the profile's arena part is less) the kernel still allocates beside the arena
            own_bytes = unplaced_bytes + (workspace_bytes if functional or in_place_seen
                                          else max(0, workspace_bytes - slot_bytes))
            self.transient.append((group.id, min(copied_bytes + own_bytes,
                                                 self.planning.size_bytes(group) + workspace_bytes)))
            if not slot_of:
                self.kept_outside[group.id] = self.planning.size_bytes(group)
        # frees of transients right after their last use inside the node
        keep = set(group.outputs)
        transient = [n for n in made if n not in keep]
        last_line: dict[fx.Node, int] = {}
        flat: list[str] = []
        for op, lines in body:
            flat.extend(lines)
        flat.extend(tail)
        for index, line in enumerate(flat):
            for n in transient:
                if local(n) in _tokens(line):
                    last_line[n] = index
        for n in derived:
            for index, line in enumerate(flat):
                if local(n) in _tokens(line):
                    last_line[n] = max(last_line.get(n, -1), index)
        drop_after: dict[int, list[str]] = {}
        for n in set(transient) | set(derived):
            if n in keep:
                continue
            drop_after.setdefault(last_line.get(n, len(flat) - 1), []).append(local(n))
        for index, line in enumerate(flat):
            w(line)
            names = drop_after.get(index)
            if names:
                w(" = ".join(sorted(set(names))) + " = None")
        if group.random and not first:
            w("S.set_rng(_rng_now)")
        if self.modes.memory:
            w(f"S.memory_end({group.index})")
        if self.modes.timing:
            w(f"S.tock({group.index})")
        del members

    # -- the arena -----------------------------------------------------------------------------------

    def _results(self, op: fx.Node) -> list[fx.Node]:
        """The storage-owning values an operation makes: itself, or its tuple's items."""
        if op in self.planning.facts.root_bytes:
            return [op]
        return [u for u in op.users if u.target is operator.getitem and u in self.planning.facts.root_bytes]

    def _allow(self, group: Group, reason: str) -> None:
        self.allowances.setdefault(group.id, reason)

    def _slots(self, group: Group, offset_bytes: int | None) -> dict[fx.Node, int]:
        """The slot index (S.slots) of each output of `group` placed at `offset_bytes`, or {} where the node
        keeps the allocator's (the reason among the program's allowances)."""
        facts = self.planning.facts
        root_of = self.planning.root_of
        outputs = list(group.outputs)
        if not outputs:
            if any(value in self.planning.gradient_roots for op in group.ops for value in self._results(op)):
                self._allow(group, arena.GRADIENTS)
            return {}
        if any(root_of.get(value) in outputs for value in self.outputs_of.get(group.index, [])
               if value is self.step.loss or value in self.gradient_index):
            # the caller keeps the loss (a gradient, .grad) past the step, when the slot is another node's
            self._allow(group, arena.HANDS_ON_GRAPH_OUTPUT)
            return {}
        if offset_bytes is None:
            self._allow(group, arena.NO_ADDRESS)
            return {}
        if any(value in facts.storage_of or value not in facts.layout_of for value in outputs):
            self._allow(group, arena.NOT_PLAIN_STORAGE)
            return {}
        if any(facts.layout_of[value][3] != ("cuda" if self.cuda else "cpu") for value in outputs):
            self._allow(group, arena.ANOTHER_DEVICE)
            return {}
        if any(self._storage_seen(value) for value in outputs):
            self._allow(group, arena.SEES_STORAGE)
            return {}
        layouts = arena.pack(offset_bytes, self.planning.size_bytes(group), [facts.layout_of[v] for v in outputs])
        if layouts is None:
            self._allow(group, arena.DOES_NOT_FILL_SLOT)
            return {}
        return {value: self._slot(layout) for value, layout in zip(outputs, layouts)}

    def _outside_arena_bytes(self) -> tuple[int, int]:
        """With Modes.arena: the most the allocator holds beside the arena at once in this program's order
        (Program.outside_arena_bytes) and in any order of the same computations (every node kept out live at
        once), the generator states random nodes keep for their recomputation (and one more while one recomputes)
        included in both."""
        if not self.modes.arena:
            return 0, 0
        states = (self.rng_states_kept + 1) * rng_state_bytes(self.cuda) if self.rng_states_kept else 0
        any_order = sum(self.kept_outside.values()) + max((b for _, b in self.transient), default=0)
        in_order = any_order if self._outside_peak is None else min(self._outside_peak, any_order)
        return in_order + states, any_order + states

    def _outside_on_device(self, index: int, on_device: set[int], outside_bytes: int | None) -> None:
        """Group `index` made (or brought back) on the device, beside the arena with `outside_bytes` (None: in it).
        Its earlier storage, freed but still held by views, stays counted apart until they go."""
        if index in self._outside_live and index not in on_device:
            self._outside_live[("viewed", index)] = (self._outside_live.get(("viewed", index), 0)
                                                     + self._outside_live.pop(index))
        if outside_bytes is not None:
            self._outside_live[index] = outside_bytes
        if index not in on_device:
            for owner in self._views_of.get(index, ()):
                self._viewed[owner] = self._viewed.get(owner, 0) + 1

    def _outside_freed(self, index: int, on_device: set[int]) -> None:
        """Group `index` freed (still in `on_device`): its storage goes when no node on the device views it and
        no offload still reads it (on a GPU the allocator keeps a block its copy stream uses until the copy is
        waited for), and the last view of another node's storage takes that with it."""
        for owner in self._views_of.get(index, ()):
            self._viewed[owner] -= 1
            if not self._viewed[owner]:
                self._outside_live.pop(("viewed", owner), None)
                if owner not in on_device and owner not in self._offloading:
                    self._outside_live.pop(owner, None)
        if not self._viewed.get(index) and index not in self._offloading:
            self._outside_live.pop(index, None)

    def _outside_now(self, computed: bool) -> None:
        """With Modes.arena, after the code of one operation: what is beside the arena now (the nodes kept out of
        it that are live, and a computation's own transient), into the program's most."""
        if self._outside_peak is not None:
            transient = self.transient[-1][1] if computed and self.transient else 0
            self._outside_peak = max(self._outside_peak, sum(self._outside_live.values()) + transient)

    def _storage_seen(self, root: fx.Node) -> bool:
        """Whether an operation that sees a tensor's whole storage reads `root` or a view of it (anywhere in the
        step: a value in the arena would show it the arena)."""
        seen = self._sees_storage.get(root)
        if seen is None:
            alias_of = self.planning.facts.alias_of
            stack, found = [root], False
            while stack and not found:
                node = stack.pop()
                for user in node.users:
                    if user.target in arena.SEES_WHOLE_STORAGE:
                        found = True
                        break
                    if alias_of.get(user) is node:
                        stack.append(user)
            seen = self._sees_storage[root] = found
        return seen

    def _slot(self, layout: Layout) -> int:
        index = self._slot_index.get(layout)
        if index is None:
            index = self._slot_index[layout] = len(self.slots)
            self.slots.append(layout)
        return index

    def _scratch(self, group: Group, implementation: str, first: bool,
                 workspace: tuple[int, int] | None) -> dict[fx.Node, int]:
        """Slots in the node's workspace for the values it makes and drops inside (those an out= overload can
        write), first fit by their lifetimes inside the node; the rest are among the program's allowances."""
        facts, ops = self.planning.facts, group.ops
        keep = set(group.outputs) | self.planning.fixed_roots
        inside = [(k, value) for k, op in enumerate(ops) for value in self._results(op) if value not in keep]
        if not inside:
            return {}
        step_position = {op: k for k, op in enumerate(ops)}
        handed = {self.planning.root_of.get(v) for v in self.outputs_of.get(group.index, [])}
        device = "cuda" if self.cuda else "cpu"
        placed: list[tuple[int, int, int]] = []  # (start, end, last op index) in the workspace
        scratch_of: dict[fx.Node, int] = {}
        start_bytes, size_bytes = workspace if workspace is not None else (0, 0)
        for k, value in inside:
            layout = facts.layout_of.get(value)
            op = ops[k]
            if (layout is None or layout[3] != device or value in facts.storage_of or value in handed
                    or not self._writable(op, group, implementation, first) or self._storage_seen(value)):
                continue
            readers = [step_position[r] for r in self.planning.readers.get(value, []) if r in step_position]
            last = max(readers, default=len(ops))
            need = aligned(Layout(0, *layout[:3]).size_bytes)  # as planner.addresses places buffers
            live = sorted((a, b) for a, b, end in placed if end >= k)
            offset = 0
            for a, b in live:
                if offset + need <= a:
                    break
                offset = max(offset, b)
            if offset + need > size_bytes:
                continue
            placed.append((offset, offset + need, last))
            scratch_of[value] = self._slot(Layout(start_bytes + offset, *layout[:3]))
        return scratch_of

    def workspace_slot_bytes(self, group: Group, implementation: str, workspace_bytes: int) -> int:
        """Of a node's measured workspace, what a step writing into its arena places in the node's workspace slot:
        the values it makes and drops inside that an out= overload writes, as `_scratch` fits them (first
        computation or recomputation, the larger). The rest the kernel allocates for itself beside the arena (a
        convolution computed where the allocator puts it, then copied): a slot for it would stay empty."""
        used_bytes = 0
        for first in (True, False):
            slots = self._scratch(group, implementation, first, (0, workspace_bytes))
            used_bytes = max([used_bytes] + [self.slots[k].offset_bytes + aligned(self.slots[k].size_bytes)
                                              for k in slots.values()])
        self.slots, self._slot_index = [], {}  # read, not generated: no program keeps these
        return min(used_bytes, workspace_bytes)

    def _writable(self, op: fx.Node, group: Group, implementation: str, first: bool) -> bool:
        return not (first and self._batch_norm_in_place(op)) and not isinstance(
            self._writer(op, group, implementation), str)

    def _writer(self, op: fx.Node, group: Group, implementation: str):
        """How `op` writes into given tensors: "copy" (a copy with a cast, as the operator itself makes it),
        "clamp_min" (ATen's relu is clamp_min(self, 0), whose out= overload writes in place), (its out= overload,
        the out arguments' names), or the reason it cannot."""
        target = op.target
        if op is group.convolution and implementation not in ("native", "default"):
            return arena.OWN_ALGORITHM
        if not isinstance(target, torch._ops.OpOverload):
            return arena.NO_OUT_OVERLOAD
        one_result = op in self.planning.facts.root_bytes
        if one_result and target in arena.WRITTEN_BY_COPY and arena.copies_into(op.args, op.kwargs, self.cuda):
            return "copy"
        if one_result and target is torch.ops.aten.relu.default:
            return "clamp_min"
        return arena.out_overload(target)

    def _written(self, op: fx.Node, group: Group, implementation: str, slot_of: dict[fx.Node, int]) -> str | None:
        """The line calling `op` into its slots, or None where it computes elsewhere (the reason among the
        program's allowances, if the op makes an output of the node)."""
        results = self._results(op)
        placed = [value for value in results if value in slot_of]
        if not placed:
            return None
        writer = self._writer(op, group, implementation)
        if writer == "copy":
            k, source = slot_of[op], self.argument(op.args[0])
            if op.kwargs.get("dtype") is not None:  # a cast the operation asks for: the slot has its dtype
                return f"{local(op)} = S.slots[{k}].copy_({source})"
            # the source's own dtype: as the operation itself where the run's is not the trace's (S.kept_out)
            return f"{local(op)} = S.slots[{k}].copy_({source}) if {source}.dtype is S.slot_dtypes[{k}] " \
                   f"else S.kept_out({group.index}, {self.op_for(op)}({self._arguments(op)}))"
        if writer == "clamp_min":
            return f"{local(op)} = {self.op(torch.ops.aten.clamp_min.out)}({self.argument(op.args[0])}, 0, " \
                   f"out=S.slots[{slot_of[op]}])"
        if isinstance(writer, str):
            self._allow(group, writer)
            return None
        overload, names = writer
        if op in results:  # one result
            outs = [f"{names[0]}=S.slots[{slot_of[op]}]"]
        else:
            index = {value.args[1]: value for value in results}
            if len(placed) != len(results) or sorted(index) != list(range(len(names))):
                self._allow(group, arena.PARTLY_KEPT)
                return None
            outs = [f"{name}=S.slots[{slot_of[index[k]]}]" for k, name in enumerate(names)]
        arguments = ", ".join(part for part in (self._arguments(op), ", ".join(outs)) if part)
        return f"{local(op)} = {self.op(overload)}({arguments})"

    def _owned_outputs(self, group: Group, first: bool, derived: list, made: set) -> list[str]:
        """The code handing on the step's graph outputs whose storage the node owns, after its computation: a
        parameter's gradient, a buffer's new value (written now if nothing later reads the buffer, else staged for
        the step's end), the loss."""
        tail: list[str] = []
        for value in self.outputs_of.get(group.index, []):
            self._derive(value, tail, derived, made)
            if not first:
                continue
            if value in self.gradient_index:
                tail.append(f"S.gradient({self.gradient_index[value]}, {self.value(value)})")
            elif value in self.mutation_index:
                index = self.mutation_index[value]
                target = self.step.mutations[index][1]
                if value in self.in_place_values:
                    self.direct.add(index)  # the operation itself wrote it
                elif index in self.modes.direct_writes and self._last_read.get(target, -1) <= self._position:
                    # nothing after this point reads the tensor: update it now, as the eager step does
                    tail.append(f"{self.value(target)}.copy_({self.value(value)})")
                    self.direct.add(index)
                else:
                    tail.append(f"S.stage({index}, {self.value(value)})")
            elif value is self.step.loss:
                tail.append(f"v__loss = {self.value(value)}")
                if self.modes.strict:
                    tail.append("S.loss_storage = v__loss.untyped_storage().data_ptr()")
        return tail

    def _compiled_call(self, group: Group, implementation: str, first: bool) -> tuple[str, list[fx.Node]] | None:
        """The line calling the node's compiled kernel and the values it binds, or None to run it eagerly."""
        reason = None
        randoms = [op for op in group.ops if is_random(op)]
        if randoms and (len(randoms) > 1 or randoms[0].target is not torch.ops.aten.native_dropout.default):
            # one dropout is kept whole in the kernel (eager's own call: eager's mask, redrawn from the same RNG
            # state where recomputed); other random operations, or several whose order a kernel may change, not
            reason = "random (eager's random numbers, redrawn exactly where recomputed)"
        elif implementation == EAGER:
            reason = "the plan runs it eagerly (measured faster than its kernel)"
        elif group.convolution is not None and implementation not in ("native", "default"):
            reason = f"convolution algorithm {implementation}"
        members = self._members(group)
        inputs, outputs, views = self._boundary(members, list(group.outputs) + self.outputs_of.get(group.index, []))
        kernel = self.compiler.kernel(group.id, members, inputs, outputs, views, reason)
        if kernel is None:
            return None
        name = f"kernel_{group.index}"  # the node's own call of its (shared) kernel
        self.constants[name] = kernel
        arguments = ", ".join(self.value(node) for node in inputs)
        return f"{_tuple([local(n) for n in outputs])} = {name}({arguments})", outputs

    def _members(self, group: Group) -> list[fx.Node]:
        """The node's operations, their multiple results, and the views they read, in graph order: what a
        compiled kernel computes (the views of other nodes' values included)."""
        facts = self.planning.facts
        made: set[fx.Node] = set()

        def derive(node: fx.Node) -> None:
            if node.op in ("placeholder", "get_attr") or node in made or node not in facts.alias_of:
                return
            derive(facts.alias_of[node])
            for argument in node.all_input_nodes:
                derive(argument)
            made.add(node)

        for op in group.ops:
            for argument in op.all_input_nodes:
                derive(argument)
            made.add(op)
            for item in op.users:
                if item.target is operator.getitem:
                    made.add(item)
        return sorted(made, key=self.position.__getitem__)

    def _graph_input_outputs(self, w: _Writer) -> None:
        """Gradients and written-back values that are views of a graph input (no planning node owns them)."""
        lines: list[str] = []
        derived: list[fx.Node] = []
        for value in self.outputs_of.get(None, []):
            self._derive(value, lines, derived, set())
            if value in self.gradient_index:
                lines.append(f"S.gradient({self.gradient_index[value]}, {self.value(value)})")
            elif value in self.mutation_index:
                lines.append(f"S.stage({self.mutation_index[value]}, {self.value(value)})")
        for line in lines:
            w(line)
        if derived:
            w(" = ".join(local(n) for n in derived) + " = None")

    def _derive(self, node: fx.Node, lines: list[str], derived: list, made: set) -> None:
        """Make a view local (and the views it is made from) if this node has not made it yet."""
        graph = self.planning
        if node.op in ("placeholder", "get_attr") or node in made:
            return
        if node in graph.facts.alias_of:
            self._derive(graph.facts.alias_of[node], lines, derived, made)
            for argument in node.all_input_nodes:
                self._derive(argument, lines, derived, made)
            if node.target is operator.getitem:
                lines.append(f"{local(node)} = {local(node.args[0])}[{node.args[1]}]")
            elif node.target in _IDENTITY_VIEWS:
                # the whole step runs without autograd, where detach/alias give the same tensor back in all but
                # identity: reuse it and save a dispatcher call (AOTAutograd leaves two detaches per saved output)
                lines.append(f"{local(node)} = {self.value(node.args[0])}")
            else:
                args = ", ".join([self.argument(a) for a in node.args]
                                 + [f"{k}={self.argument(v)}" for k, v in node.kwargs.items()])
                lines.append(f"{local(node)} = {self.op_for(node)}({args})")
            made.add(node)
            derived.append(node)

    def _arguments(self, op: fx.Node) -> str:
        return ", ".join([self.argument(a) for a in op.args] + [f"{k}={self.argument(v)}" for k, v in op.kwargs.items()])

    def _batch_norm_in_place(self, op: fx.Node) -> bool:
        """A functional batch norm (training) whose new running statistics go straight back into the buffers it
        read, which nothing later reads: call the in-place form, as the eager step does (the functional form is
        that call on clones of the buffers: the same arithmetic, two clones and two copies more). Readers of the new
        statistics (the batch norm's backward) then read the buffers; the node's size still counts the clones the
        profile measured (a few bytes over, never under)."""
        if op.target is not BATCH_NORM_FUNCTIONAL:
            return False
        statistics = {u.args[1]: u for u in op.users if u.target is operator.getitem and u.args[1] in (3, 4)}
        if len(statistics) != 2:
            return False
        for position, value in statistics.items():
            if value not in self.mutation_index:
                return False
            index = self.mutation_index[value]
            target = self.step.mutations[index][1]
            if target is not op.args[position] or index not in self.modes.direct_writes \
                    or self._last_read.get(target, -1) > self._position:
                return False
        return True

    def _call(self, op: fx.Node, group: Group, implementation: str) -> list[str]:
        args = self._arguments(op)
        if op is group.convolution and implementation not in ("native", "default"):
            if op.target is CONVOLUTION:
                self.constants.setdefault("conv_forward", conv_algorithms.forward)
                return [f"{local(op)} = conv_forward({implementation!r}, {args})"]
            if op.target is CONVOLUTION_BACKWARD:
                self.constants.setdefault("conv_backward", conv_algorithms.backward)
                return [f"{local(op)} = conv_backward({implementation!r}, {args})"]
        return [f"{local(op)} = {self.op_for(op)}({args})"]

    # -- a whole program -----------------------------------------------------------------------------

    def program(self, operations: list[Op], split: int | None, name: str = "step") -> Program:
        """Code for `operations`; `split` is the index of the first operation of the backward part."""
        groups = self.planning.groups
        computes_after: dict[int, int] = {}
        later_computes: list[int] = []
        for op in reversed(operations):
            if op.kind == "compute":
                later_computes.append(computes_after.get(op.group, 0))
                computes_after[op.group] = computes_after.get(op.group, 0) + 1
            else:
                later_computes.append(0)
        later_computes.reverse()
        self._last_read = self._last_reads(operations)
        cut = len(operations) if split is None else split
        # on a GPU, where an arena slot freed under its offload is written next, the writer waits for the copy
        reclaim_at = (arena.reclaims(operations, lambda index: self.planning.size_bytes(groups[index]))
                      if self.modes.arena and self.cuda else {})
        regions = self._region_kernels(operations, self._regions(operations, cut))
        parts_ops = [operations[:cut], operations[cut:]] if split is not None else [operations]
        source_lines: list[str] = []
        live_after: list[list[str]] = []
        seen: set[int] = set()
        on_device: set[int] = set()
        self._outside_live, self._outside_peak = {}, 0
        # a node whose outputs are views of another node's outputs keeps that node's storage while it is on the
        # device, freed or not: its bytes stay beside the arena until the last view goes
        group_of, root_of = self.planning.group_of, self.planning.root_of
        self._views_of = {g.index: {group_of[root_of[v]] for v in g.outputs if root_of.get(v) in group_of
                                    and group_of[root_of[v]] != g.index} for g in groups}
        self._viewed, self._offloading = {}, set()
        offset = 0
        for part_index, part in enumerate(parts_ops):
            w = _Writer()
            w.indent = 0
            if part_index == 0:
                w(f"def part_{part_index}(F, S):")
            else:
                w(f"def part_{part_index}(F, S, tangent, live):")
            w.indent = 1
            if part_index == 0:
                w("v__loss = None")
            else:
                names = live_after[-1]
                # `live` is a one-element list: popping it leaves these locals the only references, so that each
                # tensor goes when the schedule frees it
                if names:
                    w(f"({', '.join(names)},) = live.pop()")
                else:
                    w("live.pop()")
            k = 0
            while k < len(part):
                region = regions.get(offset + k)
                if region is not None:
                    spec, kernel = region
                    self.region(w, operations, spec, kernel, seen, on_device)
                    self._outside_peak = None
                    k = spec.end - offset
                    continue
                op = part[k]
                group = groups[op.group]
                outputs = [local(n) for n in group.outputs]
                for stream in ("compute", "h2d"):
                    waiting = [g for g, on in reclaim_at.get(offset + k, ()) if on == stream]
                    if waiting:
                        w(f"S.reclaim({_tuple([str(g) for g in waiting])}, {stream!r})")
                if op.kind == "compute":
                    first = op.group not in seen
                    seen.add(op.group)
                    rng_later = later_computes[offset + k] > 0
                    self._position = offset + k
                    transients = len(self.transient)
                    self.compute(w, group, op.implementation, first, rng_later, op.offset_bytes,
                                 (op.workspace_offset_bytes, op.workspace_slot_bytes)
                                 if op.workspace_offset_bytes is not None else None, op.workspace_bytes)
                    if self.modes.arena:
                        self._outside_on_device(op.group, on_device, self.kept_outside.get(group.id))
                        self._outside_now(computed=len(self.transient) > transients)
                    on_device.add(op.group)
                    if self.modes.ledger or self.modes.strict or self.modes.timing:
                        w(f"S.computed({op.group}, {op.implementation!r}, {_tuple(outputs)})")
                elif op.kind == "offload":
                    w(f"S.offload({op.group}, {_tuple(outputs)})")
                    self._offloading.add(op.group)
                elif op.kind == "prefetch":
                    into = self._slots(group, op.offset_bytes) if self.modes.arena else {}
                    if outputs and into:
                        offsets = _tuple([str(self.slots[into[n]].offset_bytes) for n in group.outputs])
                        w(f"{_tuple(outputs)} = S.prefetch({op.group}, {offsets})")
                        self.prefetched_into.add(group.id)
                    elif outputs:
                        w(f"{_tuple(outputs)} = S.prefetch({op.group})")
                    else:
                        w(f"S.prefetch({op.group})")
                    if self.modes.arena:
                        # prefetched through the allocator: beside the arena until freed
                        self._outside_on_device(op.group, on_device,
                                                None if outputs and into else self.planning.size_bytes(group))
                        self._outside_now(computed=False)
                    on_device.add(op.group)
                elif op.kind == "wait":
                    w(f"S.wait({op.group}, {op.transfer!r})")
                    if op.transfer == "offload" and op.group in self._offloading:
                        self._offloading.discard(op.group)
                        if op.group not in on_device and not self._viewed.get(op.group):
                            self._outside_live.pop(op.group, None)
                elif op.kind == "free":
                    self._free(w, group)
                    if self.modes.arena and op.group in on_device:
                        self._outside_freed(op.group, on_device)
                    on_device.discard(op.group)
                else:
                    raise ValueError(f"unknown operation {op.kind!r}")
                k += 1
            if part_index == len(parts_ops) - 1:
                self._graph_input_outputs(w)
            offset += len(part)
            names = sorted({local(n) for g in on_device for n in groups[g].outputs})
            live_after.append(names)
            if part_index == 0 and len(parts_ops) > 1:
                w(f"return v__loss, ({', '.join(names)}{',' if names else ''})")
            elif part_index == 0:
                w("return v__loss, ()")
            else:
                w("return None")
            source_lines.extend(w.lines)
            source_lines.append("")
        source = "\n".join(source_lines)
        filename = f"<mosos {name} {id(self):x}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace: dict[str, Any] = dict(self.constants)
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
        parts = [namespace[f"part_{i}"] for i in range(len(parts_ops))]
        return Program(source, parts, live_after, sum(1 for op in operations if op.kind == "compute"), self.constants,
                       frozenset(self.direct), list(self.slots), dict(self.allowances), frozenset(self.written),
                       frozenset(self.prefetched_into), list(self.placed),
                       *self._outside_arena_bytes())

    def _free(self, w: _Writer, group: Group, tensors: bool = True) -> None:
        """The code of a free; `tensors=False`: a node computed and freed inside a region never had its outputs
        made (only the ledger hears of it)."""
        outputs = [local(n) for n in group.outputs] if tensors else []
        if self.modes.strict or self.modes.ledger or self.cuda:
            # a buffer updated in place is the model's, not the node's: it stays when the node goes
            owned = [local(n) for n in group.outputs if n not in self.in_place_values] if tensors else []
            w(f"S.release({group.index}, {_tuple(owned)})")
        if outputs:
            w(" = ".join(outputs) + " = None")
        if self.modes.strict:
            w(f"S.released({group.index})")

    # -- compiled regions ----------------------------------------------------------------------------

    def _regions(self, operations: list[Op], cut: int) -> list[tuple[int, int]]:
        """Consecutive computations to run as one compiled kernel (executor.engine.regions); none unless asked for, and
        none in the profiler's modes, which time or measure node by node."""
        memory = self.region_memory
        if self.compiler is None or memory is None or self.modes.strict or self.modes.timing or self.modes.memory:
            return []
        size_bytes, workspace_bytes = memory
        groups = self.planning.groups
        first_compute: dict[int, int] = {}
        for k, op in enumerate(operations):
            if op.kind == "compute":
                first_compute.setdefault(op.group, k)

        def can_join(k: int) -> bool:
            op = operations[k]
            return self._joins_region(groups[op.group], op.implementation, first_compute[op.group] == k)

        def layer_of(group: int) -> str | None:
            found = layer_prefix(groups[group].module)
            return found[1] if found is not None else None

        bounds = [(0, cut), (cut, len(operations))]
        return region_ranges(operations, can_join, size_bytes, workspace_bytes, bounds, layer_of)

    def _joins_region(self, group: Group, implementation: str, first: bool) -> bool:
        """A computation whose code is only its operations and what it hands on (no random numbers to replay, no
        loss, no convolution algorithm of our own), worth fusing, and compiled in the plan."""
        if group.random or implementation == EAGER \
                or (group.convolution is not None and implementation not in ("native", "default")):
            return False
        if all(op.meta.get(HAND_OFF) is not None for op in group.ops):
            # a hand-off node only copies a result the backward reads (a dropout's mask, a batch norm's statistics):
            # nothing to fuse, and Inductor's CPU code for a mask's copy fused with its neighbour's addition ran
            # 10x slower than eager's two calls (GPT-2)
            return False
        if any(argument.meta.get(SHAPE_ONLY) for op in group.ops for argument in op.all_input_nodes):
            # a convolution's input gradient reads a stand-in of its input (one element, expanded to its shape):
            # oneDNN writes the expansion out in its own scratch, measured and planned as the node's workspace;
            # a compiled region might write it out as a tensor of its own, memory the plan does not have
            return False
        owned = self.outputs_of.get(group.index, [])
        return all(value in self.gradient_index or value in self.mutation_index for value in owned)

    def _region_spec(self, operations: list[Op], start: int, end: int) -> "_RegionSpec":
        """What the kernel of operations[start:end] computes: the nodes' operations, from the values it reads to
        those the schedule still holds after it (a node computed and freed inside hands on nothing) and the step's
        graph outputs it makes."""
        groups = self.planning.groups
        run = operations[start:end]
        computed = [groups[op.group] for op in run if op.kind == "compute"]
        inside = {group.index for group in computed}
        freed_inside = frozenset(op.group for op in run if op.kind == "free" and op.group in inside)
        members = sorted({node for group in computed for node in self._members(group)}, key=self.position.__getitem__)
        wanted = [node for group in computed
                  for node in ([] if group.index in freed_inside else list(group.outputs))
                  + self.outputs_of.get(group.index, [])]
        inputs, outputs, views = self._boundary(members, wanted)
        key = self.compiler.region_key(members, inputs, outputs)
        return _RegionSpec(start, end, computed, freed_inside, members, inputs, outputs, views, key)

    def _boundary(self, members: list[fx.Node], wanted: list[fx.Node]) -> tuple[list, list, set]:
        """What a kernel computing `members` reads from outside, what it hands on of `wanted` (a view of a member
        as the member itself: the view is derived after the call), and the views among the members."""
        alias_of = self.planning.facts.alias_of
        member_set = set(members)
        outputs: list[fx.Node] = []
        for node in wanted:
            while node not in member_set and node in alias_of:
                node = alias_of[node]
            if node in member_set and node not in outputs:
                outputs.append(node)
        inputs: list[fx.Node] = []
        for node in members:
            for argument in node.all_input_nodes:
                if argument not in member_set and argument not in inputs:
                    inputs.append(argument)
        return inputs, outputs, {n for n in members if n in alias_of}

    def _region_kernels(self, operations: list[Op], ranges: list[tuple[int, int]]) -> dict[int, tuple]:
        """Region start -> (spec, kernel) for the regions Inductor compiled. Kernels are compiled in the order of
        the node computations they cover (regions alike share one), so that beyond the kinds of region a program
        may use (executor.engine.compiled_nodes), the regions left to run node by node are those worth least."""
        specs = [self._region_spec(operations, start, end) for start, end in ranges]
        covered: dict[str | None, int] = {}
        for spec in specs:
            covered[spec.key] = covered.get(spec.key, 0) + len(spec.computed)
        order = sorted(range(len(specs)), key=lambda i: (-covered[specs[i].key], specs[i].start))
        chosen: dict[int, tuple] = {}
        for i in order:
            spec = specs[i]
            label = f"region {spec.computed[0].id} .. {spec.computed[-1].id}"
            kernel = self.compiler.region_kernel(label, [group.id for group in spec.computed], spec.members,
                                                 spec.inputs, spec.outputs, spec.views, spec.key)
            if kernel is not None:
                chosen[spec.start] = (spec, kernel)
        return chosen

    def region(self, w: _Writer, operations: list[Op], spec: "_RegionSpec", kernel: Callable, seen: set[int],
               on_device: set[int]) -> None:
        """The code of a region: one call of its kernel, then what the schedule does after each computation
        (graph outputs, the ledger) and its frees, in order."""
        groups = self.planning.groups
        start, end = spec.start, spec.end
        run = operations[start:end]
        computed, freed_inside, inputs, outputs = spec.computed, spec.freed_inside, spec.inputs, spec.outputs
        name = f"region_{start}"
        self.constants[name] = kernel
        w(f"# region: compute {', '.join(group.id for group in computed)}")
        arguments = ", ".join(self.value(node) for node in inputs)
        w(f"{_tuple([local(n) for n in outputs])} = {name}({arguments})")
        made: set = set(outputs)
        derived: list[fx.Node] = []
        for k, op in enumerate(run, start):
            group = groups[op.group]
            if op.kind == "compute":
                first = op.group not in seen
                seen.add(op.group)
                self._position = k
                for line in self._owned_outputs(group, first, derived, made):
                    w(line)
                on_device.add(op.group)
                if self.modes.ledger:
                    held = None if op.group in freed_inside else _tuple([local(n) for n in group.outputs])
                    w(f"S.computed({op.group}, {op.implementation!r}, {held})")
            else:
                self._free(w, group, tensors=op.group not in freed_inside)
                on_device.discard(op.group)
        kept = {node for group in computed if group.index not in freed_inside for node in group.outputs}
        dropped = sorted({local(n) for n in list(made) + derived if n not in kept})
        if dropped:
            w(" = ".join(dropped) + " = None")

    def _last_reads(self, operations: list[Op]) -> dict[fx.Node, int]:
        """For each mutated placeholder whose readers all belong to planning nodes: the position of the last
        computation of such a node (absent: read elsewhere, so never written in place)."""
        graph = self.planning
        last: dict[fx.Node, int] = {}
        for _, target in self.step.mutations:
            readers: set[fx.Node] = set()
            stack = [target]
            while stack:
                for user in stack.pop().users:
                    if user in graph.facts.alias_of:
                        stack.append(user)
                    else:
                        readers.add(user)
            if any(user not in graph.group_of for user in readers):
                continue
            groups = {graph.group_of[user] for user in readers}
            last[target] = max((k for k, op in enumerate(operations) if op.kind == "compute" and op.group in groups),
                               default=-1)
        return last

@dataclass
class _RegionSpec:
    start: int  # operation indices, half-open
    end: int
    computed: list[Group]
    freed_inside: frozenset  # nodes computed and freed inside: their outputs are never made apart
    members: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    views: set
    key: str | None  # the kernel's structure key (regions alike share one kernel); None: it cannot have one


def schedule_operations(profile, schedule: Schedule, index_of: dict[str, int]) -> list[Op]:
    """A schedule's operations as the generator's, planning nodes by index."""
    operations = []
    nodes = profile.node_by_id if profile is not None else {}
    for _, _, op in schedule.operations():
        if isinstance(op, Compute):
            implementation = next((i for i in nodes[op.node].implementations if i.name == op.implementation), None) \
                if nodes else None
            workspace = implementation.workspace_bytes if implementation is not None else 0
            slot = implementation.placed_workspace_bytes \
                if implementation is not None and op.workspace_offset_bytes is not None else 0
            operations.append(Op("compute", index_of[op.node], op.implementation, offset_bytes=op.offset_bytes,
                                 workspace_offset_bytes=op.workspace_offset_bytes, workspace_bytes=workspace,
                                 workspace_slot_bytes=slot))
        elif isinstance(op, Offload):
            operations.append(Op("offload", index_of[op.tensor]))
        elif isinstance(op, Prefetch):
            operations.append(Op("prefetch", index_of[op.tensor], offset_bytes=op.offset_bytes))
        elif isinstance(op, Wait):
            operations.append(Op("wait", index_of[op.tensor], transfer=op.transfer))
        elif isinstance(op, Free):
            operations.append(Op("free", index_of[op.tensor]))
    return operations


def rng_state_bytes(cuda: bool) -> int:
    """Bytes of one saved generator state (the CPU's, and the GPU's with it): the tensors S.get_rng() returns."""
    size = torch.get_rng_state().numel()
    if cuda:
        size += torch.cuda.get_rng_state().numel()
    return aligned(size)


def _tuple(names: list[str]) -> str:
    return f"({', '.join(names)}{',' if len(names) == 1 else ''})" if names else "()"


def _tokens(line: str) -> set[str]:
    token, found = [], set()
    for ch in line + " ":
        if ch.isalnum() or ch == "_":
            token.append(ch)
        elif token:
            found.add("".join(token))
            token = []
    return found

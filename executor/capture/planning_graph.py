"""The planner's view of a captured step: ATen operations grouped into planning nodes.

Memory is counted per storage. An operation whose output shares storage with
one of its inputs (a view: view, t, permute, expand, slice, detach, split...)
allocates nothing; the reference run finds these by comparing storages, so
operations that alias without saying so in their schema (`_unsafe_view`) are
caught too. Every other operation output owns a storage: a *root*. Views are
not planned at all: whoever reads a view reads its root, and derives the view
again when it runs.

The grouping rule (docs/executor.md, "Planning nodes"):

1. Operations are taken in graph order (the order of an eager training step).
2. An operation joins the group of an operation whose outputs it reads, if
   every storage that operation produced is read by this operation and by
   nothing else (not by another operation, not by backward: not saved; not a
   graph output), and if it reads no storage that the group does not already
   read or produce (so folding never makes a node hold more inputs at once,
   which would raise the smallest budget any plan can meet). Chains of
   operations whose intermediates nobody else reads fold into one planning
   node; the intermediates are that node's transient memory, measured as its
   workspace.
3. The copies through which an operation hands small results to the backward (executor.capture.capture) make one
   node of their own.
4. Never across the forward/backward boundary, and at most one convolution
   (forward, filter-gradient or data-gradient half) per planning node, whose
   algorithm is then the node's implementation.

So every storage a backward operation reads from the forward pass is the
output of its own planning node (a candidate to keep, offload or recompute),
and so is every storage read by two or more operations. Parameter gradients,
parameters, buffers, inputs and constants are fixed memory. Folding can only
contract an edge whose source has a single reader, so the planning graph stays
acyclic.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from executor.capture.capture import HAND_OFF, CapturedStep
from executor.capture.kernel_dtypes import with_kernel_dtypes

ATEN = torch.ops.aten
CONVOLUTION = ATEN.convolution.default
CONVOLUTION_BACKWARD = ATEN.convolution_backward.default


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (its StorageImpl), real or fake; valid while the storage lives."""
    return tensor.untyped_storage()._cdata


def storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


@dataclass
class Facts:
    """What one run of the joint graph on real tensors showed."""

    alias_of: dict[fx.Node, fx.Node] = field(default_factory=dict)  # a view -> the argument it shares storage with
    root_bytes: dict[fx.Node, int] = field(default_factory=dict)  # a storage-owning value -> its storage's bytes
    storage_of: dict[fx.Node, fx.Node] = field(default_factory=dict)  # a root on an earlier root's storage -> that root
    random_ops: set = field(default_factory=set)
    values_seen: int = 0
    # a storage-owning value -> (shape, stride, dtype, device type) where its storage is exactly its elements
    # (what executor.engine.arena places)
    layout_of: dict[fx.Node, tuple] = field(default_factory=dict)


def tensors_in(value) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


# tagged random for their dropout argument, and checked to draw nothing where it is 0: ATen's CPU flash attention
# accepts no other value (an attention with dropout on the CPU is the math path's operations and its own dropout)
_DRAWS_NOTHING_WITHOUT_DROPOUT = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: 3}


def is_random(node: fx.Node) -> bool:
    """Whether the operation draws random numbers (a recomputation must draw eager's again)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    position = _DRAWS_NOTHING_WITHOUT_DROPOUT.get(target)
    if position is not None:
        dropout = node.args[position] if len(node.args) > position else node.kwargs.get("dropout_p", 0.0)
        return dropout != 0
    return True


def reference_run(step: CapturedStep, feed: dict[fx.Node, torch.Tensor]) -> Facts:
    """Run the joint graph once on fake tensors (shapes and storages, no memory, no arithmetic), node by node,
    dropping each value after its last use, and record which outputs are views and how large each storage is.
    Fake tensors follow the operators' meta functions, which model storage aliasing exactly as the real kernels
    do (functionalisation depends on it); the replay's strict mode checks the sizes on real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    facts = Facts()
    graph = step.graph
    last_use: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for source in node.all_input_nodes:
            last_use[source] = node
    release: dict[fx.Node, list[fx.Node]] = {}
    for source, user in last_use.items():
        release.setdefault(user, []).append(source)
    mode = FakeTensorMode()
    env: dict[fx.Node, object] = {}
    argument_storages: dict[fx.Node, dict[int, fx.Node]] = {}  # tuple op -> storages of its arguments
    output_storages: dict[fx.Node, dict[int, fx.Node]] = {}  # tuple op -> storages of its outputs seen so far
    fakes: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for node in graph.nodes:
            if node.op == "placeholder":
                value = feed[node]
                env[node] = fakes.setdefault(id(value), mode.from_tensor(value)) if isinstance(value, torch.Tensor) else value
            elif node.op == "get_attr":
                value = getattr(step.graph_module, node.target)
                env[node] = fakes.setdefault(id(value), mode.from_tensor(value)) if isinstance(value, torch.Tensor) else value
            elif node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                with mode:
                    value = node.target(*args, **kwargs)
                value = with_kernel_dtypes(node.target, args, kwargs, value, mode)
                env[node] = value
                if node.target is operator.getitem:
                    _record_item(node, value, facts, argument_storages, output_storages)
                else:
                    _record_op(node, value, env, facts, argument_storages)
            for source in release.get(node, ()):
                if source.op != "placeholder":
                    env.pop(source, None)
    return facts


def _argument_storages(node: fx.Node, env) -> dict[int, fx.Node]:
    found: dict[int, fx.Node] = {}
    for argument in node.all_input_nodes:
        for tensor in tensors_in(env.get(argument)):
            if tensor.untyped_storage().nbytes():
                found.setdefault(storage_key(tensor), argument)
    return found


def _record_op(node: fx.Node, value, env, facts: Facts, argument_storages) -> None:
    if is_random(node):
        facts.random_ops.add(node)
    if isinstance(value, torch.Tensor):
        if value.untyped_storage().nbytes() == 0:
            facts.root_bytes[node] = 0
            return
        storages = _argument_storages(node, env)
        key = storage_key(value)
        if key in storages:
            facts.alias_of[node] = storages[key]
        else:
            facts.root_bytes[node] = storage_bytes(value)
            _record_layout(node, value, facts)
        return
    outputs = [t for t in tensors_in(value) if t.untyped_storage().nbytes()]
    if not outputs:
        return
    storages = _argument_storages(node, env)
    bases = {storages.get(storage_key(t)) for t in outputs}
    if len(bases) == 1 and None not in bases:
        facts.alias_of[node] = bases.pop()  # a view op with several results (split, unbind, chunk)
        return
    argument_storages[node] = storages


def _record_item(node: fx.Node, value, facts: Facts, argument_storages, output_storages) -> None:
    parent = node.args[0]
    if parent in facts.alias_of:
        facts.alias_of[node] = parent
        return
    if not isinstance(value, torch.Tensor):
        return
    if value.untyped_storage().nbytes() == 0:
        facts.root_bytes[node] = 0
        return
    key = storage_key(value)
    storages = argument_storages.get(parent, {})
    if key in storages:
        facts.alias_of[node] = storages[key]
        return
    seen = output_storages.setdefault(parent, {})
    if key in seen:
        facts.storage_of[node] = seen[key]  # its own value, on the storage of an earlier output (counted once)
    else:
        seen[key] = node
        _record_layout(node, value, facts)
    facts.root_bytes[node] = storage_bytes(value)


def _record_layout(node: fx.Node, value: torch.Tensor, facts: Facts) -> None:
    layout = plain_layout(value)
    if layout is not None:
        facts.layout_of[node] = layout


def span_elements(shape, stride) -> int:
    """Elements a tensor of this shape and stride reaches from its first (0 for an empty one)."""
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride))


def plain_layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype, str] | None:
    """(shape, stride, dtype, device type) of a result whose storage is exactly its own elements, from the first;
    None for a window on a larger buffer (such a result cannot be placed on its own: executor.engine.arena)."""
    if tensor.storage_offset() != 0 or tensor.layout != torch.strided:
        return None
    if span_elements(tensor.shape, tensor.stride()) * tensor.element_size() != tensor.untyped_storage().nbytes():
        return None
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device.type


# --- the planning graph ----------------------------------------------------------------------------------


@dataclass
class Group:
    """One planning node: operations that run together, and the storages it hands on."""

    index: int
    kind: str  # forward | loss | backward
    ops: list[fx.Node] = field(default_factory=list)  # storage-allocating operations, in graph order
    outputs: list[fx.Node] = field(default_factory=list)  # roots read by other groups (or the loss)
    inputs: list[int] = field(default_factory=list)  # groups whose outputs it reads, in first-read order
    id: str = ""
    module: str | None = None
    op_type: str = ""
    convolution: fx.Node | None = None  # the convolution (or half) whose algorithm is the node's implementation
    forward_node: int | None = None
    random: bool = False

    @property
    def output_bytes(self) -> int:
        return 0


@dataclass
class PlanningGraph:
    step: CapturedStep
    facts: Facts
    groups: list[Group]
    group_of: dict[fx.Node, int]  # allocating op (and its getitems) -> group index
    root_of: dict[fx.Node, fx.Node | None]  # every value -> the root whose storage it uses (None: fixed memory)
    fixed_roots: set  # roots that are fixed memory (placeholders, constants, parameter gradients)
    readers: dict[fx.Node, list[fx.Node]]  # root -> ops reading it (through views), in graph order
    gradient_roots: set

    def size_bytes(self, group: Group) -> int:
        """Bytes of the distinct storages of the node's outputs."""
        storages = {self.facts.storage_of.get(root, root): self.facts.root_bytes.get(root, 0) for root in group.outputs}
        return sum(storages.values())

    def by_id(self) -> dict[str, Group]:
        return {group.id: group for group in self.groups}


def _producer(node: fx.Node) -> fx.Node:
    """The allocating op of a root (a getitem's tuple op, else the node itself)."""
    return node.args[0] if node.target is operator.getitem else node


def _is_convolution(node: fx.Node) -> bool:
    return node.target in (CONVOLUTION, CONVOLUTION_BACKWARD)


def build(step: CapturedStep, facts: Facts) -> PlanningGraph:
    graph = step.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    root_of: dict[fx.Node, fx.Node | None] = {}
    fixed_roots: set = set()

    def root(node: fx.Node) -> fx.Node | None:
        if node in root_of:
            return root_of[node]
        if node.op in ("placeholder", "get_attr"):
            root_of[node] = node
            fixed_roots.add(node)
        elif node in facts.alias_of:
            root_of[node] = root(facts.alias_of[node])
        else:
            root_of[node] = node
        return root_of[node]

    gradient_roots = set()
    for value, _, _ in step.gradients:
        gradient_roots.add(root(value))
    fixed_roots |= gradient_roots

    # allocating operations: call_functions that are neither views nor getitems
    ops = [n for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem
           and n not in facts.alias_of and (n in facts.root_bytes or any(u in facts.root_bytes for u in n.users))]
    op_set = set(ops)
    # what each allocating op reads (roots, through views and getitems of views) and what each root's readers are
    reads: dict[fx.Node, list[fx.Node]] = {}
    readers: dict[fx.Node, list[fx.Node]] = {}
    for op in ops:
        found = []
        for argument in op.all_input_nodes:
            r = root(argument)
            if r is not None and r not in found:
                found.append(r)
        reads[op] = found
        for r in found:
            readers.setdefault(r, []).append(op)
    graph_uses: dict[fx.Node, int] = {}
    for value in [step.loss] + [v for v, _ in step.mutations] + [v for v, _, _ in step.gradients]:
        r = root(value)
        graph_uses[r] = graph_uses.get(r, 0) + 1

    def roots_of_op(op: fx.Node) -> list[fx.Node]:
        if op in facts.root_bytes:
            return [op]
        return [u for u in op.users if u in facts.root_bytes]

    group_of: dict[fx.Node, int] = {}
    members: list[list[fx.Node]] = []
    hand_off_group: dict[str, int] = {}  # an operation's name -> the node of the copies it hands to the backward
    for op in ops:
        backward = op in step.backward
        copied_from = op.meta.get(HAND_OFF)
        if copied_from is not None:
            if copied_from in hand_off_group:
                group_of[op] = hand_off_group[copied_from]
                members[group_of[op]].append(op)
                continue
            hand_off_group[copied_from] = len(members)
            group_of[op] = len(members)
            members.append([op])
            continue
        candidates = []
        for r in reads[op]:
            if r in fixed_roots:
                continue
            producer = _producer(r)
            if producer not in op_set or producer not in group_of:
                continue
            if (producer in step.backward) != backward:
                continue
            produced = roots_of_op(producer)
            if all(readers.get(p, []) == [op] and not graph_uses.get(p) and p not in fixed_roots for p in produced):
                candidates.append(group_of[producer])
        candidates = list(dict.fromkeys(candidates))
        if candidates:
            # fold only if the op brings no planned storage the node does not already read or make: folding must
            # never make a planning node hold more inputs at once (that would raise the smallest feasible budget)
            known: set = set()
            for g in candidates:
                for member in members[g]:
                    known.update(roots_of_op(member))
                    known.update(reads[member])
            if any(r not in known for r in reads[op] if r not in fixed_roots):
                candidates = []
        if _is_convolution(op):
            candidates = [g for g in candidates if not any(_is_convolution(m) for m in members[g])]
        conv_groups = [g for g in candidates if any(_is_convolution(m) for m in members[g])]
        if len(conv_groups) > 1:
            candidates = [g for g in candidates if g not in conv_groups[1:]]
        if not candidates:
            group_of[op] = len(members)
            members.append([op])
            continue
        target = candidates[0]
        for other in candidates[1:]:
            for m in members[other]:
                group_of[m] = target
            members[target].extend(members[other])
            members[other] = []
        members[target].append(op)
        group_of[op] = target
    # compact, order groups by their last operation
    kept = sorted((m for m in members if m), key=lambda m: max(position[x] for x in m))
    groups: list[Group] = []
    group_of = {}
    for index, member_ops in enumerate(kept):
        member_ops.sort(key=position.__getitem__)
        backward = member_ops[0] in step.backward
        group = Group(index=index, kind="backward" if backward else "forward", ops=member_ops)
        for op in member_ops:
            group_of[op] = index
            for r in roots_of_op(op):
                group_of[r] = index
        groups.append(group)
    loss_root = root(step.loss)
    for group in groups:
        inputs: list[int] = []
        outputs: list[fx.Node] = []
        for op in group.ops:
            for r in reads[op]:
                if r in fixed_roots:
                    continue
                source = group_of[r]
                if source != group.index and source not in inputs:
                    inputs.append(source)
            for r in roots_of_op(op):
                if r in fixed_roots:
                    continue
                outside = [reader for reader in readers.get(r, []) if group_of[reader] != group.index]
                if outside or r is loss_root:
                    outputs.append(r)
            if _is_convolution(op):
                group.convolution = op
            if op in facts.random_ops:
                group.random = True
        group.inputs = inputs
        group.outputs = outputs
        if loss_root is not None and loss_root in {r for op in group.ops for r in roots_of_op(op)}:
            group.kind = "loss"
    _name(step, groups)
    _forward_nodes(step, groups, group_of)
    return PlanningGraph(step, facts, groups, group_of, root_of, fixed_roots, readers, gradient_roots)


def op_name(node: fx.Node) -> str:
    target = node.target
    name = target._schema.name.split("::")[-1] if isinstance(target, torch._ops.OpOverload) else str(target)
    name = name.lstrip("_").replace("_legit_functional", "").replace("_functional", "")
    half = node.meta.get("convolution_half")
    return f"{name}.{half}" if half else name


def _name(step: CapturedStep, groups: list[Group]) -> None:
    used: dict[str, int] = {}
    for group in groups:
        first = group.ops[0]
        module = step.module_path.get(first, "")
        names = [op_name(op) for op in group.ops]
        shown = list(dict.fromkeys(names))
        group.op_type = "+".join(shown[:4]) + ("+..." if len(shown) > 4 else "")
        main = group.convolution if group.convolution is not None else first
        label = op_name(main) + (f"+{len(group.ops) - 1}" if len(group.ops) > 1 else "")
        suffix = ":bwd" if group.kind == "backward" else ""
        if first.meta.get(HAND_OFF) is not None:
            label, suffix = op_name(_producer(first.args[0])), ":saved"  # named after the operation it copies from
        base = f"{module or '<root>'}/{label}"
        count = used.get(base + suffix, 0) + 1
        used[base + suffix] = count
        group.id = (base if count == 1 else f"{base}#{count}") + suffix
        group.module = module or None


def _forward_nodes(step: CapturedStep, groups: list[Group], group_of: dict) -> None:
    """A backward node's forward_node: the forward node whose operation it differentiates (same autograd
    sequence number: the operation's node or that of the copies it handed to the backward), if it reads that
    node's output; else the first forward node it reads."""
    by_sequence: dict[int, list[int]] = {}
    for group in groups:
        if group.kind == "backward":
            continue
        for op in group.ops:
            seq = op.meta.get("seq_nr")
            if seq is not None and group.index not in by_sequence.setdefault(seq, []):
                by_sequence[seq].append(group.index)
    for group in groups:
        if group.kind != "backward":
            continue
        forward_inputs = [g for g in group.inputs if groups[g].kind != "backward"]
        if not forward_inputs:
            continue
        seq = group.ops[0].meta.get("seq_nr")
        # the operation's own node, or the node its saved results were handed to (executor.capture.capture)
        matches = [g for g in by_sequence.get(seq, []) if g in forward_inputs]
        group.forward_node = matches[0] if matches else forward_inputs[0]


# --- what a planning node holds, from the fake run -----------------------------------------------------


def roots_of_op(planning: PlanningGraph, op: fx.Node) -> list[fx.Node]:
    if op in planning.facts.root_bytes:
        return [op]
    return [user for user in op.users if user in planning.facts.root_bytes]


def transient_peak_bytes(planning: PlanningGraph, group: Group, scratch_at: dict[fx.Node, int] | None = None) -> int:
    """The most bytes a node's intermediates (storages it makes and only it reads, outputs and fixed memory
    excepted) hold at once while its operations run in order, each freed after its last reader in the node.

    `scratch_at`: an operation's own scratch, known (a native convolution probed on slices of its batch). It is
    held while that operation runs, beside the intermediates then live and the outputs made so far, but not the
    outputs made after it: a convolution's reorder buffers are gone before the ReLU after it writes the node's
    output. The bytes above the node's outputs at the worst operation then come back, so that the node's
    outputs plus this are what it holds at most (where the outputs are counted as held throughout, this would
    count a convolution's scratch and its ReLU's output at once: on the six-convolution network at batch 128, 32
    MiB too many on each of the last convolutions)."""
    facts = planning.facts
    outputs = {facts.storage_of.get(r, r) for r in group.outputs}
    kept = outputs | set(planning.fixed_roots)
    members = set(group.ops)
    live: dict[fx.Node, int] = {}
    last: dict[fx.Node, fx.Node] = {}
    made: dict[fx.Node, int] = {}  # the outputs made so far, where scratch_at is given
    peak = 0
    for op in group.ops:
        for root in roots_of_op(planning, op):
            storage = facts.storage_of.get(root, root)
            if storage in outputs and scratch_at is not None:
                made.setdefault(storage, facts.root_bytes.get(storage, 0))
            if storage in kept or root in kept:
                continue
            live.setdefault(storage, facts.root_bytes.get(storage, 0))
            readers = [r for r in planning.readers.get(root, []) if r in members]
            last[storage] = max([last.get(storage, op), *readers], key=lambda n: group.ops.index(n))
        held = sum(live.values()) + (0 if op in facts.alias_of else unread_result_bytes(op))
        if scratch_at is not None:
            held += scratch_at.get(op, 0) + sum(made.values())
        peak = max(peak, held)
        for storage in [s for s, end in last.items() if end is op]:
            live.pop(storage, None)
            last.pop(storage)
    if scratch_at is not None:
        # the outputs this node made (one that is a view of an input's storage is not made here, and not taken off)
        return max(0, peak - sum(made.values()))
    return peak


def unread_result_bytes(op: fx.Node) -> int:
    """Results of a several-result operation that nothing reads (the graph has no getitem for them) are made all
    the same and freed as the operation returns: a dropout's mask where no backward needs it (LoRA's dropout
    before a frozen layer's input went 16 KiB over the provisional workspace, and the measuring pass over its
    budget)."""
    value = op.meta.get("val")
    if not isinstance(value, (tuple, list)):
        return 0
    read = {user.args[1] for user in op.users if user.target is operator.getitem}
    return sum(storage_bytes(tensor) for index, tensor in enumerate(value)
               if index not in read and isinstance(tensor, torch.Tensor) and not tensor._is_view())


def accumulation_bytes(planning: PlanningGraph, group: Group) -> int:
    """The parameter gradients the node makes (fixed memory). Added into a `.grad` already there (gradient
    accumulation, or zero_grad(set_to_none=False)), each is held beside it until the addition ends, as under
    AccumulateGrad: counted as the node's workspace, so the plan holds for any training loop."""
    facts = planning.facts
    return sum(facts.root_bytes.get(facts.storage_of.get(root, root), facts.root_bytes.get(root, 0))
               for root in planning.gradient_roots if planning.group_of.get(root) == group.index)


def node_sizes(planning: PlanningGraph, group: Group) -> tuple[int, int]:
    """(output_bytes, extra_saved_bytes) as a measured profile splits them: the first output's storage, then the
    node's other distinct output storages."""
    outputs = planning.size_bytes(group)
    main = planning.facts.storage_of.get(group.outputs[0], group.outputs[0]) if group.outputs else None
    main_bytes = planning.facts.root_bytes.get(main, 0) if main is not None else 0
    return min(main_bytes, outputs), outputs - min(main_bytes, outputs)

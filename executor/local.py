"""One node at a time: forward on detached inputs with a local autograd graph, and its backward.

This is the mechanism the profiler measures with and the executor replays
with. While a node's forward runs, `saved_tensors_hooks` intercept every
tensor its local graph saves for backward. Each one is then classified:

- fixed: a parameter, buffer or model input (resident all step anyway);
- input: shares storage with one of the node's inputs (an edge to that node);
- output: shares storage with the node's own output;
- extra: anything else (pooling indices, dropout masks, batch statistics),
  counted in the node's extra saved bytes and kept with its output.

The local graph keeps only these descriptions, never the tensors, so freeing
or offloading a node's tensors really releases them; the backward looks them
up in the store at the moment it runs (after a prefetch or a recomputation,
that is a new tensor with the same values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from executor.capture import Ref


def storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _geometry(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype)


def _view(base: torch.Tensor, geometry: tuple) -> torch.Tensor:
    size, stride, offset, dtype = geometry
    if base.dtype != dtype:
        base = base.view(dtype)
    if tuple(base.shape) == size and tuple(base.stride()) == stride and base.storage_offset() == offset:
        return base
    return base.as_strided(size, stride, offset)


@dataclass
class Saved:
    """What a local graph keeps for one saved tensor: a description, or the tensor itself if fixed."""

    tensor: torch.Tensor | None
    kind: str = "pending"  # fixed | input | output | extra
    source: str | None = None  # node whose tensor it is (input: the producer; output/extra: this node)
    slot: int = 0
    geometry: tuple | None = None


@dataclass
class Entry:
    """The tensors a node has produced and that are (or were) resident: output leaves, gradients, extras."""

    leaves: list  # flattened value (forward node) or [loss] (loss node); None when not resident
    spec: Any = None
    requires_grad: list[bool] = field(default_factory=list)
    grads: list = field(default_factory=list)  # backward / loss nodes: gradients aligned with input leaves
    extras: list = field(default_factory=list)

    def value(self):
        return tree_unflatten(self.leaves, self.spec) if self.spec is not None else self.leaves[0]

    def slots(self):
        """(list, index) of every tensor held, so copies can replace them in place."""
        for holder in (self.leaves, self.grads, self.extras):
            for index, item in enumerate(holder):
                if isinstance(item, torch.Tensor):
                    yield holder, index

    def tensors(self) -> list[torch.Tensor]:
        return [holder[index] for holder, index in self.slots()]


def distinct_bytes(tensors, exclude_ptrs: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors`, not counting fixed ones."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        ptr = storage_ptr(tensor)
        if ptr in seen or ptr in exclude_ptrs:
            continue
        seen.add(ptr)
        total += tensor.untyped_storage().nbytes()
    return total


@dataclass
class ForwardRun:
    """A node's local autograd graph, without the tensors it saved."""

    node_id: str
    leaves: list  # detached input tensors (their storage is released after the forward when they need grad)
    sources: list  # per input leaf: (producer id, leaf index), or None for a fixed tensor
    roots: list  # per output leaf: the tensor carrying grad_fn, or None
    parameters: list
    saved: list[Saved]

    def saved_sources(self) -> set[str]:
        return {s.source for s in self.saved if s.kind in ("input", "output", "extra") and s.source}


class Resolver:
    """Where unpack hooks find tensors now; the store implements `leaf` and `extra`."""

    def __init__(self, store):
        self.store = store

    def __call__(self, saved: Saved) -> torch.Tensor:
        if saved.kind == "fixed":
            return saved.tensor
        if saved.kind == "pending":
            return saved.tensor
        entry: Entry = self.store.entry(saved.source)
        holder = entry.extras if saved.kind == "extra" else entry.leaves
        base = holder[saved.slot]
        if base is None:
            raise RuntimeError(
                f"backward needs tensor {saved.source!r} ({saved.kind}), which is not resident: the schedule "
                "freed it without prefetching or recomputing it"
            )
        return _view(base, saved.geometry)


_SCALARS: dict[tuple, torch.Tensor] = {}


def _tiny(tensor: torch.Tensor) -> torch.Tensor:
    """A stand-in with the same shape, dtype and device, backed by one shared element (no allocation)."""
    key = (tensor.dtype, tensor.device)
    scalar = _SCALARS.get(key)
    if scalar is None:
        scalar = _SCALARS[key] = torch.zeros((), dtype=tensor.dtype, device=tensor.device)
    return scalar.expand(tensor.shape)


def release_storage(tensor: torch.Tensor) -> None:
    """Drop a graph-held tensor's storage while keeping its shape (for grad shape checks)."""
    with torch.no_grad():
        tensor.data = _tiny(tensor)


def resolve_args(args, kwargs, store, fixed_values: dict[str, Any], compute_ids):
    """Replace Refs by values: node values as detached leaves, fixed values as they are."""
    leaves: list[torch.Tensor] = []
    sources: list = []

    def materialize(item):
        if not isinstance(item, Ref):
            return item
        if item.name not in compute_ids:
            value = fixed_values[item.name]
            return value
        entry: Entry = store.entry(item.name)
        new_leaves = []
        for index, (leaf, flag) in enumerate(zip(entry.leaves, entry.requires_grad)):
            if isinstance(leaf, torch.Tensor):
                detached = leaf.detach().requires_grad_(flag)
                leaves.append(detached)
                sources.append((item.name, index))
                new_leaves.append(detached)
            elif leaf is None and flag is not None:
                raise RuntimeError(f"{item.name!r} is read but is not resident")
            else:
                new_leaves.append(leaf)
        return tree_unflatten(new_leaves, entry.spec) if entry.spec is not None else new_leaves[0]

    args, kwargs = fx.node.map_aggregate((args, kwargs), materialize)
    return args, kwargs, leaves, sources


def run_forward(
    node_id: str,
    call: Callable[[Any, Any], Any],
    args,
    kwargs,
    leaves: list,
    sources: list,
    parameters: list,
    fixed_ptrs: set[int],
    resolver: Resolver,
) -> tuple[Entry, ForwardRun]:
    """Run one node with saved-tensor hooks and return its resident tensors and its local graph."""
    saved: list[Saved] = []

    def pack(tensor):
        record = Saved(tensor=tensor)
        saved.append(record)
        return record

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, resolver):
        out = call(args, kwargs)
        out_leaves, spec = tree_flatten(out)
        input_ptrs = {storage_ptr(leaf): i for i, leaf in enumerate(leaves)}
        for i, item in enumerate(out_leaves):
            # an output sharing an input's storage (views, getitem) gets its own copy, so each
            # node's tensor can be freed, moved and counted on its own; so does a view of a
            # temporary, whose base would otherwise outlive the free
            if isinstance(item, torch.Tensor) and (storage_ptr(item) in input_ptrs or not compact(item)):
                out_leaves[i] = item.clone()
    output_ptrs = {storage_ptr(t): i for i, t in enumerate(out_leaves) if isinstance(t, torch.Tensor)}
    extras: list[torch.Tensor] = []
    extra_ptrs: dict[int, int] = {}
    for record in saved:
        tensor = record.tensor
        ptr = storage_ptr(tensor)
        if ptr in fixed_ptrs or tensor.untyped_storage().nbytes() == 0:
            record.kind = "fixed"
            continue
        record.geometry = _geometry(tensor)
        if ptr in input_ptrs:
            record.kind, (record.source, record.slot) = "input", sources[input_ptrs[ptr]]
        elif ptr in output_ptrs:
            record.kind, record.source, record.slot = "output", node_id, output_ptrs[ptr]
        else:
            if ptr not in extra_ptrs:
                extra_ptrs[ptr] = len(extras)
                extras.append(torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(tensor.untyped_storage()))
            record.kind, record.source, record.slot = "extra", node_id, extra_ptrs[ptr]
        record.tensor = None
    roots = [t if isinstance(t, torch.Tensor) and t.grad_fn is not None else None for t in out_leaves]
    values = [t.detach() if isinstance(t, torch.Tensor) else t for t in out_leaves]
    flags = [bool(t.requires_grad) if isinstance(t, torch.Tensor) else None for t in out_leaves]
    for root in roots:
        if root is not None:
            release_storage(root)
    for leaf in leaves:
        if leaf.requires_grad:
            release_storage(leaf)
    entry = Entry(leaves=values, spec=spec, requires_grad=flags, extras=extras)
    run = ForwardRun(node_id, leaves, sources, roots, [p for p in parameters if p.requires_grad], saved)
    return entry, run


def run_backward(run: ForwardRun, grad_outputs: list, retain_graph: bool = True):
    """Backward of one node's local graph: gradients for its input leaves and its parameters."""
    pairs = [(root, grad) for root, grad in zip(run.roots, grad_outputs) if root is not None and grad is not None]
    wanted_leaves = [i for i, leaf in enumerate(run.leaves) if leaf.requires_grad]
    targets = [run.leaves[i] for i in wanted_leaves] + list(run.parameters)
    input_grads: list = [None] * len(run.leaves)
    if not pairs or not targets:
        return input_grads, [None] * len(run.parameters)
    with torch.enable_grad():
        grads = torch.autograd.grad(
            [root for root, _ in pairs], targets, [grad for _, grad in pairs],
            retain_graph=retain_graph, allow_unused=True,
        )
    for k, i in enumerate(wanted_leaves):
        input_grads[i] = grads[k]
    return input_grads, list(grads[len(wanted_leaves):])


def compact(tensor: torch.Tensor) -> bool:
    """A tensor that owns exactly its storage: not a view, no slack (so its bytes do not depend on how it was made)."""
    return not tensor._is_view() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def own_storage(tensors: list, foreign_ptrs: set[int]) -> list:
    """Copies of the tensors that share storage with someone else's or are views (so each node owns its memory)."""
    result = []
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and (storage_ptr(tensor) in foreign_ptrs or not compact(tensor)):
            tensor = tensor.clone()
        result.append(tensor)
    return result

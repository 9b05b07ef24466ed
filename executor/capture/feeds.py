"""The graph's inputs at each step: parameters, buffers and constants by name, the user's inputs by position.

Names are resolved to (module, attribute) once, and read again at every step,
so an optimizer or `load_state_dict` that updates tensors in place, or code
that assigns a new tensor to an attribute, is seen by the next step.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from executor.capture.capture import CapturedStep


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attribute = name.rpartition(".")
    return (root.get_submodule(prefix) if prefix else root), attribute


class Feeder:
    """Reads the graph's inputs from `model` and `loss_fn` (by default the captured ones; a PlannedModule gives its
    own model, which must have the same structure)."""

    def __init__(self, step: CapturedStep, model: nn.Module | None = None, loss_fn=None):
        self.step = step
        model = step.model if model is None else model
        loss_fn = step.loss_fn if loss_fn is None else loss_fn
        placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
        self.size = len(placeholders)
        self.tangent_index: int | None = None
        self.attributes: list[tuple[int, nn.Module, str]] = []  # parameters and buffers
        self.constants: list[tuple[int, torch.Tensor]] = []
        self.inputs: list[tuple[int, int]] = []  # (placeholder index, leaf index)
        for index, node in enumerate(placeholders):
            source = step.sources[node]
            if source.kind in ("parameter", "buffer"):
                root = model if source.owner == "model" else loss_fn
                module, attribute = _owner(root, source.name)
                self.attributes.append((index, module, attribute))
            elif source.kind == "constant":
                self.constants.append((index, source.tensor))
            elif source.kind == "input":
                self.inputs.append((index, source.index))
            else:
                self.tangent_index = index
        self.index_of = {node: i for i, node in enumerate(placeholders)}
        self.gradient_owners = []
        for _, name, owner in step.gradients:
            root = model if owner == "model" else loss_fn
            self.gradient_owners.append(_owner(root, name))
        self._attribute_reads = [_reader(module, attribute) for _, module, attribute in self.attributes]
        self._gradient_reads = [_reader(module, attribute) for module, attribute in self.gradient_owners]
        self.written_back: list[tuple[str, object]] = []  # per mutation: ("attribute", (module, attr)) or ("input", leaf)
        for _, placeholder in step.mutations:
            source = step.sources[placeholder]
            if source.kind == "input":
                self.written_back.append(("input", source.index))
            elif source.kind == "constant":
                self.written_back.append(("constant", source.tensor))
            else:
                root = model if source.owner == "model" else loss_fn
                self.written_back.append(("attribute", _owner(root, source.name)))

    def feed(self, leaves: list) -> list:
        values: list = [None] * self.size
        for (index, module, attribute), value in zip(self.attributes, _read_all(self._attribute_reads)):
            values[index] = value
        for index, tensor in self.constants:
            values[index] = tensor
        for index, leaf in self.inputs:
            values[index] = leaves[leaf]
        return values

    def by_node(self, values: list) -> dict[fx.Node, object]:
        return {node: values[i] for node, i in self.index_of.items()}

    def parameters(self) -> list[torch.Tensor]:
        """The parameters that receive gradients, in gradient order."""
        return _read_all(self._gradient_reads)

    def write_back(self, staging: list[torch.Tensor], leaves: list, written: frozenset = frozenset()) -> None:
        """Copy each written-back value (BatchNorm statistics, a mutated input) into its tensor, once a step;
        `written`: those the step already wrote in place."""
        with torch.no_grad():
            for index, ((kind, where), value) in enumerate(zip(self.written_back, staging)):
                if index in written:
                    continue
                if kind == "input":
                    leaves[where].copy_(value)
                elif kind == "constant":
                    where.copy_(value)
                else:
                    module, attribute = where
                    getattr(module, attribute).copy_(value)

    def in_place_candidates(self) -> frozenset:
        """Mutations of the model's buffers (not of the user's inputs) whose tensor shares its storage with no
        other graph input: writing them during the step cannot change what another input reads."""
        values: list = [None] * self.size
        for index, module, attribute in self.attributes:
            values[index] = getattr(module, attribute)
        for index, tensor in self.constants:
            values[index] = tensor
        storages: dict[int, int] = {}
        for value in values:
            if isinstance(value, torch.Tensor):
                key = value.untyped_storage().data_ptr()
                storages[key] = storages.get(key, 0) + 1
        candidates = set()
        for index, (_, placeholder) in enumerate(self.step.mutations):
            value = values[self.index_of[placeholder]]
            if self.written_back[index][0] != "input" and isinstance(value, torch.Tensor) \
                    and storages[value.untyped_storage().data_ptr()] == 1:
                candidates.add(index)
        return frozenset(candidates)

    def staging_buffers(self, device: torch.device) -> list[torch.Tensor]:
        """One buffer per written-back value, shaped like the tensor it goes into (allocated once: fixed memory)."""
        buffers = []
        for value, _ in self.step.mutations:
            meta = value.meta["val"]
            buffers.append(torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=device))
        return buffers



def _reader(module: nn.Module, attribute: str) -> tuple[dict | None, str, nn.Module]:
    """(the module's parameters or buffers dict holding `attribute`, or None where getattr must read it, the
    attribute, the module): reading the dict at every step skips nn.Module.__getattr__, a Python call (2 us a
    tensor). A name its class defines (a property) is read as getattr reads it."""
    if hasattr(type(module), attribute):
        return None, attribute, module
    for table in ("_parameters", "_buffers"):
        held = module.__dict__.get(table)
        if held is not None and attribute in held:
            return held, attribute, module
    return None, attribute, module


def _read_all(reads: list) -> list:
    """The tensors `reads` (from `_reader`) name now: a parameter replaced since (module.weight = Parameter(...))
    is the new one, as nn.Module keeps it in the same dict; a name that left its dict is read by getattr."""
    values = [None if table is None else table.get(attribute) for table, attribute, _ in reads]
    for index in [index for index, value in enumerate(values) if value is None]:
        _, attribute, module = reads[index]
        values[index] = getattr(module, attribute)
    return values

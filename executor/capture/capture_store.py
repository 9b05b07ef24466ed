"""A captured step written to disk and read back without torch.export.

The capture (torch.export, then AOTAutograd's joint graph) is most of the time
a restarted run spends before its first step that is not profiling or solving.
What it produces is a graph of ATen operators and what each input means;
both are plain data. `dump_step` writes them as JSON (operator names,
arguments, node names, the metadata the planner reads) and the constants as
tensors; `load_step` rebuilds the graph and re-derives every node's fake value
from the model's own tensors and the step's inputs, then checks each value's
shape, strides and dtype against the ones recorded at capture. Anything that
does not round-trip exactly is a `StoreError`, and the caller captures again.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import treespec_dumps, treespec_loads

from executor.capture.capture import HAND_OFF, SHAPE_ONLY, CapturedStep, Source
from executor.capture.feeds import Feeder

# 2: the copies a forward operation hands to the backward (executor.capture.capture) carry their mark; 3: so do the
# stand-ins of a convolution's input (compiled regions stop at them); 4: attention masks a tracer built are taken out
# (executor.capture.attention), and the notes saying so are kept
FORMAT_VERSION = 4
_KEPT_META = ("partitioner_tag", "convolution_half", "seq_nr", HAND_OFF, SHAPE_ONLY)
_FILE_IN_TRACE = re.compile(r'File "([^"]+)", line \d+')


class StoreError(Exception):
    """A stored capture that cannot be used as it is (corrupt, from another torch, or not this model's)."""


# --- values --------------------------------------------------------------------------------------------


def _encode(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}  # inf and nan survive, and every bit of the value
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    raise StoreError(f"a graph argument of type {type(value).__name__} ({value!r}) cannot be stored")


def _decode(value: Any, nodes: dict[str, fx.Node]) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, nodes) for v in value]
    (kind, payload), = value.items()
    if kind == "node":
        return nodes[payload]
    if kind == "float":
        return float(payload)
    if kind == "tuple":
        return tuple(_decode(v, nodes) for v in payload)
    if kind == "dict":
        return {_decode(k, nodes): _decode(v, nodes) for k, v in payload}
    if kind in ("dtype", "layout", "memory_format"):
        found = getattr(torch, payload, None)
        if found is None:
            raise StoreError(f"unknown {kind} {payload!r}")
        return found
    if kind == "device":
        return torch.device(payload)
    raise StoreError(f"unknown stored value {value!r}")


def _target_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return f"{target._schema.name}.{target._overloadname}"
    raise StoreError(f"operation {target} is not an ATen operator")


def _target(name: str):
    if name == "getitem":
        return operator.getitem
    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet_name), overload)
    except (AttributeError, RuntimeError) as error:
        raise StoreError(f"operator {name} does not exist in this torch ({error})") from None


def _value_shape(value: Any) -> Any:
    """What the capture knew of a node's value: shape, strides, offset and dtype per tensor."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), list(value.stride()), value.storage_offset(), str(value.dtype).removeprefix("torch."), str(value.device)]
    if isinstance(value, (tuple, list)):
        return [_value_shape(v) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return type(value).__name__


def source_files(step: CapturedStep) -> list[str]:
    """The files of the code the graph was traced through (outside torch): a change to any of them is a change to
    what the model computes, even where its modules look the same."""
    files: set[str] = set()
    for node in step.graph.nodes:
        for path in _FILE_IN_TRACE.findall(node.meta.get("stack_trace") or ""):
            if "/torch/" not in path and not path.startswith("<"):
                files.add(path)
    return sorted(files)


def file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        return None


# --- dump ----------------------------------------------------------------------------------------------


def dump_step(step: CapturedStep) -> tuple[dict, dict[str, torch.Tensor]]:
    """The step as JSON-able data and the tensors it holds (constants), or StoreError."""
    tensors: dict[str, torch.Tensor] = {}
    nodes = []
    for node in step.graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            entry["target"] = _target_name(node.target)
        elif node.op == "get_attr":
            entry["target"] = node.target
            tensors[f"attribute:{node.target}"] = getattr(step.graph_module, node.target).detach().cpu()
        elif node.op == "placeholder":
            entry["target"] = node.target
        entry["args"] = _encode(node.args)
        entry["kwargs"] = _encode(dict(node.kwargs))
        entry["meta"] = {key: node.meta[key] for key in _KEPT_META if key in node.meta}
        entry["value"] = _value_shape(node.meta.get("val"))
        nodes.append(entry)
    sources = {}
    for node, source in step.sources.items():
        sources[node.name] = {"kind": source.kind, "name": source.name, "index": source.index, "owner": source.owner}
        if source.tensor is not None:
            tensors[f"constant:{node.name}"] = source.tensor.detach().cpu()
    data = {
        "format": FORMAT_VERSION,
        "torch": torch.__version__,
        "nodes": nodes,
        "sources": sources,
        "loss": step.loss.name,
        "gradients": [[value.name, name, owner] for value, name, owner in step.gradients],
        "mutations": [[value.name, placeholder.name] for value, placeholder in step.mutations],
        "input_spec": treespec_dumps(step.input_spec),
        "constant_leaves": [[index, _encode(value)] for index, value in step.constant_leaves.items()],
        "input_signature": step.input_signature,
        "target_signature": step.target_signature,
        "module_path": {node.name: path for node, path in step.module_path.items()},
        "source_line": {node.name: line for node, line in step.source_line.items()},
        "backward": sorted(node.name for node in step.backward),
        "autocast": [list(region) for region in step.autocast],
        "attention_notes": list(step.attention_notes),
        "loss_split": step.loss_split,
        "loss_notes": list(step.loss_notes),
        "export_seconds": step.export_seconds,
        "joint_seconds": step.joint_seconds,
        "structure_sha256": step.structure_sha256(),
        "source_files": {path: file_digest(path) for path in source_files(step)},
    }
    json.dumps(data)  # everything above must be plain data; a TypeError here is a bug in this module
    return data, tensors


# --- load ----------------------------------------------------------------------------------------------


def changed_files(data: dict) -> list[str]:
    """The traced source files that changed (or went missing) since the capture."""
    return [path for path, digest in data.get("source_files", {}).items() if file_digest(path) != digest]


def load_step(data: dict, tensors: dict[str, torch.Tensor], model, loss_fn, leaves: list) -> CapturedStep:
    """Rebuild the step for `model` (the same structure as the one captured) and these input leaves."""
    if data.get("format") != FORMAT_VERSION:
        raise StoreError(f"stored in format {data.get('format')}, this mosos reads format {FORMAT_VERSION}")
    if data.get("torch") != torch.__version__:
        raise StoreError(f"captured with torch {data.get('torch')}, this is torch {torch.__version__}")
    try:
        return _rebuild(data, tensors, model, loss_fn, leaves)
    except StoreError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as error:
        raise StoreError(f"the stored capture does not rebuild: {type(error).__name__}: {error}") from None


def _rebuild(data, tensors, model, loss_fn, leaves) -> CapturedStep:
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    attributes: dict[str, torch.Tensor] = {}
    for entry in data["nodes"]:
        op, name = entry["op"], entry["name"]
        args = _decode(entry["args"], nodes)
        kwargs = _decode(entry["kwargs"], nodes)
        if op == "get_attr":
            attributes[entry["target"]] = tensors[f"attribute:{entry['target']}"]
        if op in ("placeholder", "get_attr"):
            target = entry["target"]
        elif op == "call_function":
            target = _target(entry["target"])
        elif op == "output":
            target = "output"
        else:
            raise StoreError(f"node {name} is a {op}, which a captured step never holds")
        node = graph.create_node(op, target, tuple(args), kwargs, name=name)
        if node.name != name:
            raise StoreError(f"node {name} came back as {node.name}")
        node.meta.update(entry["meta"])
        nodes[name] = node
    graph_module = fx.GraphModule(attributes, graph)
    sources = {}
    for name, fields in data["sources"].items():
        tensor = tensors.get(f"constant:{name}")
        sources[nodes[name]] = Source(fields["kind"], fields["name"], fields["index"], tensor, fields["owner"])
    step = CapturedStep(
        model=model, loss_fn=loss_fn, graph_module=graph_module, sources=sources, loss=nodes[data["loss"]],
        gradients=[(nodes[value], name, owner) for value, name, owner in data["gradients"]],
        mutations=[(nodes[value], nodes[placeholder]) for value, placeholder in data["mutations"]],
        input_spec=treespec_loads(data["input_spec"]),
        constant_leaves={index: _decode(value, nodes) for index, value in data["constant_leaves"]},
        input_signature=data["input_signature"], target_signature=data["target_signature"],
        module_path={nodes[name]: path for name, path in data["module_path"].items()},
        source_line={nodes[name]: line for name, line in data["source_line"].items()},
        backward={nodes[name] for name in data["backward"]},
        export_seconds=data["export_seconds"], joint_seconds=data["joint_seconds"],
        autocast=tuple(tuple(region) for region in data["autocast"]),
        attention_notes=list(data["attention_notes"]),
        loss_split=bool(data.get("loss_split", False)),
        loss_notes=list(data.get("loss_notes", [])),
    )
    _restore_values(step, leaves, data)
    actual = step.structure_sha256()
    if actual != data["structure_sha256"]:
        raise StoreError(f"the rebuilt graph hashes to {actual[:12]}, the captured one to {data['structure_sha256'][:12]} "
                         "(the model's parameters differ from the captured ones)")
    return step


def _restore_values(step: CapturedStep, leaves: list, data: dict) -> None:
    """Every node's fake value, from the model's tensors and these inputs, checked against the capture's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    feeder = Feeder(step)
    values = feeder.feed(leaves)
    recorded = {entry["name"]: entry["value"] for entry in data["nodes"]}
    mode = FakeTensorMode()
    fakes: dict[int, torch.Tensor] = {}

    def fake(value):
        if not isinstance(value, torch.Tensor):
            return value
        return fakes.setdefault(id(value), mode.from_tensor(value))

    placeholders = iter(values)
    with torch.no_grad():
        for node in step.graph.nodes:
            if node.op == "placeholder":
                value = next(placeholders)
                if step.sources[node].kind == "tangent":  # the loss's gradient: the loss's shape, as captured
                    shape, stride, _, dtype, device = recorded[node.name]
                    with mode:
                        value = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
                    node.meta["val"] = value
                else:
                    node.meta["val"] = fake(value)
            elif node.op == "get_attr":
                node.meta["val"] = fake(getattr(step.graph_module, node.target))
            elif node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
                with mode:
                    node.meta["val"] = node.target(*args, **kwargs)
            else:
                continue
            if _value_shape(node.meta["val"]) != recorded[node.name]:
                raise StoreError(f"node {node.name} ({node.target}) has {_value_shape(node.meta['val'])} here, "
                                 f"{recorded[node.name]} at capture")

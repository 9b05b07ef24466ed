"""Planning nodes run as kernels compiled by Inductor.

A planning node's ATen operations (with the views it derives) become one small
fx graph, from the node's inputs to the tensors the schedule acts on: what it
hands to other nodes and the step's outputs it owns. Inductor compiles that
graph once per structure and input layout, so every layer of a transformer
shares one kernel; inside it cheap chains fuse, while every tensor the plan
keeps, frees or recomputes is still a real tensor at the node's boundary.

Compiled on fake tensors (nothing is allocated, so the budget holds while it
compiles). Dropout and batch norm stay eager's own calls inside a kernel
(eager's mask, eager's rounding). A node that is better or only correctly run
eagerly says why: nothing to fuse (fewer than two operations Inductor writes
itself), random operations other than one dropout, batch norms updating the
model's statistics in place, convolution algorithms of our own, a kernel whose
strides are not eager's, and anything Inductor refuses.
"""

from __future__ import annotations

import copy
import operator
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

# one library call each: Inductor would call the same kernel
_LIBRARY_CALLS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
    torch.ops.aten.convolution_backward.default, torch.ops.aten.embedding.default,
    torch.ops.aten.embedding_dense_backward.default,
}

_WITH_BIAS = {torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}

_LOCK = threading.Lock()
_KERNELS: dict[str, Callable] = {}  # structure and input layout -> compiled kernel, shared in the process
_FAILURES: dict[str, str] = {}  # the same key -> why Inductor refused it


@dataclass
class CompiledNodes:
    """What the compiled replay ran: per node, its kernel or the reason it ran eagerly, and the compile time."""

    compiled: dict[str, str] = field(default_factory=dict)  # node id -> kernel key
    eager: dict[str, str] = field(default_factory=dict)  # node id -> reason
    compile_seconds: float = 0.0
    kernels_compiled: int = 0  # compiled here (not taken from the process' kernels)
    eager_calls: dict[str, int] = field(default_factory=dict)  # compiled node -> calls run eagerly (layout)

    def describe(self) -> str:
        kernels = len(set(self.compiled.values()))
        text = (f"{len(self.compiled)} nodes compiled into {kernels} kernels "
                f"({self.kernels_compiled} compiled now, {self.compile_seconds:.1f} s)")
        if self.eager:
            reasons: dict[str, int] = {}
            for reason in self.eager.values():
                reasons[reason] = reasons.get(reason, 0) + 1
            text += f"; {len(self.eager)} eager: " + ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
        if self.eager_calls:
            text += (f"; {len(self.eager_calls)} compiled nodes ran eagerly where their input layout was not the "
                     "capture's")
        return text


class NodeCompiler:
    """Compiles planning nodes for one program (kernels are shared process-wide)."""

    def __init__(self, say: Callable[[str], None] | None = None):
        self.say = say or (lambda message: None)
        self.record = CompiledNodes()

    def kernel(self, node_id: str, members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
               views: set[fx.Node], reason: str | None) -> Callable | None:
        """The compiled kernel of one node, or None (eager) with the reason recorded."""
        if reason is None:
            reason = _not_worth_compiling(members, views)
        if reason is not None:
            self.record.eager[node_id] = reason
            return None
        try:
            graph_module, example_inputs = subgraph(members, inputs, outputs)
        except _Unsupported as unsupported:
            self.record.eager[node_id] = str(unsupported)
            return None
        key = structure_key(graph_module, example_inputs)
        with _LOCK:
            kernel = _KERNELS.get(key)
            failure = _FAILURES.get(key)
            if kernel is None and failure is None:
                started = time.perf_counter()
                try:
                    kernel = _KERNELS[key] = _Kernel(graph_module, example_inputs)
                except Exception as error:  # noqa: BLE001 - whatever Inductor refuses runs eagerly, with the reason
                    failure = _FAILURES[key] = _refusal(error)
                self.record.compile_seconds += time.perf_counter() - started
                if kernel is not None:
                    self.record.kernels_compiled += 1
                    self.say(f"compiled node kernel {len(set(self.record.compiled.values())) + 1} ({node_id})")
        if kernel is None:
            self.record.eager[node_id] = failure
            return None
        self.record.compiled[node_id] = key
        return _NodeCall(kernel, node_id, self.record)


class _Unsupported(Exception):
    pass


def _not_worth_compiling(members: list[fx.Node], views: set[fx.Node]) -> str | None:
    """Fusion needs two operations Inductor writes itself (a bias added by addmm counts: Inductor adds it in its
    own kernel); a node with fewer runs eagerly and costs no compile time."""
    computing = [n for n in members if n.op == "call_function" and n.target is not operator.getitem
                 and n not in views]
    if not computing:
        return "views only"
    fusable = sum(1 for n in computing if n.target not in _LIBRARY_CALLS or n.target in _WITH_BIAS)
    if fusable < 2:
        return "nothing to fuse (one operation besides library calls)"
    return None


def subgraph(members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]):
    """A graph module computing `outputs` from `inputs` with `members`, and fake example inputs for it."""
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    examples = []
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=False)
    for index, node in enumerate(inputs):
        value = _meta(node)
        if not isinstance(value, torch.Tensor):
            raise _Unsupported("reads a value that is not a tensor")
        placeholder = graph.placeholder(f"input_{index}")
        placeholder.meta["val"] = value
        mapping[node] = placeholder
        with fake_mode:
            examples.append(torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device))
    for node in members:
        if node.op != "call_function":
            raise _Unsupported(f"holds a {node.op} node")
        mapping[node] = graph.node_copy(node, lambda n: mapping[n])
    results = []
    for node in outputs:
        value = _meta(node)
        if not isinstance(value, torch.Tensor):
            raise _Unsupported("hands on a value that is not a tensor")
        results.append(mapping[node])
    graph.output(tuple(results))
    module = fx.GraphModule(torch.nn.Module(), graph)
    return module, examples


def _meta(node: fx.Node) -> Any:
    return node.meta.get("val")


def structure_key(module: fx.GraphModule, examples: list) -> str:
    """The operations with their arguments (inputs by position) and the inputs' layouts: equal keys compute
    equally, so they share a kernel."""
    lines = [f"{tuple(t.shape)}|{t.stride()}|{t.dtype}|{t.device}" for t in examples]
    names = {}
    for node in module.graph.nodes:
        names[node] = f"%{len(names)}"
        if node.op == "call_function":
            args = fx.node.map_arg((node.args, node.kwargs), lambda n: names[n])
            lines.append(f"{names[node]}={node.target}{args}")
        elif node.op == "output":
            lines.append("out" + str(fx.node.map_arg(node.args, lambda n: names[n])))
    return "\n".join(lines)


def _refusal(error: Exception) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    return f"Inductor refused it ({type(error).__name__}: {first_line})"


class _Kernel:
    """One compiled node kernel, for the input layout the capture gives. A call with another layout (an eager
    kernel whose real strides its fake kernel does not give, such as CPU attention's, upstream) runs the node's
    graph eagerly instead: the graph's own views may only hold for the captured layout, and a kernel compiled
    for another layout would hand on other strides than eager's."""

    def __init__(self, module: fx.GraphModule, examples: list):
        self.module = module
        self.layout = _layout(examples)
        output = next(n for n in module.graph.nodes if n.op == "output")
        self.output_layout = _layout([value.meta["val"] for value in output.args[0]])
        self.random = any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                          and torch.Tag.nondeterministic_seeded in n.target.tags for n in module.graph.nodes)
        self.compiled = _compile(module, examples)


class _NodeCall:
    """A node's call of its kernel; where the layout differs, the eager graph, recorded for the report."""

    def __init__(self, kernel: _Kernel, node_id: str, record: "CompiledNodes"):
        self.kernel, self.node_id, self.record = kernel, node_id, record
        self.layout = kernel.layout
        self.checked = False

    def __call__(self, *args):
        if _layout(args) == self.layout:
            if self.checked:
                return self.kernel.compiled(*args)
            rng = _rng_state(args) if self.kernel.random else None
            outputs = self.kernel.compiled(*args)
            if _layout(outputs) == self.kernel.output_layout:
                self.checked = True
                return outputs
            # the kernel hands on other strides than eager's (the next node's views may not hold): this node
            # runs eagerly from now on, drawing the random numbers the kernel drew
            del outputs
            if rng is not None:
                _set_rng_state(rng)
            self.layout = None
            self.record.eager[self.node_id] = "compiled, its outputs' strides were not eager's"
            self.record.compiled.pop(self.node_id, None)
        elif self.layout is not None:
            self.record.eager_calls[self.node_id] = self.record.eager_calls.get(self.node_id, 0) + 1
        return self.kernel.module(*args)


def _rng_state(tensors) -> tuple:
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, value in cuda.items():
        torch.cuda.set_rng_state(value, device)


def _layout(tensors) -> tuple:
    return tuple(t.stride() for t in tensors)


# kept whole, as eager's kernels: dropout, whose mask must be eager's; and batch norm: Inductor's decomposition sums in another order, and the gradients
# before a batch norm cancel (its backward removes their mean), so a rounding apart becomes 1e-2 of a convolution
# weight's gradient (MobileNetV2)
_KEPT_WHOLE = {
    torch.ops.aten._native_batch_norm_legit_functional.default, torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit_no_training.default, torch.ops.aten.native_batch_norm.default,
    torch.ops.aten.native_batch_norm_backward.default,
    torch.ops.aten.native_dropout.default,  # eager's call, so eager's mask (with fallback_random)
}


def _decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return {op: rule for op, rule in select_decomp_table().items() if op not in _KEPT_WHOLE}


def _compile(module: fx.GraphModule, examples: list) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    # layouts as the graph has them (no channels-last conversion: eager's convolution, eager's rounding), eager's
    # random numbers where a random operation is compiled at all, and deterministic lowerings: Inductor's own
    # scatter-add (an embedding's backward) adds atomically in parallel, in an order that changes from run to run
    options = {"fallback_random": True, "layout_optimization": False, "keep_output_stride": True,
               "deterministic": True}
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        # read by the lowerings while compiling only; the kernels run without it
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        with torch._inductor.config.patch(options), torch.no_grad():
            return compile_fx(copy.deepcopy(module), examples, decompositions=_decompositions())
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill

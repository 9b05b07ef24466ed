"""Planning nodes run as kernels compiled by Inductor.

A planning node's ATen operations (with the views it derives) become one small
fx graph, from the node's inputs to the tensors the schedule acts on: what it
hands to other nodes and the step's outputs it owns. Inductor compiles that
graph once per structure and input layout, so every layer of a transformer
shares one kernel; inside it cheap chains fuse, while every tensor the plan
keeps, frees or recomputes is still a real tensor at the node's boundary.

Consecutive computations with nothing but frees scheduled between them may
run as one region kernel (`region_kernel`, chosen by executor.engine.regions and the
code generator): the same compiling, with a view of a value made inside
turned into a reshape, since Inductor may lay such a value out otherwise.
Every kernel's first call checks what it hands on: outputs in other strides
than eager's make it compile again requiring eager's; outputs that share
memory with its inputs or each other make it run eagerly.

Compiled on fake tensors (nothing is allocated, so the budget holds while it
compiles). Dropout stays eager's own call inside a kernel (eager's mask), and
so does batch norm except where ATen's CPU kernel sums in double: there it is
computed as that kernel computes it (executor.engine.batch_norm_decomposition),
and fuses. A node that is better or only correctly run
eagerly says why: nothing to fuse (fewer than two operations Inductor writes
itself), random operations other than one dropout, convolution algorithms of
our own, a normalization on lower-precision inputs with float32 parameters
(autocast's batch norm: torch's shape functions give its statistics the
inputs' dtype where the kernel gives float32, and a kernel compiled from them
would hand the next node the wrong dtype), a kernel whose
strides are not eager's, and anything Inductor refuses. A kernel called with
other strides or dtypes than it was compiled for runs its node's graph
eagerly.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch._inductor.inductor_prims  # noqa: F401 - registers prims.inductor_force_stride_order
import torch.fx as fx

from executor.capture import autocast
from executor.capture.planning_graph import is_random
from executor.engine import batch_norm_decomposition

# one library call each: Inductor would call the same kernel
_LIBRARY_CALLS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
    torch.ops.aten.convolution_backward.default, torch.ops.aten.embedding.default,
    torch.ops.aten.embedding_dense_backward.default,
}

_FORCE_STRIDES = torch.ops.prims.inductor_force_stride_order.default

_WITH_BIAS = {torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}

_LOCK = threading.Lock()
_KERNELS: dict[str, Callable] = {}  # structure and input layout -> compiled kernel, shared in the process
_FAILURES: dict[str, str] = {}  # the same key -> why Inductor refused it


# the implementation a compiled profile gives a node beside its kernel ("default"): the node's own ATen calls, timed
# and measured in a pass of their own, so that the plan runs eagerly what Inductor made slower (its CPU kernel for
# a max pool's backward ran 6x slower than eager's, ResNet-18-small)
EAGER = "eager"


@dataclass
class CompiledNodes:
    """What the compiled replay ran: per node, its kernel or the reason it ran eagerly, and the compile time."""

    compiled: dict[str, str] = field(default_factory=dict)  # node id -> kernel key
    eager: dict[str, str] = field(default_factory=dict)  # node id -> reason
    compile_seconds: float = 0.0
    kernels_compiled: int = 0  # compiled here (not taken from the process' kernels)
    eager_calls: dict[str, int] = field(default_factory=dict)  # compiled node -> calls run eagerly (layout)
    regions: dict[str, list[str]] = field(default_factory=dict)  # region label -> its nodes, run as one kernel
    regions_refused: dict[str, str] = field(default_factory=dict)  # region label -> why (its nodes ran apart)

    def describe(self) -> str:
        kernels = len(set(self.compiled.values()))
        text = (f"{len(self.compiled)} nodes compiled into {kernels} kernels "
                f"({self.kernels_compiled} compiled now, {self.compile_seconds:.1f} s)")
        if self.regions:
            nodes = sum(len(members) for members in self.regions.values())
            text += f"; {len(self.regions)} regions of consecutive nodes ({nodes} node computations)"
        if self.regions_refused:
            reasons: dict[str, int] = {}
            for reason in self.regions_refused.values():
                reasons[reason] = reasons.get(reason, 0) + 1
            text += (f"; {len(self.regions_refused)} regions ran node by node: "
                     + ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())))
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

    def __init__(self, say: Callable[[str], None] | None = None, max_region_kernels: int = 0):
        self.say = say or (lambda message: None)
        self.record = CompiledNodes()
        # kinds of region one program may use (a bound on its compile time that, unlike a time limit, picks the
        # same regions, and so the same rounding, in every run); regions beyond run node by node
        self.max_region_kernels = max_region_kernels
        self.region_keys: set[str] = set()

    def kernel(self, node_id: str, members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
               views: set[fx.Node], reason: str | None) -> Callable | None:
        """The compiled kernel of one node, or None (eager) with the reason recorded."""
        kernel, reason = self._compiled(node_id, members, inputs, outputs, views, reason)
        if kernel is None:
            self.record.eager[node_id] = reason
            return None
        self.record.compiled[node_id] = kernel.key
        return _NodeCall(kernel, [node_id], self.record)

    def region_kernel(self, label: str, node_ids: list[str], members: list[fx.Node], inputs: list[fx.Node],
                      outputs: list[fx.Node], views: set[fx.Node], key: str | None) -> Callable | None:
        """One kernel for consecutive node computations (`executor.engine.regions`; `key` from `region_key`), or None
        with the reason recorded: then each node runs apart, compiled or not as `kernel` decides."""
        if key not in self.region_keys and len(self.region_keys) >= self.max_region_kernels:
            self.record.regions_refused[label] = f"more than {self.max_region_kernels} kinds of region"
            return None
        kernel, reason = self._compiled(label, members, inputs, outputs, views, None, reshape_views=True)
        if kernel is not None:
            self.region_keys.add(kernel.key)
        if kernel is None:
            self.record.regions_refused[label] = reason
            return None
        self.record.regions[label] = list(node_ids)
        for node_id in node_ids:
            self.record.compiled[node_id] = kernel.key
            self.record.eager.pop(node_id, None)
        return _NodeCall(kernel, node_ids, self.record)

    def region_key(self, members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> str | None:
        """The kernel key a region would have (regions with equal keys share one kernel); None if it has none."""
        try:
            return structure_key(*subgraph(members, inputs, outputs, reshape_views=True))
        except _Unsupported:
            return None

    def _compiled(self, label: str, members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                  views: set[fx.Node], reason: str | None,
                  reshape_views: bool = False) -> tuple["_Kernel | None", str | None]:
        if reason is None:
            reason = _not_worth_compiling(members, views) or _mixed_precision_norm(members)
        if reason is not None:
            return None, reason
        try:
            graph_module, example_inputs = subgraph(members, inputs, outputs, reshape_views)
        except _Unsupported as unsupported:
            return None, str(unsupported)
        key = structure_key(graph_module, example_inputs)
        with _LOCK:
            kernel = _KERNELS.get(key)
            failure = _FAILURES.get(key)
            if kernel is None and failure is None:
                started = time.perf_counter()
                try:
                    kernel = _KERNELS[key] = _Kernel(graph_module, example_inputs, key)
                except Exception as error:  # noqa: BLE001 - whatever Inductor refuses runs eagerly, with the reason
                    failure = _FAILURES[key] = _refusal(error)
                self.record.compile_seconds += time.perf_counter() - started
                if kernel is not None:
                    self.record.kernels_compiled += 1
                    self.say(f"compiled kernel {self.record.kernels_compiled} ({label})")
        return kernel, failure


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


_aten = torch.ops.aten
_NORMALIZATIONS = {
    _aten.native_batch_norm.default, _aten._native_batch_norm_legit.default,
    _aten._native_batch_norm_legit.no_stats, _aten._native_batch_norm_legit_functional.default,
    _aten._native_batch_norm_legit_no_training.default, _aten.native_batch_norm_backward.default,
    _aten.native_group_norm.default, _aten.native_group_norm_backward.default,
    _aten.native_layer_norm.default, _aten.native_layer_norm_backward.default,
}


def _mixed_precision_norm(members: list[fx.Node]) -> str | None:
    """A normalization whose tensors are of several dtypes (autocast hands a batch norm bfloat16 inputs beside its
    float32 weights): ATen's kernels then give its statistics in float32, torch's shape functions, which a compiled
    kernel is built from, in the inputs' dtype. Eager's call gives eager's dtypes."""
    for node in members:
        if node.op != "call_function" or node.target not in _NORMALIZATIONS:
            continue
        tensors = [_meta(arg) for arg in node.args if isinstance(arg, fx.Node)]
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if isinstance(t, torch.Tensor)})
        if len(dtypes) > 1:
            return f"a normalization on mixed dtypes ({'/'.join(dtypes)}), whose statistics' dtype Inductor mistakes"
    return None


_STRICT_VIEWS = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                 torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


def subgraph(members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node], reshape_views: bool = False):
    """A graph module computing `outputs` from `inputs` with `members`, and fake example inputs for it.

    `reshape_views`: a view of a value made inside becomes a reshape (the same values). Across several nodes
    Inductor may lay out a value it makes inside otherwise than eager did, where a strict view cannot follow;
    what leaves the kernel still has eager's strides (checked at its first call)."""
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
        if reshape_views and node.target in _STRICT_VIEWS and node.args[0] not in inputs:
            mapping[node].target = _STRICT_VIEWS[node.target]
    results = []
    for node in outputs:
        value = _meta(node)
        if not isinstance(value, torch.Tensor):
            raise _Unsupported("hands on a value that is not a tensor")
        result = mapping[node]
        results.append(result)
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

    def __init__(self, module: fx.GraphModule, examples: list, key: str):
        self.module, self.examples, self.key = module, examples, key
        self.layout = _input_layout(examples)
        output = next(n for n in module.graph.nodes if n.op == "output")
        self.output_layout = _layout([value.meta["val"] for value in output.args[0]])
        self.output_dtypes = tuple(value.meta["val"].dtype for value in output.args[0])
        self.random = any(n.op == "call_function" and is_random(n) for n in module.graph.nodes)
        self.compiled = _compile(module, examples)
        self.forced = False  # compiled again with eager's strides required of some outputs

    def force_eager_strides(self, outputs: list[int]) -> float:
        """Compile again, requiring eager's strides of `outputs` (Inductor picks its own layout for a value it
        makes, a concatenation's say, and the next node's views are eager's): free where Inductor writes the value
        in that order anyway, a copy inside the kernel otherwise. Only for the outputs that came out otherwise:
        a requirement on every output would hide from Inductor which values leave the kernel, and it would then
        drop a clone of one of them as a no-op. Returns the compile seconds."""
        started = time.perf_counter()
        module = copy.deepcopy(self.module)
        output = next(n for n in module.graph.nodes if n.op == "output")
        results = list(output.args[0])
        for index in outputs:
            value = results[index].meta["val"]
            with module.graph.inserting_before(output):
                forced = module.graph.call_function(_FORCE_STRIDES, (results[index], list(value.stride())))
            forced.meta["val"] = value
            results[index] = forced
        output.args = (tuple(results),)
        module.recompile()
        self.compiled = _compile(module, self.examples)
        self.forced = True
        return time.perf_counter() - started


class _NodeCall:
    """A node's (or a region's) call of its kernel; where the layout differs, the eager graph, recorded for the
    report."""

    def __init__(self, kernel: _Kernel, node_ids: list[str], record: "CompiledNodes"):
        self.kernel, self.node_ids, self.record = kernel, node_ids, record
        self.layout = kernel.layout
        self.checked = False

    def __call__(self, *args):
        if _input_layout(args) == self.layout:
            if self.checked:
                return self.kernel.compiled(*args)
            rng = _rng_state(args) if self.kernel.random else None
            outputs = self.kernel.compiled(*args)
            wrong = _wrong_strides(outputs, self.kernel.output_layout)
            if wrong and not self.kernel.forced:
                del outputs
                if rng is not None:
                    _set_rng_state(rng)
                with _LOCK:
                    if not self.kernel.forced:
                        self.record.compile_seconds += self.kernel.force_eager_strides(wrong)
                        self.record.kernels_compiled += 1
                outputs = self.kernel.compiled(*args)
                wrong = _wrong_strides(outputs, self.kernel.output_layout)
            if tuple(t.dtype for t in outputs) != self.kernel.output_dtypes:
                reason = "compiled, its outputs' dtypes were not eager's"
            elif wrong:
                reason = "compiled, its outputs' strides were not eager's"
            elif not _own_storages(outputs, args):
                reason = "compiled, its outputs shared memory with its inputs or each other"
            else:
                self.checked = True
                return outputs
            # the kernel hands on other strides than eager's (the next node's views may not hold), or holds memory
            # the schedule frees (an output that is an input, a clone Inductor dropped): this node runs eagerly
            # from now on, drawing the random numbers the kernel drew
            del outputs
            if rng is not None:
                _set_rng_state(rng)
            self.layout = None
            for node_id in self.node_ids:
                self.record.eager[node_id] = reason
                self.record.compiled.pop(node_id, None)
        elif self.layout is not None:
            for node_id in self.node_ids:
                self.record.eager_calls[node_id] = self.record.eager_calls.get(node_id, 0) + 1
        return self.kernel.module(*args)


def _rng_state(tensors) -> tuple:
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, value in cuda.items():
        torch.cuda.set_rng_state(value, device)


def _wrong_strides(outputs, layout: tuple) -> list[int]:
    return [index for index, (tensor, strides) in enumerate(zip(outputs, layout)) if tensor.stride() != strides]


def _own_storages(outputs, inputs) -> bool:
    """Every output in a storage of its own, none of the inputs' (eager made each a tensor of its own)."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    for tensor in outputs:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in taken and tensor.untyped_storage().nbytes():
            return False
        taken.add(pointer)
    return True


def _layout(tensors) -> tuple:
    return tuple(t.stride() for t in tensors)


def _input_layout(tensors) -> tuple:
    """What a kernel is compiled for beside shapes (fixed by the schedule): each input's strides and dtype."""
    return tuple((t.stride(), t.dtype) for t in tensors)


# kept whole, as eager's kernels: dropout, whose mask must be eager's; batch norm, whose decomposition by Inductor
# sums in another order, and the gradients before a batch norm cancel (its backward removes their mean), so a
# rounding apart becomes 1e-2 of a convolution weight's gradient (MobileNetV2): only where ATen's CPU kernel sums
# in double is it decomposed, as that kernel computes (executor.engine.batch_norm_decomposition); an embedding's
# backward
_KEPT_WHOLE = {
    torch.ops.aten._native_batch_norm_legit_functional.default, torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit_no_training.default, torch.ops.aten.native_batch_norm.default,
    torch.ops.aten.native_batch_norm_backward.default,
    torch.ops.aten.native_dropout.default,  # eager's call, so eager's mask (with fallback_random)
    # an embedding's backward: eager's kernel adds in eager's order; Inductor's deterministic scatter-add ran 1.4x
    # slower in a region (GPT-2's position embedding)
    torch.ops.aten.embedding_dense_backward.default,
}


def _decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    table = {op: rule for op, rule in select_decomp_table().items() if op not in _KEPT_WHOLE}
    table.update(batch_norm_decomposition.DECOMPOSITIONS)  # NotImplemented, so ATen's kernel, off ATen's double path
    return table


_fallbacks_registered = False


def _register_kept_whole_fallbacks() -> None:
    """Make the operations kept whole Inductor's fallbacks to ATen's kernels up front, as torch 2.13 makes them
    when it first meets one. Before (torch 2.11, the GPU machines' image) Inductor checked a new fallback against
    its own decomposition table instead of the one `compile_fx` was given, found batch norm and an embedding's
    backward there, and refused every kernel holding one ("both a fallback and a decomp for same op"): ResNet's
    regions ran node by node. The layout constraint is the one Inductor's implicit fallback takes."""
    global _fallbacks_registered
    if _fallbacks_registered:
        return
    from torch._inductor import lowering

    _fallbacks_registered = True
    if "override_decomp" not in inspect.signature(lowering.make_fallback).parameters:
        return  # an Inductor older still: its fallbacks are made as they are met, as before
    try:
        from torch._library.utils import get_layout_constraint_tag
    except ImportError:  # a torch without layout tags: its implicit fallback had no constraint
        get_layout_constraint_tag = None
    for op in sorted(_KEPT_WHOLE - lowering.lowerings.keys(), key=str):
        constraint = (lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
                      if get_layout_constraint_tag is not None else None)
        lowering.make_fallback(op, layout_constraint=constraint, warn=False, override_decomp=True)


@contextlib.contextmanager
def _ci_unset():
    """Inductor falls back to ATen's own kernel for an operation it has no lowering for, and with `CI` set in the
    environment (a check meant for PyTorch's own CI) refuses any such fallback for an operation that has a
    decomposition: exactly the operations kept whole here (batch norm, dropout, an embedding's backward). So a
    user's CI job, or ours, would run every kernel holding one eagerly. Unset while compiling (under the
    module's lock); the fallback, once made, is Inductor's for the process."""
    value = os.environ.pop("CI", None)
    try:
        yield
    finally:
        if value is not None:
            os.environ["CI"] = value


def _compile(module: fx.GraphModule, examples: list) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    # layouts as the graph has them (no channels-last conversion: eager's convolution, eager's rounding), eager's
    # random numbers where a random operation is compiled at all, and deterministic lowerings: Inductor's own
    # scatter-add (an embedding's backward) adds atomically in parallel, in an order that changes from run to run
    options = {"fallback_random": True, "layout_optimization": False, "keep_output_stride": True,
               "deterministic": True}
    options.update(batch_norm_decomposition.inductor_options(module))
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        # read by the lowerings while compiling only; the kernels run without it
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        # the graph carries autocast's casts: traced under an ambient autocast (a region compiled when the user's
        # `with torch.autocast(...)` calls the planned module), a float32 matmul would come out in bfloat16
        with torch._inductor.config.patch(options), torch.no_grad(), autocast.disabled(), _ci_unset():
            _register_kept_whole_fallbacks()
            return compile_fx(copy.deepcopy(module), examples, decompositions=_decompositions())
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill

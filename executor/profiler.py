"""Measure a real model into a GraphProfile: the graph, the sizes, the times, the algorithms.

One reference pass runs every node on its own (as the executor will) and
finds, through saved-tensor hooks, what each backward really reads. Then each
node is timed: warm-up runs, then the median of repeated runs (CUDA events on
a GPU; on the CPU the calling thread's CPU time when torch runs one thread, else
perf_counter_ns), forward and backward separately, and every convolution once
per algorithm the executor can run. The model's parameters, buffers, gradients
and the RNG are left as they were.

What a node's time should add up to is a plain PyTorch step, so timing copies
one as closely as it can: whole passes node after node, each node reading what
the previous one has just computed; the native implementations in a clean pass,
the other algorithms after it; and the fixed cost of the timing harness itself
(measured on an identity node through the same path, in every pass) subtracted.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property
from typing import Any, Callable

import torch
from torch import nn
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from executor import conv_algorithms
from executor.capture import CapturedGraph, CapturedNode, Ref, capture, tensor_signature
from executor.errors import CaptureError
from executor.local import Entry, ForwardRun, Resolver, distinct_bytes, own_storage, resolve_args, run_backward, run_forward, storage_ptr
from planner.errors import MososError
from planner.profile import GraphProfile, parse_profile

TOOL = "mosos executor.profiler 0.1"
LOSS_ID = "loss"


def backward_id(node_id: str) -> str:
    return f"{node_id}:bwd"


class DictStore:
    """Everything resident: what the reference pass uses."""

    def __init__(self):
        self.entries: dict[str, Entry] = {}

    def entry(self, node_id: str) -> Entry:
        return self.entries[node_id]


@dataclass
class StepContext:
    """The model's graph plus this step's fixed values (inputs, targets, attributes)."""

    graph: CapturedGraph
    fixed_values: dict[str, Any]
    fixed_ptrs: set[int]
    targets: Any
    loss_fn: Callable

    @cached_property
    def compute_ids(self) -> set[str]:
        return {node.id for node in self.graph.nodes}


def as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(
            f"example inputs are a tensor or a tuple or list of them, not {type(example_inputs).__name__}"
            + (" (convert it with torch.from_numpy)" if type(example_inputs).__module__.startswith("numpy") else "")
        )
    return tuple(example_inputs)


def step_context(graph: CapturedGraph, inputs: tuple, targets, loss_fn) -> StepContext:
    if len(inputs) != len(graph.placeholders):
        raise CaptureError(
            f"the model's forward takes {len(graph.placeholders)} input(s) ({', '.join(graph.placeholders)}), "
            f"but {len(inputs)} example input(s) were given"
        )
    fixed_values = dict(zip(graph.placeholders, inputs))
    fixed_values.update(graph.attributes)
    fixed_ptrs = {storage_ptr(t) for t in graph.model.parameters()}
    fixed_ptrs |= {storage_ptr(t) for t in graph.model.buffers()}
    for value in list(fixed_values.values()) + list(as_tuple(targets) if targets is not None else ()):
        if isinstance(value, torch.Tensor):
            fixed_ptrs.add(storage_ptr(value))
    return StepContext(graph, fixed_values, fixed_ptrs, targets, loss_fn)


def call_loss(loss_fn: Callable, output, targets):
    return loss_fn(output, targets) if targets is not None else loss_fn(output)


def forward_node(ctx: StepContext, node: CapturedNode, store, algorithm: str | None = None) -> tuple[Entry, ForwardRun]:
    """Compute one forward node from the store's values (convolutions with `algorithm`)."""
    args, kwargs, leaves, sources = resolve_args(node.args, node.kwargs, store, ctx.fixed_values, ctx.compute_ids)
    algorithm = algorithm or ("native" if node.is_conv2d else None)
    return run_forward(
        node.id,
        lambda a, k: node.call(a, k, conv_algorithm=algorithm),
        args, kwargs, leaves, sources, node.parameters, ctx.fixed_ptrs, Resolver(store),
    )


def loss_node(ctx: StepContext, store) -> tuple[Entry, ForwardRun]:
    """The loss and its gradient with respect to the model's outputs, as one node."""
    args, _, leaves, sources = resolve_args((ctx.graph.output,), {}, store, ctx.fixed_values, ctx.compute_ids)
    with torch.enable_grad():
        loss = call_loss(ctx.loss_fn, args[0], ctx.targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise CaptureError("the loss function must return a single-element tensor")
        wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
        grads: list = [None] * len(leaves)
        if loss.requires_grad and wanted:
            found = torch.autograd.grad(loss, [leaves[i] for i in wanted], allow_unused=True)
            for i, grad in zip(wanted, found):
                grads[i] = grad
    grads = own_storage(grads, ctx.fixed_ptrs | {storage_ptr(leaf) for leaf in leaves})
    entry = Entry(leaves=[loss.detach()], spec=None, requires_grad=[False], grads=grads)
    run = ForwardRun(LOSS_ID, [], sources, [], [], [])
    return entry, run


def gradient_sources(node_id: str, runs: dict[str, ForwardRun], order: list[str]) -> list[tuple[str, int, int]]:
    """(reader, reader's leaf index, node's leaf index) for every place node_id's value is read."""
    found = []
    for reader in order:
        run = runs.get(reader)
        if run is None:
            continue
        for j, source in enumerate(run.sources):
            if source is not None and source[0] == node_id:
                found.append((reader, j, source[1]))
    return found


def gradient_outputs(node_id: str, entry_leaves: int, readers, grad_entries: dict[str, Entry]) -> tuple[list, list[str]]:
    """Sum the gradient contributions of the node's readers; also say which gradient nodes were read."""
    grads: list = [None] * entry_leaves
    used: list[str] = []
    for reader, j, k in readers:
        gid = LOSS_ID if reader == LOSS_ID else backward_id(reader)
        entry = grad_entries.get(gid)
        if entry is None or entry.grads[j] is None:
            continue
        grad = entry.grads[j]
        grads[k] = grad if grads[k] is None else grads[k] + grad
        if gid not in used:
            used.append(gid)
    return grads, used


def _memory_capacity_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 34


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    processor = platform.processor() or platform.machine()
    return f"CPU {processor} ({torch.get_num_threads()} torch threads)"


def measure_bandwidth_gb_per_s(device: torch.device, size_bytes: int = 64 << 20, repeats: int = 5) -> tuple[float, float]:
    """Device-to-host and host-to-device copy bandwidth with pinned buffers (CUDA only)."""
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    results = []
    for direction in ("d2h", "h2d"):
        times = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if direction == "d2h":
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        results.append(size_bytes / (statistics.median(times[1:]) * 1e6))
    return results[0], results[1]


def cpu_clock(device: torch.device) -> tuple[Callable[[], int], str]:
    """The CPU clock to time with: with one torch thread, that thread's CPU time, which leaves out the time
    spent waiting for a core on a busy machine (all the work runs on the calling thread, autograd's
    backward included); with more threads, wall time (their work is on other threads)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time_ns, "thread_time_ns"
    return time.perf_counter_ns, "perf_counter_ns"


class Timer:
    """Median of repeats after warm-up; CUDA events on a GPU, `cpu_clock` on the CPU."""

    def __init__(self, device: torch.device, repeats: int, warmup: int):
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.clock, self.clock_name = cpu_clock(device)
        self.spreads: list[float] = []
        self.samples: dict[Any, list[float]] = {}

    def once(self, run: Callable[[Any], Any], state: Any) -> float:
        """Milliseconds `run(state)` takes on the device."""
        return self.once_keeping(run, state)[0]

    def once_keeping(self, run: Callable[[Any], Any], state: Any) -> tuple[float, Any]:
        """Milliseconds `run(state)` takes on the device, and what it returned."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            result = run(state)
            end.record()
            end.synchronize()
            return start.elapsed_time(end), result
        begin = self.clock()
        result = run(state)
        return (self.clock() - begin) / 1e6, result

    def record(self, key, pass_index: int, elapsed_ms: float) -> None:
        if pass_index >= self.warmup:
            self.samples.setdefault(key, []).append(elapsed_ms)

    def median(self, key) -> float:
        samples = self.samples[key]
        median = statistics.median(samples)
        if median > 0:
            self.spreads.append(100.0 * (max(samples) - min(samples)) / median)
        return median

    def measure(self, prepare: Callable[[], Any], run: Callable[[Any], Any]) -> float:
        key = object()
        for i in range(self.warmup + self.repeats):
            self.record(key, i, self.once(run, prepare()))
        return self.median(key)


def optimizer_state_bytes(optimizer: str | torch.optim.Optimizer | None, trainable_bytes: int) -> int:
    """Optimizer state as a multiple of the trainable parameters (momentum: 1, Adam: 2)."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, torch.optim.Optimizer):
        name = type(optimizer).__name__.lower()
        momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
    else:
        name = optimizer.lower()
        momentum = name in ("momentum", "sgd-momentum")
    if name in ("adam", "adamw", "nadam", "radam", "adamax"):
        return 2 * trainable_bytes
    if name in ("rmsprop", "adagrad") or momentum:
        return trainable_bytes
    if name in ("sgd", "none"):
        return 0
    raise MososError(f"unknown optimizer {optimizer!r}: say sgd, momentum (or sgd-momentum), adam, adamw, rmsprop or adagrad")


class _Preserved:
    """Restore buffers (BatchNorm statistics), RNG state and gradients after profiling."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device

    def __enter__(self):
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def _first_device(model: nn.Module, inputs: tuple) -> torch.device:
    for tensor in list(model.parameters()) + [t for t in inputs if isinstance(t, torch.Tensor)]:
        return tensor.device
    return torch.device("cpu")


def profile_model(
    model: nn.Module,
    example_inputs,
    loss_fn: Callable,
    targets=None,
    *,
    name: str | None = None,
    optimizer: str | torch.optim.Optimizer | None = "sgd",
    repeats: int = 5,
    warmup: int = 2,
    algorithms: tuple[str, ...] = conv_algorithms.ALGORITHMS,
    d2h_gb_per_s: float | None = None,
    h2d_gb_per_s: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> GraphProfile:
    """Profile one training step of `model` on `example_inputs`: loss = loss_fn(model(*inputs), targets).

    On a GPU, transfer bandwidth is measured with pinned buffers unless given;
    on the CPU it is taken from the arguments or left out (no offloading).
    """
    if repeats < 1 or warmup < 0:
        raise MososError(f"repeats must be at least 1 and warmup at least 0, not {repeats} and {warmup}")
    optimizer_state_bytes(optimizer, 0)  # an unknown optimizer is refused before any work
    inputs = as_tuple(example_inputs)
    device = _first_device(model, inputs)
    graph = capture(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise CaptureError("the model has no trainable parameters: there is no backward pass to plan")
    ctx = step_context(graph, inputs, targets, loss_fn)
    say = progress or (lambda message: None)
    with _Preserved(model, device):
        nodes = _profile(ctx, device, repeats, warmup, algorithms, say)
    if device.type == "cuda" and (d2h_gb_per_s is None or h2d_gb_per_s is None):
        say("measuring PCIe bandwidth with pinned buffers")
        measured_d2h, measured_h2d = measure_bandwidth_gb_per_s(device)
        d2h_gb_per_s = d2h_gb_per_s or measured_d2h
        h2d_gb_per_s = h2d_gb_per_s or measured_h2d
    nodes_doc, spread, overheads = nodes
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    buffer_bytes = distinct_bytes([b for b in model.buffers()])
    attribute_bytes = distinct_bytes(
        [v for v in graph.attributes.values() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)],
        {storage_ptr(b) for b in model.buffers()},
    )
    target_list = [t for t in (as_tuple(targets) if targets is not None else ()) if isinstance(t, torch.Tensor)]
    document = {
        "name": name or f"{type(model).__name__} {tensor_signature(inputs)} on {device.type}",
        "hardware": {
            "name": _device_name(device),
            "memory_capacity_bytes": _memory_capacity_bytes(device),
            "d2h_bandwidth_gb_per_s": d2h_gb_per_s,
            "h2d_bandwidth_gb_per_s": h2d_gb_per_s,
        },
        "fixed_memory": {
            "inputs_bytes": distinct_bytes([t for t in inputs if isinstance(t, torch.Tensor)] + target_list),
            "parameters_bytes": distinct_bytes(params),
            "gradients_bytes": trainable_bytes,
            "optimizer_state_bytes": optimizer_state_bytes(optimizer, trainable_bytes),
            "other_bytes": buffer_bytes + attribute_bytes,
        },
        "nodes": nodes_doc,
        "provenance": {
            "source": "measured",
            "device": _device_name(device),
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "repeats": repeats,
            "spread_percent": round(statistics.median(spread), 3) if spread else 0.0,
            "tool": f"{TOOL}, torch {torch.__version__}",
            "model_structure_sha256": graph.structure_sha256(),
            "input_signature": tensor_signature(inputs),
            "target_signature": tensor_signature(targets) if targets is not None else None,
            "notes": "; ".join(
                [
                    f"warmup={warmup}",
                    "timer=" + ("cuda events" if device.type == "cuda" else cpu_clock(device)[1]),
                    f"torch_threads={torch.get_num_threads()}",
                    *(_in_step_notes(overheads) if overheads["in_step"] else _alone_notes(overheads)),
                    "spread_percent is the median over nodes of (max-min)/median of the repeats",
                    "workspace=" + ("allocator peak" if device.type == "cuda" else "algorithm formula"),
                ]
            ),
        },
    }
    return parse_profile(document, "measured profile")


def _in_step_notes(overheads: dict) -> list[str]:
    """How the times of a CPU profile were taken (each node's share of a real step)."""
    return [
        "native times (the first implementation of every node, as the model itself runs it: torch's "
        "own convolution) are each node's share of a real training step, timed in every pass: forward, "
        "each call on the values the step has just computed; backward, one torch.autograd.grad call over "
        "the whole step as plain PyTorch makes it, a hook after each autograd node stamping the clock "
        "and the time since the previous stamp going to the node whose call created that autograd node "
        "(the engine's start to the loss)",
        "less the timing's own cost, measured in every pass and clamped at 0: "
        f"{overheads['forward_ms'] * 1000:.1f} us per forward call (an identity node timed the same way), "
        f"{overheads['hook_ms'] * 1000:.2f} us per hooked autograd node (a chain of one-element views "
        "with and without hooks)",
        "other convolution algorithms are timed alone (node after node in whole passes, after the "
        "native pass), and their time is their median alone less what native showed alone beyond "
        "its share of the step (the cost of timing one node alone, e.g. one autograd call per "
        f"backward node, {overheads['backward_ms'] * 1000:.1f} us)",
        "node-by-node replay adds its own per-node costs (one autograd call per backward node, the "
        "executor's convolution wrapper) on top of these times",
    ]


def _alone_notes(overheads: dict) -> list[str]:
    """How the times of a GPU profile were taken (each node alone, CUDA events)."""
    return [
        "times are of each operation alone, timed node after node in whole passes (native in a clean pass, "
        "the other convolution algorithms after it), each on the values the node before it has just computed",
        "less the median cost of the timing harness itself (an identity node timed the same way in every pass, "
        f"clamped at 0): forward {overheads['forward_ms'] * 1000:.1f} us, backward {overheads['backward_ms'] * 1000:.1f} us "
        "(one torch.autograd.grad call per backward node, which a plain step makes once; the loss node keeps it)",
    ]


def _workspace_bytes(device, algorithm, geometry, element_size, phase, measure: Callable[[Any], Any],
                     baseline_bytes: int, prepare: Callable[[], Any] = lambda: None) -> int:
    """On a GPU, the allocator's peak while the algorithm runs beyond what it returns; on the CPU, its formula."""
    formula = conv_algorithms.workspace_bytes(algorithm, geometry, element_size, phase)
    if device.type != "cuda":
        return formula
    state = prepare()
    torch.cuda.synchronize(device)
    before = _requested_bytes(device, "current")
    torch.cuda.reset_peak_memory_stats(device)
    result = measure(state)
    torch.cuda.synchronize(device)
    peak = _requested_bytes(device, "peak") - before
    del result, state
    return max(0, peak - baseline_bytes)


def _requested_bytes(device, which: str) -> int:
    """Bytes asked of the caching allocator (its `requested_bytes`: no rounding to 512-byte blocks), where the
    build reports them; else what it allocated."""
    stats = torch.cuda.memory_stats(device)
    key = f"requested_bytes.all.{which}"
    if key in stats:
        return int(stats[key])
    return torch.cuda.memory_allocated(device) if which == "current" else torch.cuda.max_memory_allocated(device)


def _profile(ctx: StepContext, device, repeats, warmup, algorithms, say) -> tuple[list[dict], list[float]]:
    graph = ctx.graph
    order = [node.id for node in graph.nodes]
    store = DictStore()
    runs: dict[str, ForwardRun] = {}
    say(f"reference pass over {len(order)} nodes")
    for node in graph.nodes:  # a first pass warms up kernels and allocators; the second is the reference
        store.entries[node.id], _ = forward_node(ctx, node, store)
    for node in graph.nodes:
        store.entries[node.id], runs[node.id] = forward_node(ctx, node, store)
    store.entries[LOSS_ID], runs[LOSS_ID] = loss_node(ctx, store)
    readers_of = {node_id: gradient_sources(node_id, runs, order + [LOSS_ID]) for node_id in order}
    grad_entries: dict[str, Entry] = {LOSS_ID: store.entries[LOSS_ID]}
    backward_inputs: dict[str, list[str]] = {}
    grad_outputs_of: dict[str, list] = {}
    for node_id in reversed(order):
        run = runs[node_id]
        if not any(root is not None for root in run.roots):
            continue
        grads, used = gradient_outputs(node_id, len(store.entries[node_id].leaves), readers_of[node_id], grad_entries)
        if not used:
            continue
        input_grads, _ = run_backward(run, grads, retain_graph=True)
        foreign = ctx.fixed_ptrs | {storage_ptr(g) for g in grads if g is not None}
        grad_entries[backward_id(node_id)] = Entry(leaves=[], grads=own_storage(input_grads, foreign))
        saved_sources = run.saved_sources()
        forward_reads = [source for source in order if source in saved_sources]
        backward_inputs[node_id] = forward_reads + used
        grad_outputs_of[node_id] = grads

    algorithms_of: dict[str, list] = {}
    geometry_of: dict[str, Any] = {}
    for node in graph.nodes:
        geometry = geometry_of[node.id] = _conv_geometry(ctx, node, store)
        algorithms_of[node.id] = [
            a for a in algorithms if geometry is not None and conv_algorithms.applicable(a, geometry)
        ] or [None]
    timer = Timer(device, repeats, warmup)
    harness = _Harness(device)
    # a node's share of a whole step is read off a host clock, which only a CPU step keeps in time with
    # its work (CUDA kernels run asynchronously): on a GPU every node is timed alone with CUDA events
    in_step = device.type != "cuda"
    # Whole passes, node after node as in a real step (caches as cold or warm as they would be),
    # rather than one node many times in a row.
    for pass_index in range(warmup + repeats):
        harness.calibrate(timer, pass_index)  # in every pass, so under the same load as the nodes
        say(f"timing pass {pass_index + 1}/{warmup + repeats}: a whole step, node by node")
        if in_step:
            _time_in_step(ctx, timer, pass_index)
        say(f"timing pass {pass_index + 1}/{warmup + repeats}: forward")
        # each node reads what the node before it has just computed in this pass, as in a real step
        # (inputs as warm in the caches as they would be), not the reference pass's long-cold tensors
        live = _LiveStore(store)
        # The first implementation of every node (native for convolutions: what plain PyTorch runs) is
        # timed in a clean pass of its own; the other convolution algorithms afterwards, so that their
        # large temporary buffers do not disturb the caches and the allocator of the plain pass.
        for node in graph.nodes:
            algorithm = algorithms_of[node.id][0]
            elapsed, result = timer.once_keeping(
                lambda state, node=node, a=algorithm: _call(node, state, a), _operands(ctx, node, live))
            timer.record((node.id, "forward", algorithm), pass_index, elapsed)
            live.keep(node.id, result)
            del result
        elapsed = timer.once(lambda state: _loss_and_gradient(ctx, state), _operands(ctx, None, live))
        timer.record((LOSS_ID,), pass_index, elapsed)
        del live
        say(f"timing pass {pass_index + 1}/{warmup + repeats}: backward")
        graphs = {
            node.id: _plain_graph(ctx, node, store, algorithms_of[node.id][0], grad_outputs_of[node.id])
            for node in graph.nodes if node.id in backward_inputs
        }
        alternatives = []
        for node in reversed(graph.nodes):
            if node.id not in graphs:
                continue
            outputs, targets, gradients = graphs.pop(node.id)
            timer.record((node.id, "backward", algorithms_of[node.id][0]), pass_index,
                         timer.once(_timed_backward(algorithms_of[node.id][0], outputs, targets, gradients), None))
            if len(algorithms_of[node.id]) > 1:
                alternatives.append((node, outputs, targets, gradients))
            del outputs, targets, gradients
        say(f"timing pass {pass_index + 1}/{warmup + repeats}: other convolution algorithms")
        for node, outputs, targets, gradients in alternatives:
            for algorithm in algorithms_of[node.id][1:]:
                timer.record((node.id, "backward", algorithm), pass_index,
                             timer.once(_timed_backward(algorithm, outputs, targets, gradients), None))
        del alternatives
        for node in graph.nodes:
            for algorithm in algorithms_of[node.id][1:]:
                elapsed = timer.once(lambda state, node=node, a=algorithm: _call(node, state, a), _operands(ctx, node, store))
                timer.record((node.id, "forward", algorithm), pass_index, elapsed)

    forward_overhead_ms, backward_overhead_ms = harness.overheads_ms(timer)
    hook_overhead_ms = harness.hook_overhead_ms(timer)
    captured = graph.node_by_id

    def in_step_ms(node_id: str, phase: str) -> float:
        if phase == "forward":
            return max(0.0, timer.median(("step", node_id, phase)) - forward_overhead_ms)
        hooks = statistics.median(timer.samples[("step-hooks", node_id)])
        return max(0.0, timer.median(("step", node_id, phase)) - hooks * hook_overhead_ms)

    def corrected(key, overhead_ms: float) -> float:
        """The first implementation (native): its time in the whole step. Another one: its time alone,
        less the cost of being alone (what the first implementation shows alone beyond its time in the step)."""
        node_id, phase, algorithm = key
        plain = "native" if captured[node_id].is_conv2d else None  # what the step ran
        alone = timer.median(key) - overhead_ms  # its spread counts, whichever time is kept
        if not in_step:
            return max(0.0, alone)
        if algorithm == plain:
            return in_step_ms(node_id, phase)
        if plain in algorithms_of[node_id]:
            native_alone = timer.median((node_id, phase, plain)) - overhead_ms
            return max(0.0, alone - (native_alone - in_step_ms(node_id, phase)))
        return max(0.0, alone)

    docs: list[dict] = []
    bwd_docs: list[dict] = []
    for index, node in enumerate(graph.nodes):
        entry = store.entries[node.id]
        output_bytes = distinct_bytes([t for t in entry.leaves if isinstance(t, torch.Tensor)], ctx.fixed_ptrs)
        extra_bytes = distinct_bytes(entry.extras, ctx.fixed_ptrs)
        geometry = geometry_of[node.id]
        names = algorithms_of[node.id]
        implementations = []
        for algorithm in names:
            time_ms = corrected((node.id, "forward", algorithm), forward_overhead_ms)
            workspace = 0
            if algorithm is not None:
                workspace = _workspace_bytes(
                    device, algorithm, geometry, entry.leaves[0].element_size(), "forward",
                    lambda state, a=algorithm: _call(node, state, a), output_bytes,
                    prepare=lambda: _operands(ctx, node, store),
                )
            implementations.append({"name": algorithm or "default", "time_ms": time_ms, "workspace_bytes": workspace})
        docs.append(
            {
                "id": node.id,
                "name": node.module_path or node.id,
                "kind": "forward",
                "op_type": node.op_type,
                "output_bytes": output_bytes,
                "extra_saved_bytes": extra_bytes,
                "module": node.module_path,
                "inputs": list(node.inputs),
                "implementations": implementations,
            }
        )
        if node.id not in backward_inputs:
            continue
        grads = grad_outputs_of[node.id]
        bwd_entry = grad_entries[backward_id(node.id)]
        bwd_implementations = []
        for algorithm in names:
            time_ms = corrected((node.id, "backward", algorithm), backward_overhead_ms)
            workspace = 0
            if algorithm is not None:
                def backward_once(state, a=algorithm):
                    outputs, targets, gradients = state
                    with conv_algorithms.backward_algorithm(a):
                        return torch.autograd.grad(outputs, targets, gradients, allow_unused=True)

                workspace = _workspace_bytes(
                    device, algorithm, geometry, entry.leaves[0].element_size(), "backward", backward_once,
                    distinct_bytes([g for g in bwd_entry.grads if g is not None]) + _parameter_bytes(node),
                    prepare=lambda node=node, grads=grads: _plain_graph(ctx, node, store, "native", grads),
                )
            bwd_implementations.append({"name": algorithm or "default", "time_ms": time_ms, "workspace_bytes": workspace})
        reads_forward = any(not source.endswith(":bwd") for source in backward_inputs[node.id])
        bwd_docs.append(
            {
                "id": backward_id(node.id),
                "name": f"{node.module_path or node.id} (backward)",
                "kind": "backward",
                "op_type": f"{node.op_type}Backward",
                "output_bytes": distinct_bytes([g for g in bwd_entry.grads if g is not None], ctx.fixed_ptrs),
                "module": node.module_path,
                "forward_node": node.id if reads_forward else None,
                "inputs": backward_inputs[node.id],
                "implementations": bwd_implementations,
            }
        )
    loss_entry = store.entries[LOSS_ID]
    # the loss node keeps the engine's start: a plain step starts it once, and this is where
    timer.median((LOSS_ID,))
    loss_time = (in_step_ms(LOSS_ID, "forward") + in_step_ms(LOSS_ID, "backward") if in_step
                 else max(0.0, timer.median((LOSS_ID,)) - forward_overhead_ms))
    loss_doc = {
        "id": LOSS_ID,
        "name": "loss",
        "kind": "loss",
        "op_type": getattr(ctx.loss_fn, "__name__", type(ctx.loss_fn).__name__),
        "output_bytes": distinct_bytes(loss_entry.tensors(), ctx.fixed_ptrs),
        "inputs": graph.output_ids(),
        "implementations": [{"name": "default", "time_ms": loss_time, "workspace_bytes": 0}],
    }
    overheads = {"forward_ms": forward_overhead_ms, "backward_ms": backward_overhead_ms, "hook_ms": hook_overhead_ms,
                 "in_step": in_step}
    return docs + [loss_doc] + list(reversed(bwd_docs)), timer.spreads, overheads


class _LiveStore:
    """The values of the pass being timed, falling back on the reference pass's for nodes not yet run."""

    def __init__(self, reference: DictStore):
        self.reference, self.entries = reference, {}

    def keep(self, node_id: str, value) -> None:
        leaves, spec = tree_flatten(value)
        reference = self.reference.entry(node_id)
        self.entries[node_id] = Entry(
            leaves=[t.detach() if isinstance(t, torch.Tensor) else t for t in leaves],
            spec=spec, requires_grad=reference.requires_grad,
        )

    def entry(self, node_id: str) -> Entry:
        return self.entries.get(node_id) or self.reference.entry(node_id)


def _discard(_) -> None:
    """What a timing hook returns: nothing (the gradients stay as they are)."""


def _new_grad_fns(values, owned: dict) -> list:
    """The autograd nodes a call has just created: reachable from its outputs, not owned by an earlier call."""
    found, stack = [], [t.grad_fn for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in owned or type(fn).__name__ == "AccumulateGrad":
            continue
        owned[fn] = None
        found.append(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def _plain_call(node: CapturedNode, state):
    """A node as the model itself runs it (a convolution by its module: torch's own, i.e. native)."""
    args, kwargs, _ = state
    with torch.enable_grad():
        return node.call(args, kwargs)


def _time_in_step(ctx: StepContext, timer: Timer, pass_index: int) -> None:
    """One real training step (forward, loss, one backward call), each node's share timed where it runs.

    Forward: each node's call, on the values the step has just computed. Backward: autograd runs the
    whole step's graph as plain PyTorch does, and a hook after each autograd node it executes stamps
    the clock: the time since the previous stamp belongs to the node whose call created that autograd
    node (the engine's own work between nodes included, as a plain step pays it).
    """
    values = dict(ctx.fixed_values)
    owner: dict = {}
    hooks: dict[str, int] = {}

    def resolve(item):
        return values[item.name] if isinstance(item, Ref) else item

    for node in ctx.graph.nodes:
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), resolve)
        elapsed, values[node.id] = timer.once_keeping(
            lambda state, node=node: _plain_call(node, state), (args, kwargs, []))
        timer.record(("step", node.id, "forward"), pass_index, elapsed)
        created = _new_grad_fns(values[node.id], owner)
        owner.update({fn: node.id for fn in created})
        hooks[node.id] = len(created)
    output = fx.node.map_aggregate(ctx.graph.output, resolve)
    elapsed, loss = timer.once_keeping(lambda _: call_loss(ctx.loss_fn, output, ctx.targets), None)
    timer.record(("step", LOSS_ID, "forward"), pass_index, elapsed)
    created = _new_grad_fns(loss, owner)
    owner.update({fn: LOSS_ID for fn in created})
    hooks[LOSS_ID] = len(created)
    parameters = [p for p in ctx.graph.model.parameters() if p.requires_grad]
    spent = {node_id: 0 for node_id in hooks}
    clock = [0]

    def stamp(node_id) -> None:
        now = timer.clock()
        spent[node_id] += now - clock[0]
        clock[0] = now

    handles = [fn.register_hook(lambda grad_inputs, grad_outputs, node_id=node_id: stamp(node_id))
               for fn, node_id in owner.items()]
    if loss.requires_grad and parameters:
        with conv_algorithms.backward_algorithm(None):
            clock[0] = timer.clock()
            grads = torch.autograd.grad(loss, parameters, allow_unused=True)
        del grads
    for handle in handles:
        handle.remove()
    for node_id, elapsed_ns in spent.items():
        timer.record(("step", node_id, "backward"), pass_index, elapsed_ns / 1e6)
        timer.record(("step-hooks", node_id), pass_index, hooks[node_id])
    del values, loss, output, owner


def _timed_backward(algorithm: str | None, outputs, targets, gradients) -> Callable[[Any], Any]:
    """One node's backward as timed: the graph is kept, so it can be timed again (another algorithm)."""

    def backward(_):
        with conv_algorithms.backward_algorithm(algorithm):
            return torch.autograd.grad(outputs, targets, gradients, retain_graph=True, allow_unused=True)

    return backward


def _identity(tensor):
    return tensor


def _alias(tensor):
    return tensor.view_as(tensor)


class _Harness:
    """What timing one node costs beyond its work: an identity node timed through the same path.

    Forward: a node that returns its input, called as `_call` calls every node. Backward: a one-element
    view (its backward is a reshape) differentiated by the same `torch.autograd.grad` call every
    backward node is timed with; that call's fixed cost (building and running a graph task) is paid
    once per step by plain PyTorch, but once per node when nodes are timed one at a time.
    """

    CALLS_PER_PASS = 5

    def __init__(self, device: torch.device):
        self.device = device
        self.forward_node = CapturedNode("<identity>", "call_function", _identity, "identity", None, (None,), {}, [])
        self.backward_node = CapturedNode("<alias>", "call_function", _alias, "alias", None, (None,), {}, [])
        self.leaf = torch.ones(1, device=device, requires_grad=True)
        self.gradient = torch.ones(1, device=device)

    def calibrate(self, timer: Timer, pass_index: int) -> None:
        for _ in range(self.CALLS_PER_PASS):
            operands = ((self.leaf.detach().requires_grad_(),), {}, [])
            elapsed = timer.once(lambda state: _call(self.forward_node, state, None), operands)
            timer.record(("<harness>", "forward"), pass_index, elapsed)
            leaf = self.leaf.detach().requires_grad_()
            outputs = [_call(self.backward_node, ((leaf,), {}, [leaf]), None)]

            backward = _timed_backward(None, outputs, [leaf], [self.gradient])
            timer.record(("<harness>", "backward"), pass_index, timer.once(backward, None))
        self.calibrate_hooks(timer, pass_index)

    HOOK_CHAIN = 32

    def calibrate_hooks(self, timer: Timer, pass_index: int) -> None:
        """A chain of one-element views differentiated with and without a hook on each: the hooks' cost."""
        for hooked in (False, True):
            leaf = self.leaf.detach().requires_grad_()
            value, fns = leaf, []
            for _ in range(self.HOOK_CHAIN):
                value = value.view_as(value)
                fns.append(value.grad_fn)
            handles = [fn.register_hook(lambda gi, go: _discard(timer.clock())) for fn in fns] if hooked else []
            backward = _timed_backward(None, [value], [leaf], [self.gradient])
            timer.record(("<harness>", "chain", hooked), pass_index, timer.once(backward, None))
            for handle in handles:
                handle.remove()

    def hook_overhead_ms(self, timer: Timer) -> float:
        """What one timing hook adds to a backward node in the whole step."""
        hooked, bare = (statistics.median(timer.samples[("<harness>", "chain", flag)]) for flag in (True, False))
        return max(0.0, (hooked - bare) / self.HOOK_CHAIN)

    def overheads_ms(self, timer: Timer) -> tuple[float, float]:
        """Median forward and backward harness cost (not counted in the spread, which is the nodes')."""
        return tuple(statistics.median(timer.samples[("<harness>", phase)]) for phase in ("forward", "backward"))


# Timing measures the operation itself (as plain PyTorch runs it), not the executor's bookkeeping:
# operands are prepared outside the timed region, and no saved-tensor hooks are installed.


def _parameter_bytes(node: CapturedNode) -> int:
    return sum(p.numel() * p.element_size() for p in node.parameters if p.requires_grad)


def _operands(ctx: StepContext, node: CapturedNode | None, store):
    if node is None:
        args, _, leaves, _ = resolve_args((ctx.graph.output,), {}, store, ctx.fixed_values, ctx.compute_ids)
        return args, {}, leaves
    args, kwargs, leaves, _ = resolve_args(node.args, node.kwargs, store, ctx.fixed_values, ctx.compute_ids)
    return args, kwargs, leaves


def _call(node: CapturedNode, state, algorithm: str | None):
    args, kwargs, _ = state
    algorithm = algorithm or ("native" if node.is_conv2d else None)
    with torch.enable_grad():
        return node.call(args, kwargs, conv_algorithm=algorithm)


def _loss_and_gradient(ctx: StepContext, state):
    args, _, leaves = state
    with torch.enable_grad():
        loss = call_loss(ctx.loss_fn, args[0], ctx.targets)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        return torch.autograd.grad(loss, wanted, allow_unused=True) if wanted and loss.requires_grad else loss


def _plain_graph(ctx: StepContext, node: CapturedNode, store, algorithm: str | None, grads: list):
    """A fresh forward of one node without hooks: (outputs, differentiable inputs, output gradients)."""
    state = _operands(ctx, node, store)
    out_leaves = tree_flatten(_call(node, state, algorithm))[0]
    pairs = [(o, g) for o, g in zip(out_leaves, grads)
             if isinstance(o, torch.Tensor) and o.grad_fn is not None and g is not None]
    targets = [leaf for leaf in state[2] if leaf.requires_grad] + [p for p in node.parameters if p.requires_grad]
    return [o for o, _ in pairs], targets, [g for _, g in pairs]


def _conv_geometry(ctx: StepContext, node: CapturedNode, store) -> conv_algorithms.ConvGeometry | None:
    if not node.is_conv2d:
        return None
    source = node.args[0]
    if isinstance(source, torch.Tensor):
        shape = source.shape
    elif source.name in ctx.compute_ids:
        shape = store.entry(source.name).leaves[0].shape
    else:
        shape = ctx.fixed_values[source.name].shape
    m = node.module
    return conv_algorithms.ConvGeometry.of(shape, m.weight.shape, m.stride, m.padding, m.dilation, m.groups)


def plain_step_time_ms(model: nn.Module, example_inputs, loss_fn: Callable, targets=None, *,
                       repeats: int = 5, warmup: int = 2) -> float:
    """Median time of one plain PyTorch step (forward, loss, backward): what a profile's node times should add up to."""
    inputs = as_tuple(example_inputs)
    device = _first_device(model, inputs)
    timer = Timer(device, repeats, warmup)
    parameters = [p for p in model.parameters() if p.requires_grad]

    def step(_):
        loss = call_loss(loss_fn, model(*inputs), targets)
        return torch.autograd.grad(loss, parameters)  # leaves .grad alone

    with _Preserved(model, device):
        return timer.measure(lambda: None, step)


def plain_equivalent_time_ms(profile: GraphProfile) -> float:
    """Sum of node times with the implementations plain PyTorch uses (native convolutions)."""
    total = 0.0
    for node in profile.nodes:
        names = {impl.name: impl for impl in node.implementations}
        total += (names.get("native") or names.get("default") or node.fastest).time_ms
    return total

"""Measure a real model into a GraphProfile: its planning nodes, their sizes, times, workspaces and algorithms.

The model and its loss are captured as one joint ATen graph (executor.capture.capture),
grouped into planning nodes (executor.capture.planning_graph), and the keep-all step
is generated as code (executor.engine.codegen) and run whole, pass after pass:

- times: each planning node's share of a real training step: the clock around
  the node's code in the generated keep-all step (the calling thread's CPU time
  when torch runs one thread on the CPU, else wall time; CUDA events on a GPU),
  less the cost of reading the clock (measured on an empty node in every
  pass), median of the passes after warm-up. Each convolution algorithm other
  than native gets passes of its own, every convolution set to it.
- workspace: what a node allocates beyond what it keeps (its outputs and any
  parameter gradients) while it runs, from the allocator: on the CPU,
  torch.profiler's memory events (every c10 CPU allocation and free, with
  `profile_memory=True`) inside a record_function scope around each node; on a
  GPU, the caching allocator's requested bytes, current and peak. The peak of
  the running total inside the node, less what the node still holds at its
  end.

The model's parameters, buffers, gradients and the RNG are left as they were.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from executor.capture import autocast
from executor.capture.capture import CapturedStep, _first_line, capture, tensor_signature
from executor.capture.feeds import Feeder
from executor.capture.planning_graph import (
    PlanningGraph,
    accumulation_bytes,
    build,
    node_sizes,
    reference_run,
    transient_peak_bytes,
)
from executor.engine import conv_algorithms
from executor.engine.codegen import CodeGenerator, Modes, schedule_operations
from executor.engine.compiled_nodes import EAGER, CompiledNodes, NodeCompiler
from executor.engine.runtime import TimedStepRuntime, obeys_layout
from executor.errors import CaptureError
from executor.measure.allocations import cpu_workspace_bytes, memory_events
from executor.measure.convolution_scratch import (
    batch_split_scratch_bytes,
    convolution_geometry,
    convolution_input,
    covering_blocked_filter_gradient,
    native_scratch_bound_bytes,
    probe_native_scratch,
    splits_the_batch,
    sums_over_the_batch,
    unprobed_for_room,
)
from executor.measure.measuring import (
    MODES,
    MeasuringPlan,
    measuring_schedule,
    scratch_allowance_bytes,
    substituted,
    with_implementations,
)
from executor.measure.optimizer_step import constructor_defaults, held_state, optimizer_step_bytes, state_bytes
from planner.budget import minimum_budget_bytes
from planner.errors import BudgetError, MososError
from planner.profile import FixedMemory, GraphProfile, parse_profile
from planner.schedule import Schedule
from planner.simulator import simulate
from planner.units import MAX_SIZE_BYTES, format_bytes

TOOL = "mosos executor.measure.profiler 0.2 (torch.export joint graph)"


def as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(
            f"example inputs are a tensor or a tuple or list of them, not {type(example_inputs).__name__}"
            + (" (convert it with torch.from_numpy)" if type(example_inputs).__module__.startswith("numpy") else "")
        )
    return tuple(example_inputs)


def call_loss(loss_fn: Callable, output, targets):
    return loss_fn(output, targets) if targets is not None else loss_fn(output)


# --- the machine ---------------------------------------------------------------------------------------


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
    spent waiting for a core on a busy machine (all the work runs on the calling thread); with more threads,
    wall time (their work is on other threads)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time_ns, "thread_time_ns"
    return time.perf_counter_ns, "perf_counter_ns"


# Optimizer state per parameter, by kind (`optimize(optimizer=...)`, or an optimizer's class name in lower case).
STATE_PER_PARAMETER = {"sgd": 0, "none": 0, "momentum": 1, "sgd-momentum": 1, "rmsprop": 1, "adagrad": 1,
                       "adam": 2, "adamw": 2, "nadam": 2, "radam": 2, "adamax": 2}


def check_optimizer_argument(optimizer) -> None:
    """`optimizer=` is an optimizer, a kind as a word or None: its class, or anything else, is refused saying so."""
    if optimizer is None or isinstance(optimizer, (str, torch.optim.Optimizer)):
        return
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        raise MososError(f"optimizer is the optimizer itself (optimize(..., optimizer=opt), opt = "
                         f"{optimizer.__name__}(model.parameters(), ...)) or its kind as a word "
                         f"({optimizer.__name__.lower()!r}), not the class {optimizer.__name__}")
    raise MososError(f"optimizer is a torch.optim.Optimizer, a kind as a word or None, not "
                     f"{type(optimizer).__name__} {optimizer!r}")


def optimizer_state_bytes(optimizer: str | torch.optim.Optimizer | None, trainable_bytes: int) -> int:
    """Optimizer state as a multiple of the trainable parameters (momentum: 1, Adam: 2)."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, torch.optim.Optimizer):
        name = type(optimizer).__name__.lower()
        momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
        if any(group.get("amsgrad", False) for group in optimizer.param_groups):
            return 3 * trainable_bytes  # Adam's two moments and the running maximum of the second
    else:
        check_optimizer_argument(optimizer)
        name = optimizer.lower()
        momentum = False
    multiple = STATE_PER_PARAMETER.get(name)
    if momentum and not multiple:
        multiple = 1  # a momentum buffer per parameter (SGD's, or a kind we do not know that has one)
    if multiple is not None:
        return multiple * trainable_bytes
    if isinstance(optimizer, torch.optim.Optimizer):
        return math.ceil(_probed_state_per_parameter_byte(optimizer) * trainable_bytes)
    raise MososError(f"unknown optimizer {optimizer!r}: say {', '.join(sorted(STATE_PER_PARAMETER))}, or, from "
                     "Python, pass the optimizer itself (optimize(..., optimizer=opt)), whose state is then measured")


def _probed_state_per_parameter_byte(optimizer: torch.optim.Optimizer) -> float:
    """State bytes per parameter byte of an optimizer of a kind not listed (Adadelta, Rprop, a library's own):
    one step of a fresh one of its class, with its defaults, on a small matrix parameter. A factored state (one
    that keeps rows and columns apart) is counted as if it were not, which only over-counts."""
    probe_parameter = nn.Parameter(torch.zeros(8, 8))
    try:
        probe = type(optimizer)([probe_parameter], **constructor_defaults(type(optimizer), optimizer.defaults))
        probe_parameter.grad = torch.full_like(probe_parameter, 1e-3)
        probe.step()
    except Exception as error:  # noqa: BLE001 - whatever its constructor or step needs that we cannot give
        raise MososError(f"cannot tell how much state {type(optimizer).__name__} keeps (a step of a fresh one on "
                         f"a probe parameter failed: {type(error).__name__}: {error}); pass optimizer= the kind "
                         "whose state it matches: sgd (none), momentum (1x the parameters), adam (2x)") from None
    state = [value for value in probe.state.get(probe_parameter, {}).values()
             if isinstance(value, torch.Tensor) and value.dim() > 0]
    parameter_bytes = probe_parameter.numel() * probe_parameter.element_size()
    return sum(value.numel() * value.element_size() for value in state) / parameter_bytes


class _Preserved:
    """Restore buffers (BatchNorm statistics), RNG state and gradients after profiling."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device

    def __enter__(self):
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.grads = [(p, p.grad) for p in self.model.parameters()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        for parameter, grad in self.grads:
            parameter.grad = grad
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def preserved(model: nn.Module) -> _Preserved:
    return _Preserved(model, next((p.device for p in model.parameters()), torch.device("cpu")))


def _first_device(model: nn.Module, leaves: list) -> torch.device:
    for tensor in list(model.parameters()) + [t for t in leaves if isinstance(t, torch.Tensor)]:
        return tensor.device
    return torch.device("cpu")


# --- what a profile is made of -------------------------------------------------------------------------


@dataclass
class ProfiledStep:
    """A capture and its planning graph: what PlannedModule needs, so `optimize()` does not capture twice."""

    step: CapturedStep
    planning: PlanningGraph
    feeder: Feeder
    measuring: MeasuringPlan | None = None  # the schedule the profile was measured under
    compiled: CompiledNodes | None = None  # the nodes the profile measured as Inductor kernels (compile=True)
    convolution_scratch: dict[int, int] | None = None  # native convolutions' scratch bounds, probed (CPU)
    provisional: GraphProfile | None = None  # the upper estimates the measuring passes were planned on


def plan_step(model: nn.Module, inputs: tuple, kwargs: dict | None, targets, loss_fn: Callable,
              autocast_state: tuple | None = None, loss_split: bool = False) -> ProfiledStep:
    """Capture the step (under `autocast_state`, default the autocast in force) and group it into planning nodes
    (no arithmetic: shapes come from fake tensors)."""
    step = capture(model, inputs, kwargs, targets, loss_fn, autocast_state, loss_split=loss_split)
    return planning_of(step, inputs, kwargs, targets)


def planning_of(step: CapturedStep, inputs: tuple, kwargs: dict | None, targets) -> ProfiledStep:
    """Group a captured (or a cached) step into planning nodes."""
    feeder = Feeder(step)
    leaves = tree_flatten(((tuple(inputs), dict(kwargs or {}), targets), {}))[0]
    values = feeder.feed(leaves)
    if feeder.tangent_index is not None:
        loss_meta = step.loss.meta["val"]
        values[feeder.tangent_index] = torch.ones(loss_meta.shape, dtype=loss_meta.dtype, device=loss_meta.device)
    facts = reference_run(step, feeder.by_node(values))
    return ProfiledStep(step, build(step, facts), feeder)


def implementations_of(planning: PlanningGraph, algorithms: tuple[str, ...]) -> list[list[str]]:
    """Per planning node: the names of the implementations it can run (native first for a convolution)."""
    names = []
    for group in planning.groups:
        geometry = convolution_geometry(group)
        if group.convolution is None:
            names.append(["default"])
        elif geometry is None:
            names.append(["native"])
        else:
            # batch-split only where it is not native's very call (a filter gradient alone is), batch-split-sum
            # only where it is not batch-split's (a forward or an input gradient alone is)
            names.append(["native"] + [a for a in algorithms
                                       if a != "native" and conv_algorithms.applicable(a, geometry)
                                       and (a != "batch-split" or splits_the_batch(group))
                                       and (a != "batch-split-sum" or sums_over_the_batch(group))])
    return names


class _ProfilingRuntime(TimedStepRuntime):
    """The runtime of the profiler's passes: the timed steps' clock (a recomputed node: the mean of its runs) and an
    allocator watch around every node; gradients go to a sink (a parameter's .grad is left alone) the way they
    would go to an empty .grad."""

    def __init__(self, device, staging, node_ids, parameters, clock):
        super().__init__(device, staging, node_ids, clock)
        self.parameters = parameters
        self.sink: dict[int, torch.Tensor] = {}
        self.scopes: dict[int, object] = {}
        self.memory: dict[int, tuple[int, int]] = {}  # CUDA: node -> (peak rise, held at the end)
        self.memory_start = 0
        self.sizes: dict[int, int] = {}

    def computed(self, group: int, implementation: str, tensors: tuple) -> None:
        """The real bytes of what the node keeps (kernels may return views of larger buffers than meta shapes say)."""
        self.sizes[group] = distinct_storage_bytes(tensors)

    def gradient(self, index: int, value: torch.Tensor) -> None:
        parameter = self.parameters[index]
        if not obeys_layout(value, parameter):
            value = torch.empty_strided(parameter.shape, parameter.stride(), dtype=parameter.dtype,
                                        device=parameter.device).copy_(value)
        self.sink[index] = value

    def memory_begin(self, group: int) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.memory_start = _requested_bytes(self.device, "current")
        else:
            scope = torch.autograd.profiler.record_function(f"mosos-node:{group}")
            scope.__enter__()
            self.scopes[group] = scope

    def memory_end(self, group: int) -> None:
        if self.cuda:
            peak = _requested_bytes(self.device, "peak") - self.memory_start
            held = _requested_bytes(self.device, "current") - self.memory_start
            self.memory[group] = (peak, held)
        else:
            self.scopes.pop(group).__exit__(None, None, None)


def _requested_bytes(device, which: str) -> int:
    """Bytes asked of the caching allocator (its `requested_bytes`: no rounding to 512-byte blocks), where the
    build reports them; else what it allocated."""
    stats = torch.cuda.memory_stats(device)
    key = f"requested_bytes.all.{which}"
    if key in stats:
        return int(stats[key])
    return torch.cuda.memory_allocated(device) if which == "current" else torch.cuda.max_memory_allocated(device)


# --- profile_model ---------------------------------------------------------------------------------------


def profile_model(
    model: nn.Module,
    example_inputs,
    loss_fn: Callable,
    targets=None,
    *,
    kwargs: dict | None = None,
    name: str | None = None,
    optimizer: str | torch.optim.Optimizer | None = "sgd",
    repeats: int = 5,
    warmup: int = 2,
    algorithms: tuple[str, ...] = conv_algorithms.ALGORITHMS,
    d2h_gb_per_s: float | None = None,
    h2d_gb_per_s: float | None = None,
    budget_bytes: int | None = None,
    measuring: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> GraphProfile:
    """Profile one training step of `model`: loss = loss_fn(model(*inputs, **kwargs), targets)."""
    return profile_step(model, example_inputs, loss_fn, targets, kwargs=kwargs, name=name, optimizer=optimizer,
                        repeats=repeats, warmup=warmup, algorithms=algorithms, d2h_gb_per_s=d2h_gb_per_s,
                        h2d_gb_per_s=h2d_gb_per_s, budget_bytes=budget_bytes, measuring=measuring,
                        progress=progress)[0]


def _hardware(device, d2h_gb_per_s, h2d_gb_per_s) -> dict:
    return {
        "name": _device_name(device),
        "memory_capacity_bytes": _memory_capacity_bytes(device),
        "d2h_bandwidth_gb_per_s": d2h_gb_per_s,
        "h2d_bandwidth_gb_per_s": h2d_gb_per_s,
    }


def _node_document(planning: PlanningGraph, group, implementations: list[dict], kept_bytes: int) -> dict:
    """One node of the profile; `kept_bytes`: the distinct storages of what it hands on, as measured (a kernel may
    keep more than its shape says: a view of a larger buffer), split as the fake run splits them."""
    groups = planning.groups
    output_bytes, _ = node_sizes(planning, group)
    output_bytes = min(output_bytes, kept_bytes)
    document = {
        "id": group.id,
        "name": group.id,
        "kind": group.kind,
        "op_type": group.op_type,
        "output_bytes": output_bytes,
        "extra_saved_bytes": kept_bytes - output_bytes,
        "module": group.module,
        "inputs": [groups[i].id for i in group.inputs],
        "implementations": implementations,
    }
    if group.forward_node is not None:
        document["forward_node"] = groups[group.forward_node].id
    if group.random:
        document["draws_random"] = True  # so no plan draws in another order than the step (replay._check_random_order)
    return document


# Rough rates for the provisional profile's times: they only steer the choice of a measuring schedule.
_PROVISIONAL_BYTES_PER_MS = 1e7  # 10 GB/s
_PROVISIONAL_NODE_MS = 0.005


def provisional_profile(profiled: ProfiledStep, leaves: list, device, optimizer, algorithms, d2h_gb_per_s,
                        h2d_gb_per_s, name: str | None = None, budget_bytes: int | None = None,
                        progress: Callable[[str], None] | None = None) -> GraphProfile:
    """The profile as far as the capture knows it, before the step runs: exact sizes from the fake run, workspaces
    from above (transient intermediates, a kernel's scratch, a convolution's columns; a native convolution's
    scratch probed on smaller calls where that fits `budget_bytes`), times from bytes moved."""
    planning, step = profiled.planning, profiled.step
    names = implementations_of(planning, algorithms)
    loss = step.loss.meta["val"]
    fixed = fixed_memory(profiled, leaves, optimizer, loss.untyped_storage().nbytes())
    if profiled.convolution_scratch is None:
        # beside what is resident all step: the optimizer step's temporaries come at its end, not while probing
        # (counted here, they kept the largest probes 64 bytes short of the budget the error named for them)
        room = None if budget_bytes is None else budget_bytes - FixedMemory.model_validate(fixed).total_bytes
        started = time.perf_counter()
        profiled.convolution_scratch = probe_native_scratch(planning, device, room)
        if profiled.convolution_scratch and progress is not None:
            progress(f"probed the scratch of {len(profiled.convolution_scratch)} native convolutions on smaller calls "
                     f"in {time.perf_counter() - started:.1f} s")
    nodes = []
    for group in planning.groups:
        transient = transient_peak_bytes(planning, group) + accumulation_bytes(planning, group)
        allowance = scratch_allowance_bytes(planning, group)
        touched = sum(planning.facts.root_bytes.get(v, 0) for v in group.outputs) + sum(
            planning.size_bytes(planning.groups[i]) for i in group.inputs)
        time_ms = _PROVISIONAL_NODE_MS + touched / _PROVISIONAL_BYTES_PER_MS
        geometry = convolution_geometry(group)
        element_size = convolution_input(group).meta["val"].element_size() if geometry is not None else 4
        phase = "forward" if group.kind == "forward" else "backward"
        implementations = []
        for implementation in names[group.index]:
            workspace = transient + allowance
            if geometry is not None and implementation == "native" and group.index in profiled.convolution_scratch:
                # the probe measured everything the call allocates beyond its result: no allowance for it on top,
                # and it is held while the convolution runs, not beside what the node makes after it
                held = transient_peak_bytes(planning, group,
                                            scratch_at={group.convolution: profiled.convolution_scratch[group.index]})
                workspace = (held + accumulation_bytes(planning, group)
                             + scratch_allowance_bytes(planning, group, measured=(group.convolution,)))
            elif group.convolution is not None and implementation == "native":
                workspace += native_scratch_bound_bytes(group)
            elif geometry is not None and implementation in conv_algorithms.BATCH_SPLITS:
                # its parts' results (and the whole one beside them), and native's scratch for what it calls
                workspace += (2 * conv_algorithms.workspace_bytes(implementation, geometry, element_size, phase)
                              + batch_split_scratch_bytes(group, implementation, element_size,
                                                          profiled.convolution_scratch.get(group.index)))
            elif geometry is not None:
                # the formula counts the columns and products; the unfold's and the matmul's own copies come on top
                # (measured on the CPU up to 1.8 x the formula, ResNet-18 small at batch 8 and 256, the zoo's CNNs)
                workspace += 2 * conv_algorithms.workspace_bytes(implementation, geometry, element_size, phase) \
                    + (64 << 10) + (covering_blocked_filter_gradient(0, group, channels_last=True)
                                    if implementation == "channels-last" else 0)
            # native first: it is what the measuring pass runs wherever it fits, so keep-all must pick it
            implementations.append({"name": implementation, "workspace_bytes": workspace,
                                    "time_ms": time_ms if implementation in ("native", "default") else 2 * time_ms})
        nodes.append(_node_document(planning, group, implementations, planning.size_bytes(group)))
    probed = len(profiled.convolution_scratch)
    document = {
        "name": (name or f"{type(step.model).__name__} {step.input_signature}") + " (provisional: not measured)",
        "hardware": _hardware(device, d2h_gb_per_s, h2d_gb_per_s),
        "fixed_memory": fixed,
        "nodes": nodes,
        "provenance": {
            "source": "estimated",
            "tool": f"{TOOL}, provisional profile from the capture's fake-tensor run",
            "model_structure_sha256": step.structure_sha256(),
            "input_signature": step.input_signature,
            "target_signature": step.target_signature,
            "notes": "sizes from the fake run; workspaces from above"
                     + (f" ({probed} native convolutions' scratch probed on smaller calls)" if probed else "")
                     + "; times from bytes moved (only to choose how to measure)",
        },
    }
    return parse_profile(document, "provisional profile")


def profile_step(
    model: nn.Module,
    example_inputs,
    loss_fn: Callable,
    targets=None,
    *,
    kwargs: dict | None = None,
    name: str | None = None,
    optimizer: str | torch.optim.Optimizer | None = "sgd",
    repeats: int = 5,
    warmup: int = 2,
    algorithms: tuple[str, ...] = conv_algorithms.ALGORITHMS,
    d2h_gb_per_s: float | None = None,
    h2d_gb_per_s: float | None = None,
    budget_bytes: int | None = None,
    measuring: str = "auto",
    profiled: ProfiledStep | None = None,
    progress: Callable[[str], None] | None = None,
    compile: bool = False,
    deadline: float | None = None,
    split_loss: bool = False,
) -> tuple[GraphProfile, ProfiledStep]:
    """The profile and the captured step it was measured on.

    With `budget_bytes`, every pass holds at most that much (fixed memory included): the step is measured under
    a schedule certified within the budget (executor.measure.measuring: keep-all where it fits, `measuring="frugal"` to
    measure under a frugal schedule even then), and a budget no measuring pass fits is a BudgetError naming the
    smallest that works, raised before anything beyond the model is allocated.
    On a GPU, transfer bandwidth is measured with pinned buffers unless given;
    on the CPU it is taken from the arguments or left out (no offloading).
    With `compile`, the planning nodes run as Inductor kernels (executor.engine.compiled_nodes) and are measured so:
    the profile is of the step that will run.
    With `split_loss`, a language model's loss is captured split (executor.capture.split_loss), as
    optimize(split_loss=True) runs it (ignored where `profiled` is given: it was captured already).
    `deadline` (a `time.monotonic()` instant, a command's time limit) bounds the search for the measuring schedule
    (TimeLimitReached when it comes first); the command stops the rest (cli/time_limit.py).
    """
    if repeats < 1 or warmup < 0:
        raise MososError(f"repeats must be at least 1 and warmup at least 0, not {repeats} and {warmup}")
    if measuring not in MODES:
        raise MososError(f"measuring is one of {', '.join(MODES)}, not {measuring!r}")
    optimizer_state_bytes(optimizer, 0)  # an unknown optimizer is refused before any work
    for argument, bandwidth in (("d2h_gb_per_s", d2h_gb_per_s), ("h2d_gb_per_s", h2d_gb_per_s)):
        if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float))
                                      or not math.isfinite(bandwidth) or bandwidth <= 0):
            raise MososError(f"{argument} is a copy bandwidth in GB/s, a positive number, not {bandwidth!r}")
    if not isinstance(model, nn.Module):
        raise MososError(f"the model must be a torch.nn.Module, not {type(model).__name__}")
    if not callable(loss_fn):
        raise MososError("a loss function is needed: loss = loss_fn(model(*inputs), targets)")
    inputs = as_tuple(example_inputs)
    kwargs = dict(kwargs or {})
    leaves = tree_flatten(((inputs, kwargs, targets), {}))[0]
    device = _first_device(model, leaves)
    say = progress or (lambda message: None)
    if device.type == "cuda" and (d2h_gb_per_s is None or h2d_gb_per_s is None):
        say("measuring PCIe bandwidth with pinned buffers")
        measured_d2h, measured_h2d = measure_bandwidth_gb_per_s(device)
        d2h_gb_per_s = d2h_gb_per_s or measured_d2h
        h2d_gb_per_s = h2d_gb_per_s or measured_h2d
    autocast_state = autocast.autocast_state()  # the precision the step is captured for; the passes run outside it
    with _Preserved(model, device), autocast.disabled():
        if profiled is None:
            say("capturing the step with torch.export")
            profiled = plan_step(model, inputs, kwargs, targets, loss_fn, autocast_state, loss_split=split_loss)
            say(f"captured {len(profiled.planning.groups)} planning nodes in "
                f"{profiled.step.export_seconds + profiled.step.joint_seconds:.1f} s")
            for note in profiled.step.loss_notes:
                say(note)
        provisional = provisional_profile(profiled, leaves, device, optimizer, algorithms, d2h_gb_per_s,
                                          h2d_gb_per_s, name, budget_bytes, say)
        try:
            chosen = measuring_schedule(provisional, budget_bytes, "keep-all" if budget_bytes is None else measuring,
                                        deadline=deadline)
        except BudgetError as error:
            told = _with_unprobed_scratch(error, profiled, provisional, leaves, device, optimizer, algorithms)
            if told is error:  # a measured floor (not a formula's ceiling the budget left no room to probe)
                told = _with_batch_splits_offered(error, profiled, provisional, leaves, device, optimizer, algorithms)
            if told is error:
                told = _with_split_loss_offered(error, profiled, provisional, leaves, device, optimizer, algorithms,
                                                (model, inputs, kwargs, targets, loss_fn, autocast_state))
            raise told from None
        profiled.measuring, profiled.provisional = chosen, provisional
        say(f"measuring under {chosen.describe()}")
        compiler = NodeCompiler(say) if compile else None
        try:
            nodes_doc, spread, notes, loss_bytes = _measure(profiled, provisional, chosen, leaves, device, repeats,
                                                            warmup, algorithms, say, compiler)
        except (RuntimeError, TypeError, ValueError, IndexError) as error:
            if isinstance(error, (MososError, torch.OutOfMemoryError)):
                raise
            raise _failed_on_these_inputs(error, model, inputs, kwargs, targets) from error
        profiled.compiled = compiler.record if compiler is not None else None
    if not compile:  # compiled nodes allocate their own outputs: their steps never write into an arena
        _with_arena_workspaces(nodes_doc, profiled, device)
    step = profiled.step
    document = {
        "name": name or f"{type(model).__name__} {step.input_signature} on {device.type}",
        "hardware": _hardware(device, d2h_gb_per_s, h2d_gb_per_s),
        "fixed_memory": fixed_memory(profiled, leaves, optimizer, loss_bytes),
        "nodes": nodes_doc,
        "provenance": {
            "source": "measured",
            "device": _device_name(device),
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "repeats": repeats,
            "spread_percent": round(statistics.median(spread), 3) if spread else 0.0,
            "tool": f"{TOOL}, torch {torch.__version__}",
            "model_structure_sha256": step.structure_sha256(),
            "input_signature": step.input_signature,
            "target_signature": step.target_signature,
            "notes": "; ".join([f"warmup={warmup}", *notes,
                                *[note for note in profiled.step.loss_notes if " is split" in note]]),
        },
    }
    profile = parse_profile(document, "measured profile")
    _check_measuring_peak(profile, provisional, chosen, say)
    return profile, profiled


def _with_arena_workspaces(nodes_doc: list[dict], profiled: ProfiledStep, device: torch.device) -> None:
    """Each workspace's arena part (`arena_workspace_bytes`): what a step writing into its arena places in the
    node's workspace slot. A convolution computes where the allocator puts it and takes its scratch there, so its
    measured workspace is beside the arena; planned addresses then leave it no empty slot (on the zoo's CNNs every
    workspace byte was such, 2-5% of their keep-all arenas; on a GPU, cuDNN's workspaces)."""
    planning = profiled.planning
    generator = CodeGenerator(planning, Modes(arena=True), cuda=device.type == "cuda")
    groups = {group.id: group for group in planning.groups}
    for node in nodes_doc:
        group = groups.get(node["id"])
        for implementation in node["implementations"]:
            workspace_bytes = implementation.get("workspace_bytes", 0)
            if group is not None and workspace_bytes:
                implementation["arena_workspace_bytes"] = generator.workspace_slot_bytes(
                    group, implementation["name"], workspace_bytes)


def _failed_on_these_inputs(error: BaseException, model, inputs, kwargs, targets) -> CaptureError:
    """The first real run of a step captured on fake tensors, which do not check every dtype (int32 targets for a
    cross entropy, bf16 inputs to a float32 layer): the error raised inside the generated code, said in the user's
    terms."""
    return CaptureError(
        f"{type(model).__name__}'s step fails on these inputs when it first runs: {_first_line(error).rstrip('.')}. "
        f"Inputs {tensor_signature(inputs, kwargs) or 'none'}, targets "
        f"{tensor_signature(targets) or 'none'}: check the dtypes and shapes given to the model and its loss (the "
        "capture runs on fake tensors, which do not check them all; if plain PyTorch runs this step, it is a mosos "
        "bug, please report it)")


def _check_measuring_peak(profile: GraphProfile, provisional: GraphProfile, chosen: MeasuringPlan, say) -> None:
    """Each measuring pass's schedule replayed on what was measured: its peak is what the passes really held. The
    provisional workspaces are upper estimates, so this stays within the budget; if a kernel's scratch was larger
    than that, say so loudly rather than let the promise break silently."""

    peaks = []
    checked = _with_unmeasured_implementations(profile, provisional)
    for algorithm, schedule in chosen.pass_schedules.items():
        replayed = Schedule.model_validate(schedule.model_dump() | {"profile_digest": checked.digest(),
                                                                    "profile_name": checked.name})
        try:
            peaks.append(simulate(checked, replayed, MAX_SIZE_BYTES, keep_timeline=False).peak_memory_bytes)
        except Exception as error:  # noqa: BLE001 - an unexpected rejection is reported, not fatal
            say(f"warning: the {algorithm} measuring pass could not be replayed on the measured figures, so what it "
                f"held was not checked against the budget: {error}")
    if not peaks:
        return
    peak = chosen.measured_peak_bytes = max(peaks)
    if chosen.budget_bytes is not None and peak > chosen.budget_bytes:
        message = (f"the measuring passes held up to {format_bytes(peak)} by the measured figures, over the budget "
                   f"{format_bytes(chosen.budget_bytes)}: a kernel's scratch was larger than estimated")
        say("warning: " + message)
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _with_unmeasured_implementations(profile: GraphProfile, provisional: GraphProfile) -> GraphProfile:
    """The measured profile, with the provisional figures (upper estimates) of implementations a measuring pass ran
    but the profile does not offer (a compiled step's convolution timed on channels-last only): the check's replay
    of the pass needs every implementation it ran."""
    document = profile.model_dump(mode="json")
    added = False
    for node in document["nodes"]:
        present = {implementation["name"] for implementation in node["implementations"]}
        estimated = provisional.node_by_id.get(node["id"])
        for implementation in estimated.implementations if estimated is not None else ():
            if implementation.name not in present:
                node["implementations"].append(implementation.model_dump(mode="json"))
                added = True
    return GraphProfile.model_validate(document) if added else profile


def distinct_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages among `tensors` (views and shared tensors counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr() or id(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _with_unprobed_scratch(error: BudgetError, profiled: ProfiledStep, provisional: GraphProfile, leaves, device,
                           optimizer, algorithms) -> BudgetError:
    """A floor that counts the shape formula's ceiling for the scratch of convolutions the budget had no room to
    probe is not what any plan needs (ResNet-18-small's stem: 144 MiB by the formula, 32 MiB taken), so the error
    says what is known: the floor without their scratch, and the budget from which the probes run; the smallest
    budget worth asking for is the larger of the two."""
    unprobed = unprobed_for_room(profiled.planning, device, profiled.convolution_scratch or {})
    if not unprobed or not error.minimum_budget_bytes:
        return error
    probed = profiled.convolution_scratch
    profiled.convolution_scratch = {**probed, **{group.index: 0 for group, _ in unprobed}}
    try:
        without_scratch = provisional_profile(profiled, leaves, device, optimizer, algorithms, None, None)
    finally:
        profiled.convolution_scratch = probed
    lower = minimum_budget_bytes(without_scratch)
    probing = provisional.fixed_bytes + max(need for _, need in unprobed)
    worth_asking = max(lower, probing)
    if worth_asking >= error.minimum_budget_bytes:
        return error
    ceilings = {group.id: native_scratch_bound_bytes(group) for group, _ in unprobed}
    largest = max(ceilings, key=ceilings.get)
    return BudgetError(
        f"{error}. That floor counts the shape formula's ceiling for the scratch of {len(unprobed)} native "
        f"convolution(s) ({largest!r}: {format_bytes(ceilings[largest])}), which this budget leaves no room to "
        f"probe: without their scratch any plan needs at least {format_bytes(lower)} "
        f"({lower} bytes), and from {format_bytes(probing)} ({probing} bytes) the probes run; ask for "
        f"{format_bytes(worth_asking)} ({worth_asking} bytes) or more and the floor is measured (it may be higher: "
        "the error then names the floor measured, which works)",
        minimum_budget_bytes=worth_asking)


def _with_batch_splits_offered(error: BudgetError, profiled: ProfiledStep, provisional: GraphProfile, leaves,
                               device, optimizer, algorithms) -> BudgetError:
    """A floor a whole-batch convolution sets, where the algorithms that run it on quarters of the batch were not
    offered (optimize()'s eager replay offers native alone, to be bitwise eager's): say how far they lower it,
    since that is the one change that lets such a model plan below it (ResNet-18-small at batch 32768 on an H200:
    every budget below keep-all failed at the stem's 2.94 GiB, compiled plans with them ran at 870 MiB)."""
    missing = tuple(name for name in conv_algorithms.BATCH_SPLITS if name not in algorithms)
    if not missing or not error.minimum_budget_bytes:
        return error
    offered = tuple(algorithms) + missing
    return _with_lower_floor(
        error, provisional, provisional_profile(profiled, leaves, device, optimizer, offered, None, None),
        "Convolutions run on quarters of the batch",
        f"offer them with algorithms={offered!r} (rounding apart from eager's, about 1e-5 of a filter gradient, not "
        "bitwise) or compile=True, which offers them")


def _with_lower_floor(error: BudgetError, provisional: GraphProfile, lowered: GraphProfile, change: str,
                      how: str) -> BudgetError:
    """`error`, told that `change` would lower the floor any plan needs to `lowered`'s, and `how` to ask for it,
    where that is at least 5% lower; else `error` as it was."""
    floor, lowered_floor = minimum_budget_bytes(provisional), minimum_budget_bytes(lowered)
    if lowered_floor > 0.95 * floor:
        return error
    return BudgetError(
        f"{error}. {change} would lower the floor any plan needs from {format_bytes(floor)} to "
        f"{format_bytes(lowered_floor)} ({lowered_floor} bytes): {how}",
        minimum_budget_bytes=error.minimum_budget_bytes)


def _with_split_loss_offered(error: BudgetError, profiled: ProfiledStep, provisional: GraphProfile, leaves, device,
                             optimizer, algorithms, step_arguments: tuple) -> BudgetError:
    """A floor a language model's whole loss sets (its logits, their log-softmax and gradient, each rows x classes),
    where the split loss was not asked for (it is rounding apart from eager's, not bitwise): say how far it lowers
    the floor. The step is captured again with the loss split (fake tensors, no memory) to know."""
    model, inputs, kwargs, targets, loss_fn, autocast_state = step_arguments
    losses = profiled.step.graph.find_nodes(op="call_function", target=torch.ops.aten.nll_loss_forward.default)
    if profiled.step.loss_split or autocast_state or not error.minimum_budget_bytes or not losses:
        return error
    try:
        split = plan_step(model, inputs, kwargs, targets, loss_fn, autocast_state, loss_split=True)
    except (CaptureError, MososError):
        return error
    if not any(note.endswith("classes") and " is split" in note for note in split.step.loss_notes):
        return error
    return _with_lower_floor(
        error, provisional, provisional_profile(split, leaves, device, optimizer, algorithms, None, None),
        "The loss computed over chunks of rows, its logits never whole,",
        "ask for it with split_loss=True (rounding apart from eager's, not bitwise)")


def fixed_memory(profiled: ProfiledStep, leaves: list, optimizer, loss_bytes: int,
                 device_type: str | None = None) -> dict:
    """Resident all step: inputs and targets, parameters, gradients, optimizer state; and as other: buffers,
    constants, the staging buffers of written-back values, the loss handed back and its incoming gradient, and the
    generator states kept for recomputed random nodes. Then the optimizer step's temporaries, for parameters on a
    device of `device_type` (the loss's by default)."""
    step = profiled.step
    parameters = [s for s in step.sources.values() if s.kind == "parameter"]
    tensors = {s.name: step.parameter(s.name, s.owner) for s in parameters}
    trainable = [tensors[name] for _, name, _ in step.gradients if name in tensors] or [
        step.parameter(name, owner) for _, name, owner in step.gradients]
    buffers = [step.buffer(s.name, s.owner) for s in step.sources.values() if s.kind == "buffer"]
    constants = [s.tensor for s in step.sources.values() if s.kind == "constant"]
    constants += [getattr(step.graph_module, n.target) for n in step.graph.find_nodes(op="get_attr")]
    staging = sum(value.meta["val"].untyped_storage().nbytes() for value, _ in step.mutations)
    loss = step.loss.meta["val"]
    returned = loss_bytes + loss.numel() * loss.element_size()  # the loss handed back and its gradient handed in
    trainable_bytes = distinct_storage_bytes(trainable)
    held_bytes = state_held_for_untrained_bytes(optimizer, trainable, list(tensors.values()))
    return {
        "inputs_bytes": distinct_storage_bytes(leaves),
        "parameters_bytes": distinct_storage_bytes(list(tensors.values())),
        "gradients_bytes": trainable_bytes,
        "optimizer_state_bytes": state_bytes(optimizer, trainable, device_type or loss.device.type) + held_bytes,
        "other_bytes": distinct_storage_bytes(buffers + constants) + staging + returned + random_state_bytes(profiled)
        + library_workspace_bytes(loss.device),
        "optimizer_step_bytes": optimizer_step_bytes(optimizer, trainable, device_type or loss.device.type),
    }


def state_held_for_untrained_bytes(optimizer, trainable: list[torch.Tensor], parameters: list[torch.Tensor]) -> int:
    """State an optimizer already holds for parameters the step does not train (frozen after training began, or
    frozen after loading a whole model's checkpoint): no step adds to it, but it stays resident (AdamW's moments of a
    tiny GPT-2's frozen blocks, uncounted, took a step 2.3 MB over its budget)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return 0
    training = {id(t) for t in trainable}
    return distinct_storage_bytes(held_state(optimizer, [p for p in parameters if id(p) not in training]))


_LIBRARY_WORKSPACES: dict[str, int] = {}


def library_workspace_bytes(device: torch.device) -> int:
    """cuBLAS's workspaces on a GPU: one per library handle and stream, taken from the caching allocator at its
    first matrix product and held from then on. A step uses two handles, its forward's thread's and that of the
    autograd engine's device thread, which runs every backward, the planned step's too (uncounted, an H200's first
    planned step rose 32 MiB above its plan). Measured once per device: the workspaces released, then a product
    and its backward run in each precision."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if str(device) not in _LIBRARY_WORKSPACES:
        torch.cuda.synchronize(device)
        release = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if release is not None:
            release()
        before = torch.cuda.memory_allocated(device)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            matrix = torch.ones(16, 16, dtype=dtype, device=device, requires_grad=True)
            bias = torch.ones(16, dtype=dtype, device=device, requires_grad=True)
            try:
                torch.addmm(bias, matrix, matrix).sum().backward()
            except RuntimeError:  # a precision this GPU has no matrix product for
                pass
            del matrix, bias
        torch.cuda.synchronize(device)
        _LIBRARY_WORKSPACES[str(device)] = max(0, torch.cuda.memory_allocated(device) - before)
    return _LIBRARY_WORKSPACES[str(device)]


def random_state_bytes(profiled: ProfiledStep) -> int:
    """The generator states a step keeps to draw a random node's numbers again where it is recomputed: one per
    random node, from its first run to the step's end, and one more while a recomputation runs (the state it
    goes back to). On the CPU each is a tensor in the device's own memory (5056 bytes: two dropouts of a small
    Llama put a plan 10 KB over its budget before they were counted); a GPU's states are kept in host memory."""
    random_nodes = sum(1 for group in profiled.planning.groups if group.random)
    if not random_nodes or profiled.step.loss.meta["val"].device.type != "cpu":
        return 0
    return (random_nodes + 1) * torch.get_rng_state().untyped_storage().nbytes()


def _passes(profiled: ProfiledStep, provisional: GraphProfile, chosen: MeasuringPlan, names, algorithms):
    """Per algorithm: the measuring schedule's operations with every convolution set to that algorithm where it
    applies and its workspace fits at that moment (native everywhere for the first pass), and what each planning
    node runs in it."""
    planning = profiled.planning
    index_of = {group.id: group.index for group in planning.groups}
    passes = []
    for algorithm in ["native"] + [a for a in algorithms if a != "native" and any(a in n for n in names)]:
        choose = (lambda node_id, a=algorithm: a if a in names[index_of[node_id]] else names[index_of[node_id]][0])
        schedule = with_implementations(provisional, chosen.schedule, choose, chosen.budget_bytes)
        operations = schedule_operations(provisional, schedule, index_of)
        ran = {op.group: op.implementation for op in operations if op.kind == "compute"}
        if algorithm != "native" and not any(impl == algorithm for impl in ran.values()):
            continue  # no convolution has room for it anywhere
        passes.append((algorithm, operations, ran))
        chosen.pass_schedules[algorithm] = schedule
    return passes


def _measure(profiled: ProfiledStep, provisional: GraphProfile, chosen: MeasuringPlan, leaves, device, repeats,
             warmup, algorithms, say, compiler: NodeCompiler | None = None):
    planning, step, feeder = profiled.planning, profiled.step, profiled.feeder
    groups = planning.groups
    names = implementations_of(planning, algorithms)
    clock, clock_name = cpu_clock(device)
    values = feeder.feed(leaves)
    if feeder.tangent_index is not None:
        loss_meta = step.loss.meta["val"]
        values[feeder.tangent_index] = torch.ones(loss_meta.shape, dtype=loss_meta.dtype, device=device)
    staging = feeder.staging_buffers(device)
    runtime = _ProfilingRuntime(device, staging, [g.id for g in groups], feeder.parameters(), clock)
    passes = _passes(profiled, provisional, chosen, names, algorithms)
    pass_names = [algorithm for algorithm, _, _ in passes]
    programs = []
    for algorithm, operations, ran in passes:
        generator = CodeGenerator(planning, Modes(timing=True), cuda=device.type == "cuda", compiler=compiler)
        programs.append((algorithm, generator.program(operations, None, name=f"profile {algorithm}"), ran,
                         operations))
    if compiler is not None:
        say(f"compiled: {compiler.record.describe()}")
        programs.extend(_eager_pass(profiled, provisional, chosen, names, compiler.record,
                                    device.type == "cuda"))
        pass_names = [algorithm for algorithm, _, _, _ in programs]
    samples: dict[tuple[int, str], list[float]] = {}
    harness: list[float] = []
    glue: list[float] = []  # per computation, ms
    with torch.no_grad():
        # round after round, every algorithm's pass in turn: a drift in the machine's speed during the measuring falls
        # on every algorithm alike, rather than on whichever ran last
        for index in range(warmup + repeats):
            for algorithm, program, ran, _ in programs:
                say(f"timing pass {index + 1}/{warmup + repeats}" + ("" if algorithm == "native" else f" ({algorithm})"))
                runtime.reset_timing()
                runtime.rng.clear()
                started = clock()
                loss, _ = program.parts[0](list(values), runtime)
                pass_ns = clock() - started
                runtime.sink.clear()
                loss_bytes = loss.untyped_storage().nbytes()
                del loss
                times = runtime.node_times_ms()
                overhead = _harness_ms(runtime)
                if index < warmup:
                    continue
                harness.append(overhead)
                if not runtime.cuda and runtime.counts:
                    # what the step spends between nodes (frees, calls, the loop): the pass less its nodes' clocks,
                    # less the half of each clock pair that falls outside its node
                    computations = sum(runtime.counts.values())
                    outside_ms = (pass_ns - sum(runtime.elapsed_ns.values())) / 1e6 / computations
                    glue.append(max(0.0, outside_ms - overhead / 2))
                for g, elapsed in times.items():
                    implementation = ran[g]
                    if _owner_pass(implementation, pass_names) == algorithm:
                        samples.setdefault((g, implementation), []).append(max(0.0, elapsed - overhead))
        sizes = dict(runtime.sizes)
        workspace = _workspaces(profiled, programs, values, device, pass_names, runtime, say, compiler)
    spread = []
    nodes_doc = []
    glue_ms = statistics.median(glue) if glue else 0.0
    for group in groups:
        implementations = []
        for implementation in names[group.index]:
            measured = samples.get((group.index, implementation))
            if not measured:
                continue
            median = statistics.median(measured)
            if median > 0 and len(measured) > 1:
                spread.append(100.0 * (max(measured) - min(measured)) / median)
            implementations.append({"name": implementation, "time_ms": median + glue_ms,
                                    "workspace_bytes": workspace.get((group.index, implementation), 0)
                                    + accumulation_bytes(planning, group)})
        # measured: a kernel may keep more than its shape says (a view of a larger buffer)
        nodes_doc.append(_node_document(planning, group, implementations, sizes[group.index]))
    frugal = chosen.strategy != "keep-all"
    notes = [
        ("timer=cuda events" if device.type == "cuda" else f"timer={clock_name}"),
        f"torch_threads={torch.get_num_threads()}",
        f"capture: torch.export {step.export_seconds:.2f} s, joint graph {step.joint_seconds:.2f} s, "
        f"{sum(1 for n in step.graph.nodes if n.op == 'call_function')} ATen nodes in {len(groups)} planning nodes",
        f"measured under {chosen.describe()}" + (f" (tried {', '.join(chosen.tried)})" if frugal else ""),
        "each node's time is its share of a real step: the clock around its code in the measuring step"
        + (" (a recomputed node: the mean of its computations)" if frugal else "")
        + f", less the clock's own cost ({statistics.median(harness) * 1000 if harness else 0:.2f} us, an empty node "
        "timed the same way in every pass), median over the passes after warm-up",
        f"each node's time includes {glue_ms * 1000:.2f} us of the step's glue between nodes (the pass's time less "
        "its nodes' clocks, per computation, median over the passes)",
        "convolution algorithms other than native: passes of their own with every convolution set to them where "
        "its workspace fits",
        "workspace=" + ("caching allocator requested bytes, peak less held at the node's end" if device.type == "cuda"
                        else "torch.profiler memory events (c10 CPU allocator), peak of the running total inside the "
                        "node less what it holds at its end"),
        "spread_percent is the median over nodes of (max-min)/median of the repeats",
    ]
    if compiler is not None:
        notes.append(f"compiled nodes (Inductor): {compiler.record.describe()}")
    return nodes_doc, spread, notes, loss_bytes


def _eager_pass(profiled: ProfiledStep, provisional: GraphProfile, chosen: MeasuringPlan, names: list[list[str]],
                record: CompiledNodes, cuda: bool) -> list[tuple]:
    """With compiled nodes: the native pass's schedule again with each compiled node run eagerly (implementation
    EAGER, added to the node's names), so that the plan can keep eager code where Inductor's kernel is slower. Same
    schedule, so within the same budget (eager code is what the provisional figures describe)."""
    planning = profiled.planning
    index_of = {group.id: group.index for group in planning.groups}
    eager_ids = {node_id for node_id in record.compiled
                 if node_id in index_of and planning.groups[index_of[node_id]].convolution is None}
    if not eager_ids:
        return []
    for node_id in eager_ids:
        names[index_of[node_id]].append(EAGER)
    schedule = chosen.pass_schedules[EAGER] = substituted(chosen.pass_schedules["native"], lambda node: EAGER,
                                                          eager_ids)
    operations = schedule_operations(provisional, schedule, index_of)
    ran = {op.group: op.implementation for op in operations if op.kind == "compute"}
    program = CodeGenerator(planning, Modes(timing=True), cuda=cuda, compiler=None)
    return [(EAGER, program.program(operations, None, name=f"profile {EAGER}"), ran, operations)]


def _owner_pass(implementation: str, passes: list[str]) -> str:
    """The pass whose figures an implementation takes: its own algorithm's, else the native pass."""
    return implementation if implementation in passes else "native"


def _harness_ms(runtime: _ProfilingRuntime) -> float:
    """What one tick/tock pair costs, measured on an empty node (index -1)."""
    if runtime.cuda:
        return 0.0
    costs = []
    for _ in range(5):
        runtime.elapsed_ns.pop(-1, None)
        runtime.tick(-1)
        runtime.tock(-1)
        costs.append(runtime.elapsed_ns.pop(-1) / 1e6)
    runtime.counts.pop(-1, None)
    return statistics.median(costs)


def _workspaces(profiled: ProfiledStep, programs, values, device, pass_names, runtime, say,
                compiler: NodeCompiler | None = None) -> dict:
    """(node, implementation) -> workspace bytes, one memory pass per algorithm, on the same schedules as timing."""
    planning = profiled.planning
    result: dict[tuple[int, str], int] = {}
    for algorithm, _, ran, operations in programs:
        generator = CodeGenerator(planning, Modes(memory=True), cuda=device.type == "cuda",
                                  compiler=None if algorithm == EAGER else compiler)
        program = generator.program(operations, None, name=f"memory {algorithm}")
        say("measuring workspace" + ("" if algorithm == "native" else f" ({algorithm})"))
        runtime.rng.clear()
        if device.type == "cuda":
            # a node's figures are what the allocator counts while it runs: memory freed meanwhile that is not
            # the node's (an offloaded tensor's deferred free, landing in whichever allocation comes next) would
            # count as its workspace (the first node of a bfloat16 GPT-2 measured 2.3 GB after a pass with
            # offloads, and no plan below 0.7 of keep-all fitted). So the pass starts from a settled allocator
            # and frees offloaded memory as soon as the host has waited for its copy.
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # also frees what earlier passes left for their copies' completion
            runtime.memory = {}
            runtime.transfers.wait_before_free = True
            try:
                program.parts[0](list(values), runtime)
            finally:
                runtime.transfers.wait_before_free = False
            runtime.sink.clear()
            measured = {g: max(0, peak - held) for g, (peak, held) in runtime.memory.items()}
        else:
            with memory_events() as trees:
                program.parts[0](list(values), runtime)
                runtime.sink.clear()
            measured = cpu_workspace_bytes(trees[0], len(planning.groups))
        for g, size in measured.items():
            if _owner_pass(ran[g], pass_names) == algorithm:
                result[(g, ran[g])] = size
    return result


def plain_step_time_ms(model: nn.Module, example_inputs, loss_fn: Callable, targets=None, *, kwargs=None,
                       repeats: int = 5, warmup: int = 2) -> float:
    """Median time of one plain PyTorch step (forward, loss, backward): what a profile's node times should add up to."""
    inputs = as_tuple(example_inputs)
    leaves = tree_flatten(((inputs, dict(kwargs or {}), targets), {}))[0]
    device = _first_device(model, leaves)
    clock, _ = cpu_clock(device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    times = []
    with _Preserved(model, device):
        for index in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = clock()
            loss = call_loss(loss_fn, model(*inputs, **dict(kwargs or {})), targets)
            torch.autograd.grad(loss, parameters, allow_unused=True)  # leaves .grad alone
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index >= warmup:
                times.append((clock() - started) / 1e6)
    return statistics.median(times)


def plain_equivalent_time_ms(profile: GraphProfile) -> float:
    """Sum of node times with the implementations plain PyTorch uses (native convolutions)."""
    total = 0.0
    for node in profile.nodes:
        names = {impl.name: impl for impl in node.implementations}
        total += (names.get("native") or names.get("default") or node.fastest).time_ms
    return total


__all__ = ["profile_model", "profile_step", "plan_step", "ProfiledStep", "tensor_signature", "optimizer_state_bytes",
           "plain_step_time_ms", "plain_equivalent_time_ms", "as_tuple", "call_loss"]

"""Which step the profiler runs to measure a model: one that fits the budget, from the first allocation.

Sizes come from the capture's fake-tensor run and need no memory; times and
workspaces need a real run. The keep-all step is the most faithful one to
time, but it is exactly what does not fit for the models mosos is for. So,
before anything is allocated, the profiler builds a *provisional* profile
(exact sizes, conservative workspaces, rough times) and asks the planner for a
measuring schedule the simulator certifies within the budget on it:

1. keep-all, when it fits (the figures are those of the step people know);
2. everything offloaded after its last forward reader and prefetched before
   its first backward reader, where there is a host link (as the Chainer
   swap/recompute runtime profiles its first iterations);
3. recomputation from checkpoints: checkpoint-all, then Chen's sqrt(n), then
   the greedy evict-and-recompute pass (on the fastest implementations, in a
   memory-aware order, then on the smallest workspaces: a batch-split
   convolution where native's scratch leaves no room), then the recompute-only
   solver.

If none fits, nothing is run: a BudgetError names the smallest budget known
to work. The workspaces are upper estimates (the transient intermediates the
fake run sees, one more operation-sized buffer for a kernel's own scratch
except where the kernel is known to make none, and for a convolution its
im2col columns), so a schedule certified on them holds
on the real figures too; the profiler checks that afterwards with what it
measured.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from executor.engine.schedules import offload_everything_schedule
from planner.budget import describe_minimum, minimum_budget_bytes, smallest_budget
from planner.builder import certify, summarize
from planner.cpsat.greedy import greedy_recompute_schedule, smallest_workspaces_differ
from planner.cpsat.reorder import reordered_schedule
from planner.errors import BudgetError, InfeasibleBudget, TimeLimitReached
from planner.planning import plan
from planner.profile import GraphProfile
from planner.schedule import Compute, Schedule
from planner.simulator import ScheduleRejected, simulate
from planner.strategies.keep_all import keep_all_schedule
from planner.units import format_bytes

MODES = ("auto", "keep-all", "frugal")
FRUGAL_STRATEGIES = ("checkpoint-all", "chen-sqrt", "recompute-only")
HEURISTIC_STRATEGIES = ("checkpoint-all", "chen-sqrt")  # one plan each, the same whenever asked
# small allocations kernels make beside their outputs (a scalar, a shape buffer; an embedding's backward: 8 KiB)
SCRATCH_SLACK_BYTES = 16 << 10
HALF_PRECISION_PACKING_BYTES_PER_STEP = 128  # per thread and step of a half-precision product's contracted dimension


# Kernels that allocate nothing beyond their results, on the CPU and on CUDA: elementwise TensorIterator kernels
# (which cast and broadcast as they go) and the pooling and batch-norm forward kernels, whose statistics are per
# channel. Each is measured so by tests/test_scratch_allowance.py. Not here, because they do hold scratch as large
# as a result: native_dropout_backward (the mask widened to the gradient's type), native_batch_norm_backward.
NO_SCRATCH_OPERATIONS = frozenset(f"aten.{name}" for name in (
    "relu.default", "threshold_backward.default", "hardtanh.default", "hardtanh_backward.default",
    "gelu.default", "gelu_backward.default", "silu.default", "silu_backward.default",
    "sigmoid.default", "sigmoid_backward.default", "tanh.default", "tanh_backward.default",
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "clone.default",
    "max_pool2d_with_indices.default", "max_pool2d_with_indices_backward.default",
    "_native_batch_norm_legit_functional.default", "_native_batch_norm_legit.default",
    "_native_batch_norm_legit_no_training.default",
))
# measured to make none where every operand is contiguous, and to copy one that is not (a softmax over a transposed
# tensor, a layer norm's backward on one: as large as the result, twice): attention's softmax and its backward,
# whose allowance alone (one more score matrix) set CLIP's floor above plain PyTorch's whole step, and the loss's
NO_SCRATCH_WHEN_CONTIGUOUS = frozenset(f"aten.{name}" for name in (
    "_softmax.default", "_softmax_backward_data.default", "_log_softmax.default",
    "_log_softmax_backward_data.default", "nll_loss_forward.default", "nll_loss_backward.default",
    "native_layer_norm.default", "masked_fill.Scalar", "where.self", "exp.default", "neg.default",
    "pow.Tensor_Scalar", "_to_copy.default",
))

# Kernels whose scratch follows an operand rather than their result: (operand position, multiple) per kernel.
# embedding_dense_backward's result is the whole table's gradient (a language model's vocabulary by its hidden
# size: counted from it, the allowance alone set GPT-2's floor once its loss was split); what it holds beyond is a
# dense copy of the incoming gradient where that is strided on the CPU (tests/test_scratch_allowance.py); on CUDA,
# partial sums per segment of sorted indices (at most the incoming gradient's rows, in float32: twice a bf16
# gradient) and a few arrays as long as the indices (sorted, their order, segment offsets, counts).
SCRATCH_OF_OPERANDS = {
    "aten.embedding_dense_backward.default": ((0, 2), (1, 6)),
}


def _operand_bytes(value) -> int:
    tensor = value.meta.get("val") if hasattr(value, "meta") else None
    return tensor.untyped_storage().nbytes() if isinstance(tensor, torch.Tensor) else 0


def scratch_bound_bytes(op, root_bytes: dict) -> int:
    """One kernel's unseen scratch, from above: as large as the largest storage it makes, or for the kernels of
    SCRATCH_OF_OPERANDS, multiples of the operands their scratch follows."""
    operands = SCRATCH_OF_OPERANDS.get(str(op.target))
    if operands is not None:
        return sum(multiple * _operand_bytes(op.args[position]) for position, multiple in operands)
    return max((root_bytes.get(v, 0) for v in [op] + [u for u in op.users if u.target is operator.getitem]), default=0)


def scratch_allowance_bytes(planning, group, measured=()) -> int:
    """A kernel's own scratch, which no fake tensor shows (dropout's mask, a reduction's buffer): up to one more
    buffer as large as the largest storage an operation of the node makes, but for the kernels known to make none
    (NO_SCRATCH_OPERATIONS: at ResNet-18-small's stem the allowance alone set the floor). Operations in `measured`
    are left out: their scratch is counted from a measurement (a native convolution probed on slices of its
    batch)."""
    scratchy = [op for op in group.ops if not _makes_no_scratch(op)]
    sizes = [scratch_bound_bytes(op, planning.facts.root_bytes) for op in scratchy if op not in measured]
    return max(sizes, default=0) + max(map(_half_precision_scratch, scratchy), default=0) + SCRATCH_SLACK_BYTES


def _makes_no_scratch(op) -> bool:
    target = str(op.target)
    return (target in NO_SCRATCH_OPERATIONS and _same_layouts(op) and _one_floating_dtype(op)) \
        or (target in NO_SCRATCH_WHEN_CONTIGUOUS and _contiguous_operands(op)
            and (target == "aten._to_copy.default" or _one_floating_dtype(op)))


def _one_floating_dtype(op) -> bool:
    """Whether the operation reads floating-point tensors of its result's type only: on the CPU, TensorIterator
    first copies an operand of another type into the common one (autocast's residual add of a bf16 projection to
    a float32 stream, DoRA's float32 x bf16 products: each a result's size of scratch). Scalars (0-dim) it reads
    as they are."""
    result = op.meta.get("val")
    result = result[0] if isinstance(result, (tuple, list)) and result else result
    if not isinstance(result, torch.Tensor):
        return False
    for node in op.all_input_nodes:
        value = node.meta.get("val")
        if (isinstance(value, torch.Tensor) and value.dim() > 0 and value.is_floating_point()
                and value.dtype != result.dtype):
            return False
    return True


def _contiguous_operands(op) -> bool:
    for node in op.all_input_nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and not value.is_contiguous():
            return False
    return True


def _same_layouts(op) -> bool:
    """Whether the tensors of one shape an operation reads are laid out alike (a broadcast operand aside): where
    they are not, a kernel of NO_SCRATCH_OPERATIONS may make dense copies first (gelu_backward on a transposed
    gradient, wav2vec2: twice its result)."""
    layouts: dict[tuple, set] = {}
    for node in op.all_input_nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            layouts.setdefault(tuple(value.shape), set()).add(tuple(value.stride()))
    return all(len(strides) == 1 for strides in layouts.values())


_HALF = ("torch.bfloat16", "torch.float16")
# matrix products -> the argument whose last dimension they contract (after the added input, where there is one)
_MATRIX_PRODUCTS = {"aten.mm.default": 0, "aten.bmm.default": 0, "aten.addmm.default": 1, "aten.baddbmm.default": 1,
                    "aten.addbmm.default": 1}


def _half_precision_scratch(op) -> int:
    """Mixed precision: a CPU kernel on bf16/fp16 tensors may widen them to float32 while it works (oneDNN's matrix
    products, reductions): twice the bytes of every half-precision tensor it reads or writes. The kernels measured
    to make no scratch make none in bf16 either (tests/test_scratch_allowance.py): a bf16 GPT-2's loss node was
    allowed twice its logits' cast for it, and its floor stood 1.37x float32's."""
    total = 0
    for node in [op] + list(op.all_input_nodes):
        value = node.meta.get("val")
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(tensor, "dtype") and str(tensor.dtype) in _HALF:
                total += tensor.numel() * tensor.element_size()
    operand = _MATRIX_PRODUCTS.get(str(op.target))
    if not total or operand is None:
        return 2 * total
    # and oneDNN packs a product's operands in buffers of each thread's own, 128 bytes per step of the contracted
    # dimension (measured on small bf16 products: 32x512 by 512x4 with the first transposed, as peft's DoRA makes,
    # held 27 KiB over twice its bytes on one thread, 94 KiB on two)
    first = op.args[operand]
    value = first.meta.get("val") if isinstance(first, fx.Node) else None
    contracted = value.shape[-1] if isinstance(value, torch.Tensor) and value.dim() else 0
    return 2 * total + torch.get_num_threads() * contracted * HALF_PRECISION_PACKING_BYTES_PER_STEP


@dataclass
class MeasuringPlan:
    schedule: Schedule
    strategy: str
    peak_bytes: int  # simulated on the provisional profile (fixed memory included)
    budget_bytes: int | None
    tried: list[str]
    measured_peak_bytes: int | None = None  # the most any pass's schedule holds, replayed on the measured figures
    pass_schedules: dict = field(default_factory=dict)  # algorithm -> the schedule its passes ran

    def describe(self) -> str:
        budget = f" within {format_bytes(self.budget_bytes)}" if self.budget_bytes is not None else ""
        return f"{self.strategy} (estimated peak {format_bytes(self.peak_bytes)}{budget})"

    def as_plan(self, profile: GraphProfile, budget_bytes: int | None) -> Schedule | None:
        """The schedule the step was measured under, certified on the measured figures, if it fits `budget_bytes`
        there: a plan known to run within the budget, for when the planner finds none (BERT of the frontier at
        108 MiB: measured under the greedy pass, while the solver's model, with its fixed compute order, proved
        none of its plans fits and named 140 MiB). None where it does not fit or names what the profile lacks."""

        restamped = Schedule.model_validate(self.schedule.model_dump() | {
            "profile_digest": profile.digest(), "profile_name": profile.name, "budget_bytes": budget_bytes,
            "summary": None})
        try:
            replayed = simulate(profile, restamped, budget_bytes, keep_timeline=False)
        except ScheduleRejected:
            return None
        return restamped.model_copy(update={"summary": summarize(replayed, f"measuring pass ({self.strategy})")})


def _certified_peak(profile: GraphProfile, schedule: Schedule, budget_bytes: int | None) -> int | None:
    try:
        return simulate(profile, schedule, budget_bytes, keep_timeline=False).peak_memory_bytes
    except ScheduleRejected:
        return None


def measuring_schedule(provisional: GraphProfile, budget_bytes: int | None, mode: str = "auto",
                       time_limit_s: float = 20.0, deadline: float | None = None) -> MeasuringPlan:
    """The schedule to measure under (see the module's docstring); BudgetError if none fits. `deadline` (a
    `time.monotonic()` instant, a command's time limit): no search runs past it, and TimeLimitReached says which
    were tried when it comes first, rather than a BudgetError the cut searches could not back."""

    if mode not in MODES:
        raise ValueError(f"measuring mode is one of {', '.join(MODES)}, not {mode!r}")
    tried: list[str] = []
    clock = _Clock(deadline, tried)
    keep_all = keep_all_schedule(provisional)
    keep_all_peak = simulate(provisional, keep_all, keep_timeline=False).peak_memory_bytes
    floor = minimum_budget_bytes(provisional)
    if budget_bytes is not None and budget_bytes < floor:
        raise _below_floor(provisional, budget_bytes, floor, keep_all_peak,
                           clock.left(time_limit_s / 4) if mode != "keep-all" else 0.0)
    if mode == "keep-all" or budget_bytes is None:
        if budget_bytes is not None and keep_all_peak > budget_bytes:
            raise BudgetError(f"measuring keep-all needs about {format_bytes(keep_all_peak)}, over the budget "
                              f"{format_bytes(budget_bytes)}: measure with a frugal schedule instead",
                              minimum_budget_bytes=keep_all_peak)
        return MeasuringPlan(keep_all, "keep-all", keep_all_peak, budget_bytes, ["keep-all"])
    if mode == "auto":
        tried.append("keep-all")
        if keep_all_peak <= budget_bytes:
            return MeasuringPlan(keep_all, "keep-all", keep_all_peak, budget_bytes, tried)
    smallest, unverified = [keep_all_peak], []  # budgets a measuring pass was seen to fit; budgets named only
    if provisional.hardware.can_transfer:

        tried.append("offload-everything")
        schedule = offload_everything_schedule(provisional)
        peak = _certified_peak(provisional, schedule, None)
        if peak is not None:
            smallest.append(peak)
            if peak <= budget_bytes:
                return MeasuringPlan(schedule, "offload-everything", peak, budget_bytes, tried)
    for strategy in FRUGAL_STRATEGIES:
        if strategy == "recompute-only":
            # the greedy evict-and-recompute pass first: a measuring schedule only has to fit, and it takes
            # milliseconds where the solver takes its whole time limit to prove what it found
            tried.append("greedy recompute")
            schedule = _greedy(provisional, budget_bytes, time.monotonic() + clock.allow(time_limit_s / 4))
            if schedule is not None:
                return MeasuringPlan(schedule, "greedy recompute", schedule.summary.peak_memory_bytes, budget_bytes,
                                     tried)
        tried.append(strategy)
        try:
            # a pass to measure under, replayed by the caching allocator and checked by its trace: no addresses
            schedule = plan(provisional, budget_bytes, strategy=strategy,
                            time_limit_s=clock.allow(time_limit_s), workers=1, addresses=False)
        except InfeasibleBudget as error:
            if error.minimum_budget_bytes:
                # a heuristic's figure is its own plan's peak, met again when asked for; the solver's is what its
                # memory-minimizing search found once, which its time-limited solve need not find again
                (smallest if strategy in HEURISTIC_STRATEGIES else unverified).append(error.minimum_budget_bytes)
            continue
        except BudgetError as error:  # below what any plan needs
            raise BudgetError(f"no measuring pass fits: {error}", minimum_budget_bytes=error.minimum_budget_bytes) \
                from None
        return MeasuringPlan(schedule, strategy, schedule.summary.peak_memory_bytes, budget_bytes, tried)
    if clock.cut:  # a search the deadline cut short backs no "no pass fits"
        clock.stop()
    minimum = _smallest_greedy_budget(provisional, budget_bytes, min(smallest), unverified,
                                      clock.allow(time_limit_s / 4))
    raise BudgetError(
        f"no measuring pass fits in {format_bytes(budget_bytes)} ({budget_bytes} bytes): tried {', '.join(tried)}; "
        f"the smallest budget known to work is {format_bytes(minimum)} ({minimum} bytes)",
        minimum_budget_bytes=minimum)


def _below_floor(provisional: GraphProfile, budget_bytes: int, floor: int, keep_all_peak: int,
                 time_limit_s: float) -> BudgetError:
    """A budget below what any plan needs, with the smallest budget known to work beside that floor: the floor is
    only a bound (GPT-2 with AdamW: 18.19 MiB named, and at 18.19 MiB no measuring pass fit, the next error naming
    18.45), so the greedy pass is tried from the floor up and the error's minimum_budget_bytes is a budget that
    measures."""
    working = keep_all_peak  # with no time to search (or measuring keep-all only), the budget keep-all measures in
    if time_limit_s > 0:
        working = floor if _greedy(provisional, floor, time.monotonic() + time_limit_s) is not None \
            else _smallest_greedy_budget(provisional, floor, keep_all_peak, [], time_limit_s)
    # the budget to ask for comes first; the floor, where no pass was seen to fit, is a bound and said to be one
    known = f"the smallest budget known to work is {format_bytes(working)} ({working} bytes)"
    if budget_bytes < provisional.fixed_bytes:
        parameters_bytes = provisional.fixed_memory.parameters_bytes
        floor_text = f"any plan needs at least {format_bytes(floor)} ({floor} bytes)"
        return BudgetError(
            f"budget {format_bytes(budget_bytes)} is below the model's fixed memory "
            f"{format_bytes(provisional.fixed_bytes)} (parameters {format_bytes(parameters_bytes)}, "
            f"gradients, optimizer state, inputs, buffers), so no step fits; "
            + (f"{known} ({floor_text}, but no measuring pass fits there)" if working != floor
               else f"{floor_text}, and a measuring pass fits there"), minimum_budget_bytes=working)
    if working == floor:
        return BudgetError(f"no measuring pass fits: budget {budget_bytes} bytes ({format_bytes(budget_bytes)}) is "
                           f"below what any plan needs: {describe_minimum(provisional)}, and a measuring pass fits "
                           "there", minimum_budget_bytes=working)
    return BudgetError(f"no measuring pass fits: budget {budget_bytes} bytes ({format_bytes(budget_bytes)}) is below "
                       f"what any plan needs; {known} (any plan needs at least {describe_minimum(provisional)}, "
                       "but no measuring pass fits there)", minimum_budget_bytes=working)


class _Clock:
    """The searches' time limits within a command's deadline (a `time.monotonic()` instant, or None)."""

    def __init__(self, deadline: float | None, tried: list[str]):
        self.deadline, self.tried = deadline, tried
        self.cut = False  # a search was given less than its own time limit

    def allow(self, time_limit_s: float) -> float:
        """`time_limit_s`, or what is left before the deadline if less; TimeLimitReached once nothing is."""
        if self.deadline is None:
            return time_limit_s
        left_s = self.deadline - time.monotonic()
        if left_s <= 0:
            self.stop()
        self.cut |= left_s < time_limit_s
        return min(time_limit_s, left_s)

    def left(self, time_limit_s: float) -> float:
        """`time_limit_s`, or what is left before the deadline if less (0 once nothing is)."""
        if self.deadline is None:
            return time_limit_s
        return max(0.0, min(time_limit_s, self.deadline - time.monotonic()))

    def stop(self):
        done = f" (tried {', '.join(self.tried)})" if self.tried else ""
        raise TimeLimitReached(f"no measuring schedule within the budget was found in the time left{done}")


def _smallest_greedy_budget(provisional: GraphProfile, failed_bytes: int, known_bytes: int, named: list[int],
                            time_limit_s: float) -> int:
    """The smallest budget between one no measuring pass fits and one known to work at which the greedy pass
    fits: what the strategies' own figures name can be far above it (GPT-2 of the frontier: 249 MiB named, where
    the greedy pass fits from 197 MiB, a floor of 187), and the greedy pass takes a tenth of a second. Whether it
    fits is not monotone in the budget (the zoo's BERT: from 11% above its floor, not at 12-14%, again from 15%),
    so after a bisection (to 0.5%) has found one, a scan upwards from the floor in steps of 1% looks below it
    with the time left, and a bisection refines what it finds. `named`: budgets the solver named but no pass was
    seen to fit, taken where the greedy pass fits them. The budget returned is one a measuring pass was seen to fit,
    so asking for it measures."""
    deadline = time.monotonic() + time_limit_s

    def greedy_fits(budget_bytes: int) -> bool:
        return _greedy(provisional, budget_bytes, deadline) is not None

    def bisected(failed: int, known: int) -> int:  # known fits: no doubling; to 0.5% (1 KiB at least)
        found = smallest_budget(lambda budget: budget if greedy_fits(budget) else None, failed, known,
                                lambda: time.monotonic() >= deadline, doublings=0,
                                resolution_bytes=max(known // 200, 1 << 10))
        return known if found is None else found

    failed, known = failed_bytes, known_bytes
    for budget_bytes in sorted(b for b in named if failed < b < known):
        if greedy_fits(budget_bytes):
            known = budget_bytes
            break
    known = bisected(failed, known)
    step = max(failed_bytes // 100, 1 << 10)
    below, scanned = failed_bytes, failed_bytes + step
    while scanned < known - step and time.monotonic() < deadline:
        if greedy_fits(scanned):
            return bisected(below, scanned)
        below, scanned = scanned, scanned + step
    return known


def measuring_pass_fits(provisional: GraphProfile, budget_bytes: int, time_limit_s: float = 1.0) -> bool:
    """Whether keep-all or the greedy pass measures within `budget_bytes`: the quick part of measuring_schedule,
    for a batch that is only predicted (max-batch). False may be too strict (a solver might find a pass), never too
    lenient."""

    if budget_bytes < minimum_budget_bytes(provisional):
        return False
    if simulate(provisional, keep_all_schedule(provisional), keep_timeline=False).peak_memory_bytes <= budget_bytes:
        return True
    return _greedy(provisional, budget_bytes, time.monotonic() + time_limit_s) is not None


def _greedy(provisional: GraphProfile, budget_bytes: int, deadline: float) -> Schedule | None:
    """The greedy evict-and-recompute pass, then the memory-aware order, then the greedy pass with every node on
    its implementation of smallest workspace (a batch-split convolution where native's scratch leaves no room:
    the passes put native back wherever it fits), until `deadline` (time.monotonic())."""

    makers = [lambda: greedy_recompute_schedule(provisional, budget_bytes, deadline=deadline),
              lambda: reordered_schedule(provisional, budget_bytes, deadline=deadline)]
    if smallest_workspaces_differ(provisional):
        makers.append(lambda: greedy_recompute_schedule(provisional, budget_bytes, deadline=deadline,
                                                        implementation="smallest-workspace"))
    for make in makers:
        schedule = make()
        if schedule is not None:
            try:
                return certify(provisional, schedule, "greedy recompute")
            except ScheduleRejected:
                continue
    return None


def substituted(schedule: Schedule, choose, nodes: set[str]) -> Schedule:
    """`schedule` with the computations of `nodes` set to implementation `choose(node_id)`, unchecked; other
    implementations take other workspaces, so it carries no planned addresses."""
    stages = []
    for stage in schedule.stages:
        operations = [op.model_copy(update={"implementation": choose(op.node)})
                      if isinstance(op, Compute) and op.node in nodes else op for op in stage.operations]
        stages.append(stage.model_copy(update={"operations": operations}))
    return schedule.model_copy(update={"stages": stages, "arena_bytes": None})


def with_implementations(provisional: GraphProfile, schedule: Schedule, choose, budget_bytes: int | None) -> Schedule:
    """`schedule` with each computation's implementation set to `choose(node_id)` wherever the simulated step still
    fits the budget (all at once if that fits, else one node at a time in program order); elsewhere as it was."""
    wanted = [op.node for _, _, op in schedule.operations()
              if isinstance(op, Compute) and choose(op.node) != op.implementation]
    wanted = list(dict.fromkeys(wanted))
    if not wanted:
        return schedule
    every = substituted(schedule, choose, set(wanted))
    if _certified_peak(provisional, every, budget_bytes) is not None:
        return every
    allowed: set[str] = set()
    for node_id in wanted:
        trial = substituted(schedule, choose, allowed | {node_id})
        if _certified_peak(provisional, trial, budget_bytes) is not None:
            allowed.add(node_id)
    return substituted(schedule, choose, allowed)


__all__ = ["MODES", "MeasuringPlan", "measuring_schedule", "substituted", "with_implementations",
           "scratch_allowance_bytes", "scratch_bound_bytes", "SCRATCH_OF_OPERANDS", "NO_SCRATCH_OPERATIONS",
           "NO_SCRATCH_WHEN_CONTIGUOUS"]

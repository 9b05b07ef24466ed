"""`optimize()`: the one call a training script adds. Profile here, plan (locally or on a service), replay.

    planned = executor.optimize(model, inputs, loss_fn, targets=targets, budget="10GiB")
    loss = planned(inputs, targets); loss.backward(); optimizer.step()

Keyword inputs of the model go in `kwargs=` here and as keywords of the call: `planned(ids, targets=t, attention_mask=m)`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from executor.capture import autocast
from executor.capture.capture import tensor_signature
from executor.engine import conv_algorithms
from executor.engine.device_memory import DeviceMemory, device_memory_of
from executor.measure.profiler import (
    ProfiledStep,
    as_tuple,
    check_optimizer_argument,
    plan_step,
    planning_of,
    preserved,
    profile_step,
    provisional_profile,
)
from executor.plan.cache import PlanKey, open_cache, plan_key
from executor.replay.replay import (
    STOPPING, PlannedModule, arena_outside_bytes, arena_reserve_bytes, plan_beside_the_arena,
)
from planner.budget import budget_from_ratio, check_memory_ratio, requested_budget
from planner.errors import BudgetError, MososError
from planner.planning import addressed, check_plan_options, plan
from planner.profile import GraphProfile
from planner.schedule import Schedule, parse_schedule
from planner.units import format_bytes


class PlannerServiceError(MososError):
    """The planner service answered with an error, or not at all."""


class PlannerServiceInfeasible(PlannerServiceError, BudgetError):
    """The planner service found no plan within the budget; says the smallest budget it knows to work."""


def _reporter(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
    if callable(progress):
        return progress
    if not progress:
        return lambda message: None
    started = time.monotonic()
    return lambda message: print(f"[mosos {time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)


def plan_remotely(
    planner_url: str,
    profile: GraphProfile,
    budget_bytes: int | None,
    memory_ratio: float | None,
    strategy: str,
    time_limit_s: float,
    token: str | None = None,
    say: Callable[[str], None] = lambda m: None,
    poll_s: float = 1.0,
) -> Schedule:
    """POST the profile to a planner service (/v1/plans) and wait for its schedule."""
    import json

    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"profile": json.loads(profile.to_json()), "strategy": strategy, "time_limit_s": time_limit_s, "wait_s": 10}
    if budget_bytes is not None:
        body["budget_bytes"] = budget_bytes
    if memory_ratio is not None:
        body["memory_ratio"] = memory_ratio
    base = planner_url.rstrip("/")
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
            answer = client.post("/v1/plans", json=body)
            while True:
                if answer.status_code >= 400:
                    try:
                        message = answer.json().get("message", answer.text)
                    except ValueError:
                        message = answer.text
                    raise PlannerServiceError(f"planner service at {base} answered {answer.status_code}: {message}")
                status = answer.json()
                if status["status"] == "done":
                    if not status.get("feasible", True) or status.get("schedule") is None:
                        minimum = status.get("minimum_budget_bytes")
                        raise PlannerServiceInfeasible(
                            f"no plan fits: {status.get('reason') or 'infeasible'}"
                            + (f" (the smallest budget that works: {format_bytes(minimum)})" if minimum else ""),
                            minimum_budget_bytes=minimum,
                        )
                    return parse_schedule(status["schedule"], f"{base}/v1/plans/{status['id']}")
                if status["status"] in ("failed", "cancelled"):
                    raise PlannerServiceError(f"plan {status['id']} {status['status']}: {status.get('reason')}")
                progress = status.get("progress") or {}
                say(f"planning on {base}: {status['status']}" + (f", best {progress['objective']:.4g}" if progress.get("objective") else ""))
                time.sleep(poll_s)
                answer = client.get(f"/v1/plans/{status['id']}")
    except httpx.HTTPError as error:
        raise PlannerServiceError(f"cannot reach the planner service at {base}: {error}") from None


RATIO_CACHE_TOLERANCE = 0.01  # a kept plan's ratio budget against this run's estimate (probes of scratch may vary)


def ratio_budget_bytes(profiled, model, inputs, kwargs, targets, optimizer, memory_ratio: float,
                       algorithms: tuple[str, ...] | None = None, progress=None) -> int:
    """`memory_ratio` of the keep-all peak as the capture estimates it, before the step runs (large-batch native
    convolutions probed on a few samples of the batch)."""
    from torch.utils._pytree import tree_flatten

    leaves = tree_flatten(((tuple(inputs), dict(kwargs or {}), targets), {}))[0]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    provisional = provisional_profile(profiled, leaves, device, optimizer, algorithms or conv_algorithms.ALGORITHMS,
                                      None, None, progress=progress)
    return budget_from_ratio(provisional, memory_ratio)


# compile=True's step is plain PyTorch's to rounding anyway: ATen's own kernels on other layouts and parts of the batch
COMPILED_ALGORITHMS = ("native", "channels-last", "batch-split", "batch-split-sum")


def _algorithms(algorithms) -> tuple[str, ...]:

    if algorithms == "all":
        return tuple(conv_algorithms.ALGORITHMS)
    if isinstance(algorithms, str):
        algorithms = (algorithms,)
    unknown = [a for a in algorithms if a not in conv_algorithms.ALGORITHMS]
    if unknown or not algorithms or "native" not in algorithms:
        raise MososError(f"algorithms are some of {', '.join(conv_algorithms.ALGORITHMS)} (native among them), or "
                         f"'all'; not {algorithms!r}")
    return tuple(algorithms)


class _DefaultBudget(str):
    """optimize()'s default budget: a str like any other, told apart from one the caller gave."""


DEFAULT_BUDGET = _DefaultBudget("10GiB")


def _check_planning_arguments(memory_ratio, strategy, time_limit_s, planner_url) -> None:
    """What the solve would refuse, refused by the planner's own checks before the capture and the measuring pass
    (and before a cache hit, which would otherwise accept it until the first re-plan)."""

    if memory_ratio is not None:
        check_memory_ratio(memory_ratio)
    check_plan_options(None if planner_url else strategy, time_limit_s)  # a service knows its own strategies


def optimize(
    model: nn.Module,
    example_inputs,
    loss_fn: Callable,
    budget: str | int | None = DEFAULT_BUDGET,
    *,
    targets=None,
    kwargs: dict | None = None,
    memory_ratio: float | None = None,
    strategy: str = "mosos",
    planner_url: str | None = None,
    planner_token: str | None = None,
    time_limit_s: float = 60.0,
    workers: int | None = None,
    optimizer: str | torch.optim.Optimizer | None = "sgd",
    d2h_gb_per_s: float | None = None,
    h2d_gb_per_s: float | None = None,
    algorithms: tuple[str, ...] | str | None = None,
    repeats: int = 5,
    warmup: int = 2,
    measuring: str = "auto",
    timed_steps: int = 2,
    replan_when_off: bool = True,
    cache: bool | str | os.PathLike | None = None,
    new_signatures: bool = True,
    max_signatures: int = 4,
    progress: bool | Callable[[str], None] = True,
    compile: bool = False,
    compile_regions: bool = True,
    device_memory: DeviceMemory | None | str = "auto",
    arena: bool | None = None,
    split_loss: bool = False,
) -> PlannedModule:
    """Profile `model` on its device with `example_inputs`, plan within `budget` (or, not both, `memory_ratio` of the
    keep-all peak), and return the PlannedModule that trains as planned.

    The budget holds from the first allocation: the capture needs no memory (fake tensors), the profile is
    measured under a schedule certified within the budget (keep-all only where it fits; `measuring="frugal"`
    measures under a frugal schedule even then), and a budget no measuring pass or plan fits is a BudgetError
    naming the smallest one that works, raised before anything beyond the model is allocated. `memory_ratio` is a
    fraction of the keep-all peak as the capture estimates it before anything runs (exact sizes, workspaces from
    above); a later input signature (a last partial batch, another sequence length) gets at least the first's bytes.

    The first `timed_steps` planned steps time every node; `planned.report()` then gives the measured step time and
    peak beside the simulated ones and the nodes that differ most, and where the measured step is more than 10% off
    the simulated one (`replan_when_off`), the module re-plans once on the measured node times, within the same
    budget, for the steps after; a re-plan that finds no plan (the solver's time limit) fails no step: the current
    plan stays, and the report says why.

    `algorithms` are the convolution algorithms the plan may pick per layer. The default is `("native",)`,
    ATen's own: every step is bitwise plain PyTorch's, and the same from run to run; with `compile=True`, whose
    step is plain PyTorch's to rounding anyway, `COMPILED_ALGORITHMS`: ATen's own kernels on channels-last copies
    (oneDNN's NHWC backward on a CNN with few channels, as Inductor's layout optimisation would take; on the zoo's
    CNNs the loss came out bitwise and the gradients within 3e-6 relative) or on a quarter of the batch at a time
    (a quarter of the scratch, which on the CPU also spares a large convolution glibc's fresh pages on every call;
    batch-split-sum sums the filter gradient over the quarters too, in another order than native's: on
    ResNet-18-small's stem at batch 2048, 1.1e-5 of the largest gradient from native's, which is 1.3e-5 from the
    float64 answer where the sum is 0.5e-5 from it), each where the profile measures it faster or the budget
    needs its smaller workspace; like the eager alternative beside each kernel, the pick follows the measured
    times.
    `algorithms="all"` (every one of executor.engine.conv_algorithms.ALGORITHMS) lets the plan pick per layer by
    measured time and workspace (a smaller budget may fit); the others agree with plain PyTorch to rounding only,
    and which one a run picks can change with the timings (and again at the re-plan) while the plan's memory
    figures stay the same.

    `compile=True` runs each planning node as a kernel Inductor compiled from its ATen operations (nodes alike
    share one), so cheap chains inside a node fuse, while every tensor the schedule acts on stays a real tensor
    at a node boundary; the profile is measured on those kernels. Its step equals plain PyTorch's to the
    rounding fusion changes (not bitwise) and itself from run to run under the same plan (a plan made anew may pick
    the kernel or eager's code per node by other measured times: the plan cache keeps restarts alike); random nodes, in-place batch norms and
    whatever Inductor refuses run eagerly, and `planned.compiled_nodes` says which and why. With
    `compile_regions` (the default), consecutive computations with nothing scheduled between them but frees run as
    one kernel, so that fusion crosses node boundaries (executor/engine/regions.py: within one layer of a repeated module,
    never holding more than the plan's peak); its rounding is the same from run to run.

    `arena=True` (eager replay, a plan with planned addresses): the step writes every node's outputs into their
    planned slot of one arena allocated once, through the operators' out= overloads, so the allocator is asked only
    for what `planned.arena_allowances` names; the arena stays allocated between steps. The default, None, is on
    for a model on a GPU (where the allocator's fragmentation is what runs a planned step out of memory) and off
    on the CPU; `compile=True` turns it off (Inductor's kernels allocate their own outputs).

    `split_loss=True` computes a language model's loss (torch's cross-entropy over an LM head's logits, as
    transformers' causal LM loss is) over chunks of rows, each chunk's gradient made in the forward, so that the
    logits are never whole (executor/capture/split_loss.py): over a large vocabulary they set the floor of every
    plan. Its loss and gradients agree with plain PyTorch's to rounding, not bitwise; float32 only (under autocast
    the loss stays whole, and `planned.loss_notes` says so, as it says what became of each cross-entropy).
    """
    if not isinstance(model, nn.Module):
        raise MososError(f"optimize() takes a torch.nn.Module, not {type(model).__name__}")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise MososError(f"optimize() plans the model itself, not a {type(model).__name__} around it: plan the model, "
                         f"then wrap the planned module (DistributedDataParallel(optimize(model, ...)))")
    _check_planning_arguments(memory_ratio, strategy, time_limit_s, planner_url)
    # the default budget gives way to a ratio; one the caller gave does not (planner.budget.requested_budget)
    budget_bytes, memory_ratio = requested_budget(None if budget is DEFAULT_BUDGET and memory_ratio is not None
                                                  else budget, memory_ratio)
    check_optimizer_argument(optimizer)
    if not callable(loss_fn):
        raise MososError("optimize() needs loss_fn: loss = loss_fn(model(*inputs), targets)")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise MososError(f"kwargs are the model's keyword inputs as a dict, not {type(kwargs).__name__}")
    if isinstance(timed_steps, bool) or not isinstance(timed_steps, int) or timed_steps < 0:
        raise MososError(f"timed_steps is a whole number of steps, at least 0, not {timed_steps!r}")
    if arena is not None and not isinstance(arena, bool):
        raise MososError(f"arena is True, False or None (on a GPU, off on the CPU), not {arena!r}")
    if not isinstance(split_loss, bool):
        raise MososError(f"split_loss is True or False, not {split_loss!r}")
    if arena is None:
        arena = next((p.device for p in model.parameters()), torch.device("cpu")).type == "cuda"
    if cache is not None and not isinstance(cache, (bool, str, os.PathLike)):
        raise MososError(f"cache is True, False, None or a folder (a str or a path), not {type(cache).__name__} "
                         f"{cache!r}")
    options = OptimizeOptions(
        budget_bytes=budget_bytes, memory_ratio=memory_ratio, strategy=strategy, planner_url=planner_url,
        planner_token=planner_token, time_limit_s=time_limit_s, workers=workers, optimizer=optimizer,
        d2h_gb_per_s=d2h_gb_per_s, h2d_gb_per_s=h2d_gb_per_s,
        algorithms=_algorithms(algorithms if algorithms is not None
                               else COMPILED_ALGORITHMS if compile else ("native",)),
        repeats=repeats, warmup=warmup, measuring=measuring, compile=compile, arena=arena and not compile,
        split_loss=split_loss,
    )
    planner = SignaturePlanner(model, loss_fn, options, open_cache(cache), _reporter(progress), device_memory)
    profile, schedule, profiled, key = planner.plan_signature(as_tuple(example_inputs), kwargs, targets)
    return PlannedModule(model, profile, schedule, loss_fn, profiled=profiled, timed_steps=timed_steps,
                         plan_token=key,
                         replan=planner.replan if replan_when_off else None,
                         plan_signature=planner.plan_signature if new_signatures else None,
                         max_signatures=max_signatures, progress=planner.say, compile=compile,
                         compile_regions=compile_regions, device_memory=planner.device_memory,
                         outside_allocator_bytes=planner.outside_allocator_bytes, arena=options.arena)


@dataclass(frozen=True)
class OptimizeOptions:
    """How optimize() plans each input signature: the budget (bytes, or a ratio of each signature's keep-all peak),
    the solver, how the step is measured; checked by optimize() before anything runs."""

    budget_bytes: int | None
    memory_ratio: float | None
    strategy: str
    planner_url: str | None
    planner_token: str | None
    time_limit_s: float
    workers: int | None
    optimizer: object
    d2h_gb_per_s: float | None
    h2d_gb_per_s: float | None
    algorithms: tuple[str, ...]
    repeats: int
    warmup: int
    measuring: str
    compile: bool
    arena: bool = False  # the replay writes into the arena: plans leave room beside it (arena_reserve_bytes)
    split_loss: bool = False  # a language model's loss over chunks of rows (executor.capture.split_loss)

    @property
    def rounding_follows_plan(self) -> bool:
        """A compiled step, or convolution algorithms other than ATen's own, rounds by the plan's picks: a plan taken
        from the cache is then not re-planned on this process's timings (restarts sharing it stay bitwise alike)."""
        return self.compile or any(algorithm != "native" for algorithm in self.algorithms)


class SignaturePlanner:
    """Plans one model, one input signature at a time: capture, measure within the budget and solve, or take the
    plan from the cache; and re-plans on measured node times. The PlannedModule holds its two methods:
    `plan_signature` for a new signature, `replan` after the timed steps."""

    def __init__(self, model: nn.Module, loss_fn: Callable, options: OptimizeOptions, store, say: Callable[[str], None],
                 device_memory: DeviceMemory | None | str = None):
        self.model, self.loss_fn, self.options, self.store, self.say = model, loss_fn, options, store, say
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device_memory = device_memory_of(self.device) if device_memory == "auto" else device_memory
        # what the process held on the device outside PyTorch's allocator when optimize() began (the CUDA context,
        # library handles): a budget in bytes is what the device may hold, so the plans get it less this
        self.outside_allocator_bytes = (self.device_memory.outside_allocator_bytes()
                                        if self.device_memory is not None else 0)
        # a memory ratio is resolved at the first input signature; a later one (a last partial batch, another
        # sequence length) gets the larger of those bytes, the memory the step was given, and the ratio of its own
        # peak (a small batch's own fraction can be below its fixed memory): [bytes, the first signature's shapes]
        self.ratio_resolved_bytes: list = []
        self.taken_from_cache: set[str] = set()
        # profile digest -> what its plans left beside the arena (options.arena): a re-plan leaves it again
        self.arena_reserves: dict[str, int] = {}

    @staticmethod
    def shapes_of(inputs, kwargs, targets, autocast_state: tuple) -> tuple:
        return (tensor_signature(tuple(inputs), dict(kwargs or {})),
                tensor_signature(targets) if targets is not None else None, tuple(autocast_state))

    def key_of(self, inputs, kwargs, targets, autocast_state: tuple) -> PlanKey:
        options = self.options
        shapes = self.shapes_of(inputs, kwargs, targets, autocast_state)
        if options.memory_ratio is not None and self.ratio_resolved_bytes and shapes != self.ratio_resolved_bytes[1]:
            budget_key = {"memory_ratio": options.memory_ratio, "at_least_bytes": self.ratio_resolved_bytes[0]}
        elif options.memory_ratio is not None:
            budget_key = {"memory_ratio": options.memory_ratio}
        else:
            budget_key = {"bytes": self.plan_budget_bytes()}
        return plan_key(
            self.model, self.loss_fn, inputs, kwargs, targets, device=self.device, autocast_state=autocast_state,
            budget=budget_key,
            strategy=options.strategy, optimizer=options.optimizer,
            settings={"measuring": options.measuring, "d2h_gb_per_s": options.d2h_gb_per_s,
                      "h2d_gb_per_s": options.h2d_gb_per_s, "planner": "service" if options.planner_url else "local",
                      "algorithms": list(options.algorithms), **({"compile": True} if options.compile else {}),
                      **({"arena": True} if options.arena else {}),
                      **({"split_loss": True} if options.split_loss else {})},
        )

    def plan_budget_bytes(self) -> int | None:
        """The budget in bytes the plans get: the caller's, less what the device held outside the allocator at the
        start (None: a ratio, resolved per signature, with that memory on top of it)."""
        options = self.options
        if options.budget_bytes is None:
            return None
        left = options.budget_bytes - self.outside_allocator_bytes
        if left <= 0:
            raise BudgetError(
                f"budget {format_bytes(options.budget_bytes)} is no more than the "
                f"{format_bytes(self.outside_allocator_bytes)} this process already holds on {self.device} outside "
                "PyTorch's allocator (the CUDA context, library handles): nothing is left for the step",
                minimum_budget_bytes=None)
        return left

    def make_plan(self, profile: GraphProfile, budget_bytes: int | None, reserve_bytes: int = 0,
                  profiled: ProfiledStep | None = None) -> Schedule:
        """A plan within `budget_bytes`, made within that less `reserve_bytes` (what a step writing into its arena
        holds beside it; with `profiled`, less what it holds in the plan's own order where no plan leaves room for
        any order: `plan_beside_the_arena`): the schedule says the budget it was asked for, which it fits. Where no
        plan leaves the room, one within the whole budget, whose step goes through the allocator."""
        if reserve_bytes and budget_bytes is not None:
            schedule, used_bytes = plan_beside_the_arena(
                profile, budget_bytes, reserve_bytes, self._make_plan, self.say,
                in_order=(lambda: arena_reserve_bytes(profile, profiled, self.device, any_order=False),
                          lambda plan: arena_outside_bytes(profile, profiled, plan, self.device))
                if profiled is not None else None)
            self.arena_reserves[profile.digest()] = used_bytes
            if schedule is not None:
                return schedule
            self.say("planning within the whole budget, and the step goes through the allocator")
        return self._make_plan(profile, budget_bytes)

    def _make_plan(self, profile: GraphProfile, budget_bytes: int | None) -> Schedule:
        options, say = self.options, self.say
        if options.planner_url:
            return plan_remotely(options.planner_url, profile, budget_bytes, None, options.strategy,
                                 options.time_limit_s, options.planner_token, say)
        best = [float("inf")]

        def on_progress(event: dict) -> None:
            # Candidate plans from inner phases report their own objectives; say only what improves the best.
            objective = event.get("objective")
            if objective is not None and objective < best[0]:
                best[0] = objective
                phase = f" ({event['phase']})" if event.get("phase") else ""
                gap = f", gap {100 * event['gap']:.1f}%" if event.get("gap") is not None else ""
                say(f"{event.get('strategy', options.strategy)}{phase}: best {objective:.4g}{gap}")

        # a re-plan runs beside training: it stops when the process exits (STOPPING). Planned addresses only for
        # a step that writes into its arena: placing them plans again within less, or takes a slower plan whose
        # buffers place, where the plan's own do not (on the CPU through the allocator, a loss for nothing)
        return plan(profile, budget_bytes, strategy=options.strategy, time_limit_s=options.time_limit_s,
                    workers=options.workers, progress=on_progress, should_stop=STOPPING.is_set,
                    addresses=options.arena)

    def plan_signature(self, inputs: tuple, kwargs: dict | None,
                       targets) -> tuple[GraphProfile, Schedule, ProfiledStep, PlanKey | None]:
        """Capture, profile within the budget and plan one input signature (or take it from the cache); the key
        it is kept under comes back for a re-plan to replace it. Planned for the autocast regions in force at the
        call; everything it runs itself runs outside them."""
        autocast_state = autocast.autocast_state()
        try:
            with autocast.disabled():
                return self._plan_signature(inputs, kwargs, targets, autocast_state)
        except BudgetError as error:
            outside = self.outside_allocator_bytes
            if outside and self.options.budget_bytes is not None:
                # the smallest budget named is the step's: the device's is that and what is held outside the allocator
                if error.minimum_budget_bytes:
                    error.minimum_budget_bytes += outside
                error.args = (f"{error} (the step's budget is the {format_bytes(self.options.budget_bytes)} given less "
                              f"the {format_bytes(outside)} the device holds outside PyTorch's allocator; a device "
                              "budget names that on top)", *error.args[1:])
            raise

    def measured_before(self, key: PlanKey | None, profiled: ProfiledStep, error: BudgetError) -> GraphProfile | None:
        """Where no measuring pass fits the budget (the scratch of kernels not yet run is bounded from above, and
        the bound is what refuses it), the profile an earlier run measured of this same step within another budget,
        if the cache keeps one: its workspaces are what the kernels took, so the plan needs no bound, and no pass
        runs here. None where none is kept."""
        if key is None or self.store is None:
            return None
        found = self.store.measured_profile(key, profiled.step, self.say)
        if found is None:
            return None
        profile, entry = found
        self.say(f"no measuring pass fits this budget ({error}); planning on the profile of this step measured by "
                 f"an earlier run, kept in {entry}: its kernels' workspaces are measured, not bounded")
        return profile

    def _from_cache(self, key: PlanKey, inputs, kwargs, targets, autocast_state):
        """The kept plan of this signature, where one is kept and its budget is still what this run allows."""
        options, store, say = self.options, self.store, self.say
        model, loss_fn = self.model, self.loss_fn
        cached = store.load(key, model, loss_fn, inputs, kwargs, targets, say, autocast_state)
        if cached is None:
            return None
        profiled = planning_of(cached.step, inputs, kwargs, targets)
        own_bytes = None
        if options.memory_ratio is not None and cached.schedule.budget_bytes is not None:
            # what this ratio gives this signature now (or the first signature's budget, where more): a kept
            # plan made for more (an edited entry, another run's first signature) would raise every later one
            own_bytes = ratio_budget_bytes(profiled, model, inputs, kwargs, targets, options.optimizer,
                                           options.memory_ratio, options.algorithms)
            allowed_bytes = max(own_bytes, self.ratio_resolved_bytes[0]) if self.ratio_resolved_bytes else own_bytes
            if cached.schedule.budget_bytes > allowed_bytes * (1 + RATIO_CACHE_TOLERANCE):
                say(f"cached plan {key.digest[:12]} is not usable (made for a budget of "
                    f"{format_bytes(cached.schedule.budget_bytes)}, above the {format_bytes(allowed_bytes)} "
                    f"memory_ratio={options.memory_ratio:g} gives here): planning again")
                return None
        summary = cached.schedule.summary
        say(f"using the plan kept in {store.plans / key.digest[:12]}... (made "
            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(cached.created))}"
            + (f", budget {format_bytes(cached.schedule.budget_bytes)}" if cached.schedule.budget_bytes else "")
            + "): no profile or solve")
        if summary is not None:
            say(f"plan ({summary.strategy}): step {summary.predicted_step_time_ms:.2f} ms, peak "
                f"{format_bytes(summary.peak_memory_bytes)}")
        if own_bytes is not None and not self.ratio_resolved_bytes:
            self.ratio_resolved_bytes[:] = [own_bytes, self.shapes_of(inputs, kwargs, targets, autocast_state)]
        self.taken_from_cache.add(key.digest)
        return cached.profile, cached.schedule, profiled, key

    def _plan_signature(self, inputs, kwargs, targets, autocast_state):
        options, store, say = self.options, self.store, self.say
        model, loss_fn = self.model, self.loss_fn
        key = self.key_of(inputs, kwargs, targets, autocast_state) if store is not None else None
        kept = self._from_cache(key, inputs, kwargs, targets, autocast_state) if key is not None else None
        if kept is not None:
            return kept
        say("capturing the step with torch.export")
        with preserved(model):  # the capture runs on fake tensors; leave RNG, buffers and gradients as they were
            profiled = plan_step(model, inputs, kwargs, targets, loss_fn, autocast_state,
                                 loss_split=options.split_loss)
        say(f"captured {len(profiled.planning.groups)} planning nodes in "
            f"{profiled.step.export_seconds + profiled.step.joint_seconds:.1f} s")
        for note in profiled.step.loss_notes:
            say(note)
        signature_budget = self.plan_budget_bytes()
        if signature_budget is not None and self.outside_allocator_bytes:
            say(f"budget {format_bytes(signature_budget)} for the step: {format_bytes(options.budget_bytes)} less the "
                f"{format_bytes(self.outside_allocator_bytes)} the device holds outside PyTorch's allocator")
        if options.memory_ratio is not None:
            own_bytes = ratio_budget_bytes(profiled, model, inputs, kwargs, targets, options.optimizer,
                                           options.memory_ratio, options.algorithms, say)
            if not self.ratio_resolved_bytes:
                self.ratio_resolved_bytes[:] = [own_bytes, self.shapes_of(inputs, kwargs, targets, autocast_state)]
            signature_budget = max(own_bytes, self.ratio_resolved_bytes[0])
            say(f"budget {format_bytes(signature_budget)} ({options.memory_ratio:g} of the estimated keep-all peak"
                + (", or the first input signature's budget where that is more)" if signature_budget > own_bytes
                   else ")"))
        kept_profile = None
        try:
            profile, profiled = profile_step(
                model, inputs, loss_fn, targets, kwargs=kwargs,
                optimizer=options.optimizer, repeats=options.repeats, warmup=options.warmup,
                d2h_gb_per_s=options.d2h_gb_per_s, h2d_gb_per_s=options.h2d_gb_per_s, budget_bytes=signature_budget,
                measuring=options.measuring, algorithms=options.algorithms, profiled=profiled, progress=say,
                compile=options.compile,
            )
            say(f"profiled {len(profile.nodes)} nodes; fixed memory {format_bytes(profile.fixed_bytes)}")
        except BudgetError as error:
            kept_profile = self.measured_before(key, profiled, error)
            if kept_profile is None:
                if self.store is not None and error.minimum_budget_bytes:
                    error.args = (f"{error} (the scratch of kernels not yet run is bounded from above here; a plan "
                                  "made at that budget keeps the step's measured profile in the plan cache, and a "
                                  "smaller budget asked later is planned on it)", *error.args[1:])
                raise
            profile = kept_profile
        reserve = arena_reserve_bytes(profile, profiled, self.device) if options.arena else 0
        try:
            schedule = self.make_plan(profile, signature_budget, reserve, profiled)
        except BudgetError as error:
            # the step was just measured within this budget: the measuring pass's schedule is a plan that fits
            schedule = (profiled.measuring.as_plan(profile, signature_budget)
                        if profiled.measuring and kept_profile is None else None)
            if schedule is None:
                if kept_profile is not None:
                    error.args = (f"{error} (planned on the profile an earlier run measured of this step; no "
                                  "measuring pass fits this budget)", *error.args[1:])
                raise
            say(f"no plan found by {options.strategy!r} ({error}); the plan is the schedule the step was measured "
                "under, which fits")
            if options.arena:  # its buffers placed, where they fit
                schedule = addressed(profile, schedule)
        summary = schedule.summary
        if summary is not None:
            say(
                f"plan ({summary.strategy}): step {summary.predicted_step_time_ms:.2f} ms, peak "
                f"{format_bytes(summary.peak_memory_bytes)}, offloaded {format_bytes(summary.offloaded_bytes)}, "
                f"recompute {summary.recompute_time_ms:.2f} ms"
            )
        if key is not None and store.store(key, profiled.step, profile, schedule, say) is not None:
            say(f"plan kept for later runs in {store.plans / key.digest[:12]}...")
        return profile, schedule, profiled, key

    def replan(self, measured: GraphProfile, schedule: Schedule, key: PlanKey | None) -> Schedule | None:
        say = self.say
        if self.options.rounding_follows_plan and key is not None and key.digest in self.taken_from_cache:
            say("a re-plan was asked for, but the plan was taken from the cache and picks kernels that round "
                "differently: kept as it is, so that every run using it runs the same bits")
            return None
        replanned = self.make_plan(measured, schedule.budget_bytes, self.arena_reserves.get(schedule.profile_digest, 0))
        if self.store is not None and key is not None:
            self.store.update(key, measured, replanned, say)
        return replanned

"""vDNN (Rhu et al., MICRO 2016): offload layer inputs in forward, prefetch them one layer ahead in backward.

- Offload: a layer's input feature map is offloaded only when that layer is
  its last forward consumer; the copy is issued with the layer's forward
  compute and the compute stream synchronizes with it at the end of the layer,
  after which the buffer is released (the paper's Fig. 9).
- Prefetch: before a layer's backward compute, `findPrefetchLayer` (Fig. 10)
  searches the earlier layers, nearest first, for one whose input was
  offloaded and not yet prefetched, stopping at the first convolution layer;
  the copy overlaps the current layer's backward and the compute stream waits
  for it at the end of that layer. A layer's backward may be several nodes
  naming it as `forward_node` (a convolution's filter and data gradients):
  the window opens with the first and closes after the last. Anything still on the host when a layer
  needs it is fetched on demand.
- vdnn-all offloads the inputs of every layer, vdnn-conv only those of
  convolutions (op_type containing "conv"). As static policies they use
  either the performance-optimal algorithms (fastest, "(p)") or the
  memory-optimal ones (no or least workspace, "(m)"): the (p) variant when it
  fits, else the (m) one.
- vdnn-dyn follows section III-C: (1) vDNN_all(m) decides whether the network
  can be trained at all; (2) no offloading with the fastest algorithms;
  (3) vDNN_conv(p), then vDNN_all(p); (4) the greedy pass, vDNN_conv then
  vDNN_all, where each layer falls back to slower, smaller-workspace
  algorithms when its fastest does not fit in the memory free at that moment;
  (5) vDNN_all(m). The first configuration that fits, judged by the
  simulator, is the plan.
"""

from __future__ import annotations

from typing import Literal

from planner.attribute_plans import AttributeProgram, GraphFacts, is_convolution, require_transfers
from planner.auto_algorithms import apply_auto
from planner.budget_search import fitting, peak_bytes, plan_within
from planner.liveness import build_schedule
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import strategy
from planner.strategies.keep_all import keep_all_schedule

Policy = Literal["all", "conv"]
Algorithms = Literal["p", "m"]


def offloaded_tensors(profile: GraphProfile, facts: GraphFacts, policy: Policy) -> dict[str, str]:
    """Attributes: a tensor read in backward is swapped when its last forward consumer is an offloading layer."""
    attributes = {}
    for tensor in facts.candidates:
        layer = facts.last_forward_reader[tensor]
        if layer == tensor or profile.node_by_id[layer].kind != "forward":
            continue  # not the input of a layer (read by the loss or by backward only): stays
        if policy == "all" or is_convolution(profile, layer):
            attributes[tensor] = "swap"
    return attributes


class VdnnProgram(AttributeProgram):
    offload_style = "with_last_reader"

    def window_prefetches(self, node_id: str) -> list[str]:
        """A layer's window opens with its first backward node (its filter gradient, when a convolution's
        backward is two nodes), once per layer."""
        node = self.profile.node_by_id[node_id]
        if node.kind != "backward" or node.forward_node is None:
            return []
        if self.facts.backward_of[node.forward_node][0] != node_id:
            return []
        here = self.profile.position[node.forward_node]
        earlier = [layer for layer in self.facts.forward if self.profile.position[layer] < here]
        for layer in reversed(earlier):
            waiting = [t for t in self.offloaded_at.get(layer, []) if t not in self.prefetched]
            if waiting:
                return waiting
            if is_convolution(self.profile, layer):
                return []
        return []

    def window_end(self, node_id: str) -> str:
        """The layer's window closes at the end of its last backward node (its data gradient)."""
        forward_node = self.profile.node_by_id[node_id].forward_node
        return self.facts.backward_of[forward_node][-1] if forward_node is not None else node_id


def implementations(profile: GraphProfile, algorithms: Algorithms) -> dict[str, str]:
    if algorithms == "p":
        return {n: profile.node_by_id[n].fastest.name for n in profile.order}
    return {n: profile.node_by_id[n].smallest_workspace.name for n in profile.order}


def vdnn_schedule(profile: GraphProfile, policy: Policy, algorithms: Algorithms, facts: GraphFacts | None = None) -> Schedule:
    facts = facts or GraphFacts(profile)
    program = VdnnProgram(profile, offloaded_tensors(profile, facts, policy), implementations(profile, algorithms), facts)
    return build_schedule(profile, program.build_steps(), None)


def _with_budget(schedule: Schedule, budget_bytes: int) -> Schedule:
    return schedule.model_copy(update={"budget_bytes": budget_bytes})


def _static(profile: GraphProfile, budget_bytes: int, policy: Policy, options: SolveOptions) -> Schedule:
    name = f"vdnn-{policy}"
    require_transfers(profile, name)
    facts = GraphFacts(profile)
    variants = [vdnn_schedule(profile, policy, algorithms, facts) for algorithms in ("p", "m")]
    peaks = [peak_bytes(profile, variant, name) for variant in variants]

    def attempt(budget: int) -> Schedule | None:
        for variant, peak in zip(variants, peaks):
            if peak <= budget:
                return _with_budget(variant, budget)
        return None

    return plan_within(profile, budget_bytes, name, attempt, min(peaks), options.started())


@strategy("vdnn-all", "vDNN_all: offload every layer's input in forward, prefetch one layer ahead in backward; fastest algorithms if that fits, else memory-optimal ones", needs_transfers=True)
def plan_vdnn_all(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return _static(profile, budget_bytes, "all", options)


@strategy("vdnn-conv", "vDNN_conv: offload convolution inputs in forward, prefetch one layer ahead in backward; fastest algorithms if that fits, else memory-optimal ones", needs_transfers=True)
def plan_vdnn_conv(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return _static(profile, budget_bytes, "conv", options)


def dyn_configurations(profile: GraphProfile, budget_bytes: int, facts: GraphFacts):
    """(label, schedule) in vDNN_dyn's order after the trainability check."""
    yield "base(p)", keep_all_schedule(profile, budget_bytes)
    yield "conv(p)", _with_budget(vdnn_schedule(profile, "conv", "p", facts), budget_bytes)
    yield "all(p)", _with_budget(vdnn_schedule(profile, "all", "p", facts), budget_bytes)
    yield "conv(greedy)", apply_auto(profile, vdnn_schedule(profile, "conv", "p", facts), budget_bytes)
    yield "all(greedy)", apply_auto(profile, vdnn_schedule(profile, "all", "p", facts), budget_bytes)


@strategy("vdnn-dyn", "vDNN_dyn: the first of no offload, vDNN_conv, vDNN_all with the fastest algorithms, then with per-layer fallback to smaller workspaces, then vDNN_all memory-optimal, that fits", needs_transfers=True)
def plan_vdnn_dyn(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    name = "vdnn-dyn"
    require_transfers(profile, name)
    facts = GraphFacts(profile)
    memory_optimal = vdnn_schedule(profile, "all", "m", facts)
    trainable_from = peak_bytes(profile, memory_optimal, name)

    def attempt(budget: int) -> Schedule | None:
        if trainable_from > budget:
            return None  # step 1: not even vDNN_all(m) fits, so the network cannot be trained
        for _, schedule in dyn_configurations(profile, budget, facts):
            if fitting(profile, schedule, budget, name):
                return schedule
        return _with_budget(memory_optimal, budget)

    return plan_within(profile, budget_bytes, name, attempt, trainable_from, options.started())

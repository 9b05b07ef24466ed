"""checkpoint-all: keep, between forward and backward, only what each node's own backward needs.

Every forward tensor that the backward of its own node reads (a ReLU's
output, a pooling's output and indices, a dropout's mask) is a checkpoint
and stays on the device from its forward computation to its last backward
reader. Every other tensor is freed after its last forward reader; when the
backward of some other node needs it (a batch norm's input, which is the
convolution output before it), it is recomputed from the checkpoints just
before that backward runs, and freed after its last read again. Nothing is
offloaded. Algorithms: the fastest; when that plan does not fit, Auto's
choice in the memory left (as chen-sqrt).

This is the baseline that "checkpointing every node" names in the
rematerialization literature, read as the issue defines it. Checkmate's own
`solve_checkpoint_all` recomputes nothing and keeps every forward tensor until
the step ends; this one keeps only what backward reads, each tensor until its
last backward reader, as autograd does (on Checkmate's published VGG19 graph
its literal plan fits batch 162 in 16 GB, this one 222:
benchmarks/results/max_batch.md). On the estimator's VGG networks this one is
keep-all: each tensor a backward reads is the output of a ReLU, a pooling or a
dropout, whose own backward reads it.

A backward node that names no `forward_node` (imported Checkmate graphs)
cannot say whose backward it is, so what it reads is kept.
"""

from __future__ import annotations

from planner.attribute_plans import Attribute, AttributeProgram, GraphFacts
from planner.budget_search import plan_fixed_recompute
from planner.liveness import build_schedule
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import strategy

NAME = "checkpoint-all"


def checkpoint_attributes(profile: GraphProfile, facts: GraphFacts | None = None) -> dict[str, Attribute]:
    """Keep what a node's own backward reads (or an unattributed backward reads); recompute the rest."""
    facts = facts or GraphFacts(profile)
    by_id = profile.node_by_id
    attributes: dict[str, Attribute] = {}
    for tensor in facts.candidates:
        readers = [by_id[reader] for reader in facts.backward_readers[tensor]]
        own = any(reader.forward_node in (tensor, None) for reader in readers)
        attributes[tensor] = "keep" if own else "recompute"
    return attributes


def checkpoint_all_schedule(profile: GraphProfile, facts: GraphFacts | None = None) -> Schedule:
    facts = facts or GraphFacts(profile)
    program = AttributeProgram(profile, checkpoint_attributes(profile, facts), facts=facts)
    return build_schedule(profile, program.build_steps(), None)


@strategy(
    NAME,
    "keep only what each node's own backward reads, recompute the rest from those checkpoints when another "
    "backward needs it; fastest algorithms, Auto when they do not fit",
)
def plan_checkpoint_all(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return plan_fixed_recompute(profile, checkpoint_all_schedule(profile), budget_bytes, NAME, options)

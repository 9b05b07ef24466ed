"""per-block: what a PyTorch user writes instead of a planner, activation checkpointing per block.

`model.gradient_checkpointing_enable()` in transformers, or `torch.utils.checkpoint` around each layer: every
block's input is kept, everything computed inside a block is freed after the forward and recomputed in that
block's backward. Blocks come from the profile's module paths: a module path with a numeric component names a
layer of a repeated container (`transformer.h.3.attn.c_attn` is in block `transformer.h.3`, `layer2.1.conv1` in
`layer2.1`); a container with one layer only is not a block. What lies outside every block (embeddings, the
head, the loss) is kept, as it is under per-block checkpointing.

A tensor made inside a block is kept when something outside that block reads it in the forward (the block's
output, which is the next block's input, or a tensor a later block reuses); the rest is recomputed from those
when backward needs it. Nothing is offloaded. Algorithms: the fastest; Auto's choice when that does not fit.

mosos runs this plan as one of its baselines, so it never returns a plan slower than per-block checkpointing
at a budget where per-block checkpointing fits.
"""

from __future__ import annotations

from collections import defaultdict

from planner.attribute_plans import Attribute, AttributeProgram, GraphFacts
from planner.budget_search import plan_fixed_recompute
from planner.errors import MososError
from planner.liveness import build_schedule
from planner.options import SolveOptions
from planner.profile import GraphProfile
from planner.schedule import Schedule
from planner.strategies import strategy

NAME = "per-block"


class NoBlocks(MososError):
    """The profile's nodes name no repeated module layers, so there is nothing to checkpoint per block."""


def layer_prefix(module: str | None) -> tuple[str, str] | None:
    """(container, block) for a module path inside a numbered layer: ('transformer.h', 'transformer.h.3')."""
    if not module:
        return None
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            return ".".join(parts[:i]), ".".join(parts[: i + 1])
    return None


def blocks_of(profile: GraphProfile) -> dict[str, str]:
    """Forward node id -> its block, for the nodes inside a repeated layer (containers of two layers or more)."""
    layers: dict[str, set[str]] = defaultdict(set)
    placed: dict[str, tuple[str, str]] = {}
    for node in profile.nodes:
        if node.kind != "forward":
            continue
        found = layer_prefix(node.module)
        if found is not None:
            placed[node.id] = found
            layers[found[0]].add(found[1])
    return {node_id: block for node_id, (container, block) in placed.items() if len(layers[container]) >= 2}


def per_block_attributes(profile: GraphProfile, facts: GraphFacts | None = None) -> dict[str, Attribute]:
    facts = facts or GraphFacts(profile)
    block = blocks_of(profile)
    if not block:
        raise NoBlocks(
            f"{profile.name}: no node's module path names a layer of a repeated module (such as 'layers.3'), so "
            "per-block checkpointing has no blocks to checkpoint")
    by_id = profile.node_by_id
    attributes: dict[str, Attribute] = {}
    for tensor in facts.candidates:
        own = block.get(tensor)
        if own is None:
            attributes[tensor] = "keep"
            continue
        read_outside = any(
            by_id[reader].kind != "backward" and block.get(reader) != own for reader in profile.consumers[tensor])
        attributes[tensor] = "keep" if read_outside else "recompute"
    return attributes


def per_block_schedule(profile: GraphProfile, facts: GraphFacts | None = None) -> Schedule:
    facts = facts or GraphFacts(profile)
    program = AttributeProgram(profile, per_block_attributes(profile, facts), facts=facts)
    return build_schedule(profile, program.build_steps(), None)


@strategy(
    NAME,
    "activation checkpointing per block, as transformers' gradient_checkpointing_enable() or torch.utils.checkpoint "
    "around each layer: keep each block's input, recompute the block in its backward (blocks from module paths)",
)
def plan_per_block(profile: GraphProfile, budget_bytes: int | None, options: SolveOptions) -> Schedule:
    return plan_fixed_recompute(profile, per_block_schedule(profile), budget_bytes, NAME, options)

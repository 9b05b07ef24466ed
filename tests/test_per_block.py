"""Per-block checkpointing, what PyTorch users write instead of a planner, as a baseline the planner knows: blocks
from the capture's module paths, each block's input kept and its inside recomputed; mosos never slower than it in
simulation on the zoo's transformers; the plan replays bitwise."""

from __future__ import annotations

import copy

import pytest

from planner.attribute_plans import GraphFacts
from planner.budget import minimum_budget_bytes
from planner.planning import InfeasibleBudget, plan
from planner.profile import GraphProfile
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_peak_bytes
from planner.strategies.mosos import BASELINE_STRATEGIES
from planner.strategies.per_block import NoBlocks, blocks_of, per_block_attributes

FAST = dict(time_limit_s=3.0, workers=1, seed=0)


def _chain(modules: list[str | None]) -> GraphProfile:
    """A chain of forward nodes named by module, their backward, a loss: enough for attributes and a plan."""
    nodes, previous = [], None
    for i, module in enumerate(modules):
        nodes.append({"id": f"f{i}", "kind": "forward", "module": module, "inputs": [previous] if previous else [],
                      "output_bytes": 1000, "implementations": [{"name": "a", "time_ms": 1.0}]})
        previous = f"f{i}"
    nodes.append({"id": "loss", "kind": "loss", "inputs": [previous], "output_bytes": 8,
                  "implementations": [{"name": "a", "time_ms": 0.1}]})
    gradient = "loss"
    for i in reversed(range(len(modules))):
        inputs = [gradient, f"f{i}"] + ([f"f{i - 1}"] if i else [])
        nodes.append({"id": f"b{i}", "kind": "backward", "forward_node": f"f{i}", "inputs": inputs,
                      "output_bytes": 1000, "implementations": [{"name": "a", "time_ms": 2.0}]})
        gradient = f"b{i}"
    return GraphProfile.model_validate({"name": "chain", "hardware": {"name": "test", "memory_capacity_bytes": 10**9},
                                        "provenance": {"source": "handmade"}, "nodes": nodes})


def test_blocks_are_the_layers_of_repeated_containers():
    profile = _chain(["embed", "h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp", "head.0.proj", "head"])
    # 'head.0' is the only layer of its container: not a block; 'embed' and 'head' lie outside every block
    assert blocks_of(profile) == {"f1": "h.0", "f2": "h.0", "f3": "h.1", "f4": "h.1"}


def test_each_blocks_input_is_kept_and_its_inside_recomputed():
    profile = _chain(["embed", "h.0.a", "h.0.b", "h.0.c", "h.1.a", "h.1.b", "h.1.c", "head"])
    attributes = per_block_attributes(profile)
    facts = GraphFacts(profile)
    # the last node of each block is read by the next block (or the head): the block's output, the next one's input
    assert attributes == {"f0": "keep", "f1": "recompute", "f2": "recompute", "f3": "keep", "f4": "recompute",
                          "f5": "recompute", "f6": "keep", "f7": "keep"}
    assert set(attributes) == set(facts.candidates)
    schedule = plan(profile, memory_ratio=1.0, strategy="per-block")
    assert schedule.summary.recompute_time_ms == pytest.approx(4.0)  # f1, f2, f4, f5 once each
    assert simulate(profile, schedule).peak_memory_bytes < keep_all_peak_bytes(profile)


def test_a_profile_without_module_paths_says_so_and_mosos_goes_on_without_it():
    profile = _chain([None] * 6)
    with pytest.raises(NoBlocks, match="no node's module path names a layer of a repeated module"):
        plan(profile, memory_ratio=1.0, strategy="per-block")
    assert "per-block" in BASELINE_STRATEGIES
    assert plan(profile, memory_ratio=0.8, strategy="mosos", **FAST).summary.predicted_step_time_ms > 0




def _zoo_profile(name):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from executor.measure.profiler import profile_step
    from tests.zoo import ZOO

    model, args, kwargs, targets, loss_fn = ZOO[name]()
    profile, _ = profile_step(model, args, loss_fn, targets, kwargs=kwargs, repeats=1, warmup=0,
                              algorithms=("native",))
    return profile, (model, args, kwargs, targets, loss_fn)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "llama"])
def test_mosos_is_never_slower_than_per_block_checkpointing_on_the_zoos_transformers(name):
    profile, _ = _zoo_profile(name)
    assert len(set(blocks_of(profile).values())) == 2  # each zoo transformer has two layers
    per_block = plan(profile, memory_ratio=1.0, strategy="per-block")
    assert per_block.summary.recompute_time_ms > 0
    compared = 0
    for ratio in (0.3, 0.4, 0.5, 0.6, 0.7):
        budget = int(ratio * keep_all_peak_bytes(profile))
        if budget < minimum_budget_bytes(profile):
            continue  # below any plan's floor (the tiny zoo models' fixed memory and widest node)
        try:
            mosos = plan(profile, budget, strategy="mosos", **FAST)
        except InfeasibleBudget:
            assert per_block.summary.peak_memory_bytes > budget, f"per-block fits at {ratio} where mosos found nothing"
            continue
        assert simulate(profile, mosos, budget).peak_memory_bytes <= budget
        if per_block.summary.peak_memory_bytes <= budget:
            compared += 1
            assert mosos.summary.predicted_step_time_ms <= per_block.summary.predicted_step_time_ms + 1e-9, ratio
    # and at per-block's own peak, where it is the obvious choice
    at_its_peak = plan(profile, per_block.summary.peak_memory_bytes, strategy="mosos", **FAST)
    assert at_its_peak.summary.predicted_step_time_ms <= per_block.summary.predicted_step_time_ms + 1e-9
    assert compared >= 1


@pytest.mark.slow
def test_the_per_block_plan_replays_bitwise():
    import torch

    from executor.replay.optimize import optimize
    from tests.zoo import assert_trains_like_plain

    profile, (model, args, kwargs, targets, loss_fn) = _zoo_profile("gpt2")
    plain = copy.deepcopy(model)
    planned = optimize(model, args, loss_fn, targets=targets, kwargs=kwargs, memory_ratio=1.0, strategy="per-block",
                       progress=False, cache=False, replan_when_off=False)
    assert planned.schedule.summary.strategy == "per-block"
    torch.manual_seed(3)
    loss = planned(*args, targets=targets, **kwargs)
    loss.backward()
    assert_trains_like_plain(model, plain, loss, args, kwargs, targets, loss_fn, seed=3)

"""The heuristic baselines on small hand-made profiles: valid plans, honest minimum budgets, the policies' signatures."""

from __future__ import annotations

import pytest

from planner.budget import minimum_budget_bytes
from planner.errors import MososError
from planner.planning import InfeasibleBudget, plan
from planner.schedule import Compute, Offload, Prefetch, Wait
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_peak_bytes
from tests.conftest import make_profile, node

MB = 1_000_000
BASELINES = ["auto", "vdnn-all", "vdnn-conv", "vdnn-dyn", "chen-sqrt", "checkpoint-all", "swap-recompute-heuristic"]
OFFLOADING = ["vdnn-all", "vdnn-conv", "vdnn-dyn", "swap-recompute-heuristic"]


def algorithms(fast_ms=1.0, workspace=6 * MB):
    """fft-like fast with a big workspace, gemm in between, implicit-gemm-like slow with none."""
    return [
        {"name": "fft", "time_ms": fast_ms, "workspace_bytes": workspace},
        {"name": "gemm", "time_ms": 2 * fast_ms, "workspace_bytes": workspace // 3},
        {"name": "implicit", "time_ms": 4 * fast_ms, "workspace_bytes": 0},
    ]


def conv_net(layers=9, bandwidth=1.0, fast_ms=1.0, split=False):
    """x -> conv, conv, relu, conv, conv, relu ... -> loss, and a backward node per layer reading what it needs.

    With `split`, a convolution's backward is two nodes, as in estimated profiles: the filter gradient (reads the
    gradient and the layer's input, makes nothing the graph reads) then the data gradient (reads the gradient only);
    the first convolution has no data gradient."""
    nodes = [node("x", output_bytes=2 * MB, time_ms=0.5, op_type="input")]
    previous = "x"
    for i in range(layers):
        if i % 3 == 2:
            nodes.append(node(f"l{i}", inputs=[previous], output_bytes=3 * MB, time_ms=0.1, op_type="relu"))
        else:
            nodes.append(node(f"l{i}", inputs=[previous], output_bytes=3 * MB, op_type="conv2d", implementations=algorithms(fast_ms)))
        previous = f"l{i}"
    nodes.append(node("loss", kind="loss", inputs=[previous], output_bytes=10, time_ms=0.1))
    gradient = "loss"
    for i in reversed(range(layers)):
        source = f"l{i - 1}" if i else "x"
        if i % 3 == 2:
            nodes.append(node(f"l{i}:bwd", kind="backward", inputs=[gradient, f"l{i}"], output_bytes=3 * MB, time_ms=0.1, forward_node=f"l{i}"))
        elif split:
            nodes.append(node(f"l{i}:bwd_filter", kind="backward", inputs=[gradient, source], output_bytes=0,
                              forward_node=f"l{i}", implementations=algorithms(fast_ms / 2)))
            if i == 0:
                break
            nodes.append(node(f"l{i}:bwd_data", kind="backward", inputs=[gradient], output_bytes=3 * MB,
                              forward_node=f"l{i}", implementations=algorithms(fast_ms / 2)))
            gradient = f"l{i}:bwd_data"
            continue
        else:
            nodes.append(
                node(f"l{i}:bwd", kind="backward", inputs=[gradient, source], output_bytes=3 * MB, forward_node=f"l{i}", implementations=algorithms(fast_ms))
            )
        gradient = f"l{i}:bwd"
    return make_profile(nodes, fixed_bytes=MB, d2h=bandwidth, h2d=bandwidth)


def skip_net(bandwidth=2.0):
    """A small U-Net: encoder outputs are read again by the decoder, so few places cut the graph in one tensor."""
    conv = dict(op_type="conv2d", implementations=algorithms())
    nodes = [
        node("x", output_bytes=2 * MB, time_ms=0.5, op_type="input"),
        node("e1", inputs=["x"], output_bytes=4 * MB, **conv),
        node("e2", inputs=["e1"], output_bytes=2 * MB, **conv),
        node("e3", inputs=["e2"], output_bytes=1 * MB, **conv),
        node("d3", inputs=["e3"], output_bytes=2 * MB, **conv),
        node("d2", inputs=["d3", "e2"], output_bytes=4 * MB, **conv),
        node("d1", inputs=["d2", "e1"], output_bytes=2 * MB, **conv),
        node("loss", kind="loss", inputs=["d1"], output_bytes=10, time_ms=0.1),
        node("d1:bwd", kind="backward", inputs=["loss", "d2", "e1"], output_bytes=4 * MB, forward_node="d1", **conv),
        node("d2:bwd", kind="backward", inputs=["d1:bwd", "d3", "e2"], output_bytes=2 * MB, forward_node="d2", **conv),
        node("d3:bwd", kind="backward", inputs=["d2:bwd", "e3"], output_bytes=1 * MB, forward_node="d3", **conv),
        node("e3:bwd", kind="backward", inputs=["d3:bwd", "e2"], output_bytes=2 * MB, forward_node="e3", **conv),
        node("e2:bwd", kind="backward", inputs=["e3:bwd", "d2:bwd", "e1"], output_bytes=4 * MB, forward_node="e2", **conv),
        node("e1:bwd", kind="backward", inputs=["e2:bwd", "d1:bwd", "x"], output_bytes=2 * MB, forward_node="e1", **conv),
    ]
    return make_profile(nodes, fixed_bytes=MB, d2h=bandwidth, h2d=bandwidth)


def valid(profile, schedule, budget, strategy):
    """The plan replays within the budget and its summary is the simulator's."""
    assert schedule.summary is not None and schedule.summary.strategy == strategy
    result = simulate(profile, schedule, budget_bytes=budget, keep_timeline=False)
    assert result.peak_memory_bytes <= budget
    assert result.step_time_ms == pytest.approx(schedule.summary.predicted_step_time_ms)
    return result


def operations(schedule, kind):
    return [(stage.node, op) for stage in schedule.stages for op in stage.operations if isinstance(op, kind)]


@pytest.mark.parametrize("strategy", BASELINES)
@pytest.mark.parametrize("make", [conv_net, skip_net, "split_conv_net"])
def test_plan_validates_at_a_budget_where_it_fits(strategy, make):
    profile = conv_net(split=True) if make == "split_conv_net" else make()
    budget = keep_all_peak_bytes(profile)
    valid(profile, plan(profile, budget, strategy=strategy), budget, strategy)


@pytest.mark.parametrize("strategy", BASELINES)
@pytest.mark.parametrize("make", [conv_net, skip_net, "expand_net", "split_conv_net"])
def test_too_small_a_budget_gives_a_minimum_that_really_is_feasible(strategy, make):
    profile = {"expand_net": expand_net, "split_conv_net": lambda: conv_net(split=True)}.get(make, make)()
    floor = minimum_budget_bytes(profile)  # no plan of any strategy fits below this
    try:
        schedule = plan(profile, floor, strategy=strategy)
    except InfeasibleBudget as error:
        minimum = error.minimum_budget_bytes
        assert minimum is not None and minimum > floor
        assert str(minimum) in str(error)
        valid(profile, plan(profile, minimum, strategy=strategy), minimum, strategy)
        with pytest.raises(InfeasibleBudget):
            plan(profile, minimum - 1, strategy=strategy)
    else:
        assert make != skip_net, "on the U-Net every baseline needs more than the floor"
        valid(profile, schedule, floor, strategy)


@pytest.mark.parametrize("strategy", BASELINES)
def test_a_roomy_budget_costs_no_more_than_a_tight_one(strategy):
    profile = conv_net(bandwidth=3.0)
    roomy = plan(profile, keep_all_peak_bytes(profile), strategy=strategy)
    try:
        tight = plan(profile, 20 * MB, strategy=strategy)
    except InfeasibleBudget:
        return
    assert roomy.summary.predicted_step_time_ms <= tight.summary.predicted_step_time_ms + 1e-9


def test_keep_all_holds_a_budget_it_is_given():
    """Without a budget keep-all is the lower bound; given one it is a plan like any other, never 'feasible' over it."""
    profile = conv_net()
    peak = keep_all_peak_bytes(profile)
    assert plan(profile, strategy="keep-all").budget_bytes is None
    roomy = plan(profile, peak, strategy="keep-all")
    assert roomy.budget_bytes == peak and roomy.summary.peak_memory_bytes == peak
    with pytest.raises(InfeasibleBudget, match="keeping every tensor peaks at") as refused:
        plan(profile, peak - 1, strategy="keep-all")
    assert refused.value.minimum_budget_bytes == peak


def test_auto_is_keep_all_when_everything_fits_and_falls_back_when_not():
    profile = conv_net()
    peak = keep_all_peak_bytes(profile)
    keep_all = plan(profile, strategy="keep-all")
    roomy = plan(profile, peak, strategy="auto")
    assert roomy.summary.predicted_step_time_ms == keep_all.summary.predicted_step_time_ms
    assert roomy.summary.implementations_changed == 0
    tight = plan(profile, peak - 3 * MB, strategy="auto")
    valid(profile, tight, peak - 3 * MB, "auto")
    assert tight.summary.implementations_changed > 0
    assert tight.summary.offloaded_bytes == 0 and tight.summary.recompute_time_ms == 0


@pytest.mark.parametrize("strategy", ["vdnn-all", "vdnn-conv"])
def test_vdnn_offloads_in_forward_and_prefetches_one_layer_ahead(strategy):
    profile = conv_net(bandwidth=10.0)
    budget = keep_all_peak_bytes(profile)
    schedule = plan(profile, budget, strategy=strategy)
    result = valid(profile, schedule, budget, strategy)
    assert result.offloaded_bytes > 0 and result.prefetched_bytes == result.offloaded_bytes
    kind = {n.id: n.kind for n in profile.nodes}
    offloads = operations(schedule, Offload)
    assert offloads and all(kind[stage] == "forward" for stage, _ in offloads)
    # issued with the layer that reads the tensor last, and waited for at that layer's end
    for stage_node, op in offloads:
        assert op.tensor in profile.node_by_id[stage_node].inputs
    waits = {(stage, op.tensor) for stage, op in operations(schedule, Wait) if op.transfer == "offload"}
    assert {(stage, op.tensor) for stage, op in offloads} == waits
    prefetches = operations(schedule, Prefetch)
    assert {op.tensor for _, op in prefetches} == {op.tensor for _, op in offloads}
    # vDNN's findPrefetchLayer: while layer m runs backward, the input of an earlier layer is fetched
    ahead = 0
    for stage_node, op in prefetches:
        assert kind[stage_node] == "backward"
        reader_layer = profile.node_by_id[stage_node].forward_node
        if op.tensor not in profile.node_by_id[stage_node].inputs:
            ahead += 1
            assert profile.position[op.tensor] < profile.position[reader_layer]
    assert ahead > 0
    if strategy == "vdnn-conv":
        conv_inputs = {
            source for n in profile.nodes if n.kind == "forward" and "conv" in n.op_type for source in n.inputs
        }
        assert {op.tensor for _, op in offloads} <= conv_inputs


def pooled_net(split: bool):
    """x -> c0 (conv) -> a1, a2 (pooling-like: their backward reads their input) -> c3 (conv) -> loss."""
    conv = dict(op_type="conv2d", implementations=algorithms())
    nodes = [
        node("x", output_bytes=2 * MB, time_ms=0.5, op_type="input"),
        node("c0", inputs=["x"], output_bytes=3 * MB, **conv),
        node("a1", inputs=["c0"], output_bytes=3 * MB, time_ms=2.0, op_type="max_pool2d"),
        node("a2", inputs=["a1"], output_bytes=3 * MB, time_ms=2.0, op_type="max_pool2d"),
        node("c3", inputs=["a2"], output_bytes=3 * MB, **conv),
        node("loss", kind="loss", inputs=["c3"], output_bytes=10, time_ms=0.1),
    ]
    if split:
        nodes += [
            node("c3:bwd_filter", kind="backward", inputs=["loss", "a2"], output_bytes=0, forward_node="c3", **conv),
            node("c3:bwd_data", kind="backward", inputs=["loss"], output_bytes=3 * MB, forward_node="c3", **conv),
        ]
        gradient = "c3:bwd_data"
    else:
        nodes.append(node("c3:bwd", kind="backward", inputs=["loss", "a2"], output_bytes=3 * MB, forward_node="c3", **conv))
        gradient = "c3:bwd"
    nodes += [
        node("a2:bwd", kind="backward", inputs=[gradient, "a1"], output_bytes=3 * MB, time_ms=2.0, forward_node="a2"),
        node("a1:bwd", kind="backward", inputs=["a2:bwd", "c0"], output_bytes=3 * MB, time_ms=2.0, forward_node="a1"),
        node("c0:bwd_filter" if split else "c0:bwd", kind="backward", inputs=["a1:bwd", "x"], output_bytes=0,
             forward_node="c0", **conv),
    ]
    return make_profile(nodes, fixed_bytes=MB, d2h=10.0, h2d=10.0)


def test_vdnn_opens_one_prefetch_window_per_layer_when_a_convolution_backward_is_two_nodes():
    """findPrefetchLayer runs once per layer: with the first of its backward nodes, waited for after the last."""
    windows = {}
    for split in (False, True):
        profile = pooled_net(split)
        budget = keep_all_peak_bytes(profile)
        schedule = plan(profile, budget, strategy="vdnn-all")
        valid(profile, schedule, budget, "vdnn-all")
        by_id = profile.node_by_id
        ahead = [(stage, op.tensor) for stage, op in operations(schedule, Prefetch) if op.tensor not in by_id[stage].inputs]
        waits = {op.tensor: stage for stage, op in operations(schedule, Wait) if op.transfer == "prefetch"}
        windows[split] = [(by_id[stage].forward_node, tensor, by_id[waits[tensor]].forward_node) for stage, tensor in ahead]
        if split:  # issued with c3's filter gradient, waited for once its data gradient has run
            assert [(stage, waits[tensor]) for stage, tensor in ahead if by_id[stage].forward_node == "c3"] == [
                ("c3:bwd_filter", "c3:bwd_data")
            ]
    assert windows[True] == windows[False] == [("c3", "a1", "c3"), ("a2", "c0", "a2"), ("a1", "x", "a1")]


def test_vdnn_static_policies_fall_back_to_memory_optimal_algorithms():
    profile = conv_net(bandwidth=10.0)
    performance = plan(profile, keep_all_peak_bytes(profile), strategy="vdnn-all")
    assert performance.summary.implementations_changed == 0
    with pytest.raises(InfeasibleBudget) as caught:
        plan(profile, minimum_budget_bytes(profile), strategy="vdnn-all")
    memory = plan(profile, caught.value.minimum_budget_bytes, strategy="vdnn-all")
    assert memory.summary.peak_memory_bytes < performance.summary.peak_memory_bytes
    chosen = [op.implementation for _, op in operations(memory, Compute)]
    assert "implicit" in chosen and "fft" not in chosen


def test_vdnn_dyn_prefers_no_offload_then_offload_then_slower_algorithms():
    profile = conv_net(bandwidth=10.0)
    peak = keep_all_peak_bytes(profile)
    assert plan(profile, peak, strategy="vdnn-dyn").summary.offloaded_bytes == 0
    static_all = plan(profile, peak, strategy="vdnn-all").summary.peak_memory_bytes
    with_offload = plan(profile, static_all, strategy="vdnn-dyn")
    assert with_offload.summary.offloaded_bytes > 0 and with_offload.summary.implementations_changed == 0
    with pytest.raises(InfeasibleBudget) as caught:
        plan(profile, minimum_budget_bytes(profile), strategy="vdnn-dyn")
    smallest = plan(profile, caught.value.minimum_budget_bytes, strategy="vdnn-dyn")
    assert smallest.summary.implementations_changed > 0
    assert smallest.summary.predicted_step_time_ms >= with_offload.summary.predicted_step_time_ms


@pytest.mark.parametrize("make", [conv_net, skip_net])
def test_chen_sqrt_recomputes_and_lowers_the_peak(make):
    profile = make()
    peak = keep_all_peak_bytes(profile)
    schedule = plan(profile, peak, strategy="chen-sqrt")
    result = valid(profile, schedule, peak, "chen-sqrt")
    assert result.recompute_time_ms > 0
    assert result.peak_memory_bytes < peak
    assert result.offloaded_bytes == 0
    assert len(schedule.compute_order) > len(profile.order)


def test_chen_sqrt_keeps_about_sqrt_n_checkpoints_on_a_chain():
    from planner.attribute_plans import GraphFacts
    from planner.strategies.chen_sqrt import checkpoints

    profile = conv_net(layers=15)
    facts = GraphFacts(profile)
    _, boundaries = checkpoints(profile, facts)
    assert 2 <= len(boundaries) <= 5  # 16 forward nodes: segments of 4


def test_swap_recompute_swaps_what_hides_behind_compute():
    profile = conv_net(bandwidth=3.0)
    budget = keep_all_peak_bytes(profile)
    schedule = plan(profile, budget, strategy="swap-recompute-heuristic")
    result = valid(profile, schedule, budget, "swap-recompute-heuristic")
    assert result.offloaded_bytes > 0
    assert result.stall_time_ms == 0  # it swaps only what hides, keeps the rest
    assert result.step_time_ms == plan(profile, strategy="keep-all").summary.predicted_step_time_ms


def expand_net():
    """Cheap layers that make big tensors from small ones over a slow link: recomputing beats swapping."""
    slow_conv = dict(op_type="conv2d", implementations=[{"name": "only", "time_ms": 2.0, "workspace_bytes": 0}])
    nodes = [node("x", output_bytes=MB, time_ms=0.1, op_type="input")]
    previous = "x"
    for i in range(4):
        nodes.append(node(f"small{i}", inputs=[previous], output_bytes=MB, **slow_conv))
        nodes.append(node(f"big{i}", inputs=[f"small{i}"], output_bytes=8 * MB, time_ms=0.05, op_type="expand"))
        previous = f"big{i}"
    nodes.append(node("loss", kind="loss", inputs=[previous], output_bytes=10, time_ms=0.1))
    gradient = "loss"
    for i in reversed(range(4)):
        nodes.append(node(f"big{i}:bwd", kind="backward", inputs=[gradient, f"big{i}", f"small{i}"], output_bytes=MB, time_ms=0.05, forward_node=f"big{i}"))
        source = f"big{i - 1}" if i else "x"
        nodes.append(node(f"small{i}:bwd", kind="backward", inputs=[f"big{i}:bwd", source], output_bytes=MB, forward_node=f"small{i}", **slow_conv))
        gradient = f"small{i}:bwd"
    return make_profile(nodes, fixed_bytes=MB, d2h=1.0, h2d=1.0)


def test_swap_recompute_turns_stalling_swaps_into_recomputes():
    profile = expand_net()
    budget = keep_all_peak_bytes(profile) // 2
    schedule = plan(profile, budget, strategy="swap-recompute-heuristic")
    result = valid(profile, schedule, budget, "swap-recompute-heuristic")
    assert result.recompute_time_ms > 0
    recomputed = [n for n in schedule.compute_order if schedule.compute_order.count(n) > 1]
    assert recomputed and all(n.startswith("big") for n in recomputed)


@pytest.mark.parametrize("strategy", OFFLOADING)
def test_offloading_strategies_explain_a_profile_without_bandwidth(strategy):
    profile = make_profile(
        [
            node("a", output_bytes=MB),
            node("loss", kind="loss", inputs=["a"], output_bytes=10),
            node("a:bwd", kind="backward", inputs=["loss", "a"], output_bytes=MB, forward_node="a"),
        ]
    )
    with pytest.raises(MososError, match="no transfer bandwidth"):
        plan(profile, 10 * MB, strategy=strategy)


@pytest.mark.parametrize("strategy", ["auto", "chen-sqrt"])
def test_recompute_and_algorithm_strategies_need_no_bandwidth(strategy):
    profile = conv_net(bandwidth=None)
    budget = keep_all_peak_bytes(profile)
    valid(profile, plan(profile, budget, strategy=strategy), budget, strategy)


@pytest.mark.parametrize("strategy", BASELINES)
def test_the_same_question_gets_the_same_plan(strategy):
    profile = skip_net()
    budget = keep_all_peak_bytes(profile) - 2 * MB
    first = plan(profile, budget, strategy=strategy).to_json()
    assert plan(profile, budget, strategy=strategy).to_json() == first

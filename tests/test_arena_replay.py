"""The replay writing into the arena (issue 44): each node's outputs go into the slot the plan placed them at.

A planned step with `arena=True` must compute exactly what plain PyTorch computes (bitwise, every zoo model,
every kind of plan: keep-all, mosos within a budget, recompute-heavy, offload-heavy), keep the ledger's peak the
simulator's, ask the allocator for nothing a node written by out= overloads used to allocate (what it still
allocates is what the program names, `arena_allowances`), and hold beside the arena no more than the program's
`outside_arena_bytes`, which the budget must have room for.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from executor.engine import arena  # noqa: E402
from executor.engine.schedules import offload_everything_schedule, recompute_everything_schedule  # noqa: E402
from executor.measure.profiler import profile_step  # noqa: E402
from executor.replay.replay import PlannedModule  # noqa: E402
from planner.planning import addressed, plan  # noqa: E402
from tests.zoo import ZOO, plannable_ratio  # noqa: E402

aten = torch.ops.aten


def test_out_overloads_are_found_and_generated_copies_named():
    assert arena.out_overload(aten.mm.default)[0] is aten.mm.out
    assert arena.out_overload(aten.add.Tensor)[0] is aten.add.out
    overload, names = arena.out_overload(aten.native_batch_norm.default)
    assert overload is aten.native_batch_norm.out and names == ("out", "save_mean", "save_invstd")
    assert arena.out_overload(aten.threshold_backward.default)[1] == ("grad_input",)
    # ATen generates convolution.out as the functional call and a copy: it allocates anyway
    assert arena.out_overload(aten.convolution.default) == arena.OUT_OVERLOAD_COPIES
    assert arena.out_overload(aten.view.default) == arena.NO_OUT_OVERLOAD
    assert arena.out_overload(aten._to_copy.default) == arena.NO_OUT_OVERLOAD


def test_out_overloads_read_from_the_schema_where_torch_has_no_out_tag(monkeypatch):
    """torch 2.11 (the GPU image) has no Tag.out: the schema's keyword-only written arguments name the same
    overloads, on every aten operator, and the same out= overloads are found."""
    overloads = [getattr(getattr(aten, name), overload) for name in dir(aten)
                 if isinstance(getattr(aten, name, None), torch._ops.OpOverloadPacket)
                 for overload in getattr(aten, name).overloads()]
    tagged = {str(op) for op in overloads if torch.Tag.out in op.tags}
    ops = (aten.mm.default, aten.add.Tensor, aten.native_batch_norm.default, aten.convolution.default,
           aten.threshold_backward.default, aten.view.default, aten.native_layer_norm.default)
    found = [arena.out_overload(op) for op in ops]

    class TagsOf211:
        def __getattr__(self, name):
            if name == "out":
                raise AttributeError(name)
            return getattr(torch._C.Tag, name)

    monkeypatch.setattr(torch, "Tag", TagsOf211())
    arena.out_overload.cache_clear()
    try:
        assert len(tagged) > 500
        assert {str(op) for op in overloads if arena._is_out_overload(op)} == tagged
        assert [arena.out_overload(op) for op in ops] == found
    finally:
        arena.out_overload.cache_clear()


def test_several_results_share_one_slot_widest_elements_first():
    results = [((3,), (1,), torch.float32, "cpu"), ((2, 2), (2, 1), torch.float64, "cpu"),
               ((5,), (1,), torch.int8, "cpu")]
    layouts = arena.pack(128, 12 + 32 + 5, results)
    assert [layout.offset_bytes for layout in layouts] == [128 + 32, 128, 128 + 44]
    assert all(layout.offset_bytes % layout.dtype.itemsize == 0 for layout in layouts)
    assert arena.pack(128, 12 + 32 + 5 + 64, results) is None  # not the planned size: the node keeps the allocator's
    buffer = torch.zeros(256, dtype=torch.uint8)
    view = arena.view(buffer, layouts[1])
    view.fill_(1.5)
    assert view.untyped_storage().data_ptr() == buffer.data_ptr() and buffer[128:160].any() and not buffer[:128].any()


def _plain(model, args, kwargs, targets, loss_fn):
    output = model(*args, **kwargs)
    return loss_fn(output, targets) if targets is not None else loss_fn(output)


def _profile(model, args, kwargs, targets, loss_fn):
    return profile_step(model, args, loss_fn, targets, kwargs=kwargs, repeats=1, warmup=0, algorithms=("native",),
                        d2h_gb_per_s=10, h2d_gb_per_s=10, optimizer="momentum")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_the_zoo_trains_bitwise_like_plain_pytorch_writing_into_the_arena(name):
    model, args, kwargs, targets, loss_fn = ZOO[name](torch.float32)
    profile, captured = _profile(model, args, kwargs, targets, loss_fn)
    schedules = {
        "keep-all": plan(profile, strategy="keep-all"),
        "mosos": plan(profile, memory_ratio=plannable_ratio(profile), strategy="mosos", time_limit_s=2, workers=1,
                      seed=0),
        "recompute-heavy": recompute_everything_schedule(profile),
        "offload-heavy": offload_everything_schedule(profile),
    }
    for kind, schedule in schedules.items():
        # the replay is tested on the plan's addresses without its budget: whether the arena and what the allocator
        # still holds beside it fit a budget is the refusal's test below
        schedule = addressed(profile, schedule.model_copy(update={"budget_bytes": None}))
        assert schedule.arena_bytes is not None, kind
        planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
        planned = PlannedModule(planned_model, profile, schedule, loss_fn, profiled=captured, strict=True, arena=True)
        plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=0.9)
        planned_optimizer = torch.optim.SGD(planned_model.parameters(), lr=0.05, momentum=0.9)
        for step in range(2):  # the second step reuses the slots the first wrote
            for optimizer in (plain_optimizer, planned_optimizer):
                optimizer.zero_grad()
            torch.manual_seed(3 + step)
            loss = planned(*args, targets=targets, **kwargs)
            loss.backward()
            torch.manual_seed(3 + step)
            plain = _plain(plain_model, args, kwargs, targets, loss_fn)
            plain.backward()
            assert torch.equal(loss.detach(), plain.detach()), f"{kind}, step {step}"
            for (key, a), (_, b) in zip(planned_model.named_parameters(), plain_model.named_parameters()):
                assert (a.grad is None) == (b.grad is None), f"{kind}: {key}"
                assert a.grad is None or torch.equal(a.grad, b.grad), f"{kind}, step {step}: {key}"
            for optimizer in (plain_optimizer, planned_optimizer):
                optimizer.step()
            assert planned.peak_memory_bytes == planned.simulated_peak_bytes, kind
        for (key, a), (_, b) in zip(planned_model.state_dict().items(), plain_model.state_dict().items()):
            assert torch.equal(a, b), f"{kind}: {key} differs after two steps"
        assert planned.arena_bytes == schedule.arena_bytes, kind
        # beside the arena, the allocator holds no more than the program says it may (the copies' sources, the
        # workspaces of operations allocating for themselves, nodes kept out) and the step's new .grad tensors
        from executor.measure.allocations import AllocationTrace

        planned_model.zero_grad(set_to_none=True)
        with AllocationTrace() as trace:
            planned(*args, targets=targets, **kwargs).backward()
        gradients = sum(p.grad.untyped_storage().nbytes() for p in planned_model.parameters() if p.grad is not None)
        outside = planned._prepared.program.outside_arena_bytes
        assert trace.peak_bytes <= outside + gradients, (kind, trace.peak_bytes, outside, gradients)
        allowances = planned.arena_allowances
        assert allowances is not None and set(allowances) <= {node.id for node in profile.nodes}, kind
        assert planned._prepared.program.written, f"{kind}: no node written in place"


def _allocated_bytes(planned, model, args, targets) -> int:
    """Bytes the allocator handed out during one step (after two warm-up steps), from its own events."""
    from executor.measure.allocations import _allocations, _Session

    for _ in range(2):
        planned(*args, targets=targets).backward()
        model.zero_grad(set_to_none=True)
    session = _Session()
    session.start()
    try:
        planned(*args, targets=targets).backward()
    finally:
        events = _allocations(session.stop())
    model.zero_grad(set_to_none=True)
    return sum(size for _, size in events if size > 0)


@pytest.mark.parametrize("kind", ["keep-all", "recompute-heavy", "offload-heavy"])
def test_a_step_in_the_arena_allocates_only_what_its_allowances_name(kind):
    """Against the same plan replayed through the allocator, a step writing into the arena allocates exactly the
    bytes the program placed fewer (outputs out= overloads write into their slots, values made and dropped inside a
    node in its workspace slot, prefetches into their slots): everything else it still allocates belongs to a node
    `arena_allowances` names, with the reason."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                torch.nn.LayerNorm(128), torch.nn.Dropout(0.1), torch.nn.Linear(128, 128),
                                torch.nn.Tanh(), torch.nn.Linear(128, 10))
    inputs, targets = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss_fn = torch.nn.functional.cross_entropy
    profile, captured = _profile(model, (inputs,), {}, targets, loss_fn)
    schedule = {"keep-all": lambda: plan(profile, strategy="keep-all"),
                "recompute-heavy": lambda: recompute_everything_schedule(profile),
                "offload-heavy": lambda: offload_everything_schedule(profile)}[kind]()
    schedule = addressed(profile, schedule)
    allocated = {}
    for use_arena in (False, True):
        copied = copy.deepcopy(model)
        planned = PlannedModule(copied, profile, schedule, loss_fn, profiled=captured, arena=use_arena)
        allocated[use_arena] = _allocated_bytes(planned, copied, (inputs,), targets)
    program = planned._prepared.program
    nodes = profile.node_by_id
    written = program.written
    assert written and set(program.allowances).isdisjoint(written - {
        node for node, reason in program.allowances.items() if reason == arena.INTERMEDIATES})
    saved = sum(spared for _, spared in program.placed)
    saved += sum(nodes[op.tensor].size_bytes for _, _, op in schedule.operations()
                 if op.op == "prefetch" and op.tensor in program.prefetched_into)
    assert allocated[False] - allocated[True] == saved, (allocated, saved, program.allowances)
    assert saved > 0


@pytest.mark.parametrize("kind", ["keep-all", "recompute-heavy"])
def test_what_the_allocator_holds_beside_the_arena_is_counted_in_the_programs_order(kind):
    """Nodes kept out of the arena (the in-place CNN's values that a scatter reads through their whole storage) are
    beside it only while they live: the program's bound is the most at one moment of its own order, not every such
    node at once (three times less here, which a budget no longer gives up), and what a step really holds beside
    the arena stays within it. A plan not yet made still gets room for any order (`arena_reserve_bytes`)."""
    from executor.measure.allocations import AllocationTrace
    from executor.replay.replay import arena_reserve_bytes

    model, args, kwargs, targets, loss_fn = ZOO["inplace-cnn"](torch.float32)
    profile, captured = _profile(model, args, kwargs, targets, loss_fn)
    schedule = {"keep-all": lambda: plan(profile, strategy="keep-all"),
                "recompute-heavy": lambda: recompute_everything_schedule(profile)}[kind]()
    schedule = addressed(profile, schedule.model_copy(update={"budget_bytes": None}))
    planned_model = copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile, schedule, loss_fn, profiled=captured, arena=True, ledger=False)
    for _ in range(2):
        planned(*args, targets=targets, **kwargs).backward()
        planned_model.zero_grad(set_to_none=True)
    program = planned._prepared.program
    kept_out = [node for node, reason in program.allowances.items() if reason == arena.SEES_STORAGE]
    assert len(kept_out) >= 6, program.allowances
    assert 0 < program.outside_arena_bytes <= program.outside_arena_any_order_bytes / 2
    with AllocationTrace() as trace:
        planned(*args, targets=targets, **kwargs).backward()
    gradients = sum(p.grad.untyped_storage().nbytes() for p in planned_model.parameters() if p.grad is not None)
    assert trace.peak_bytes <= program.outside_arena_bytes + gradients, (trace.peak_bytes, program.outside_arena_bytes)
    assert arena_reserve_bytes(profile, captured, torch.device("cpu")) >= program.outside_arena_any_order_bytes


class _ScaledConvolutions(torch.nn.Module):
    """Convolutions scaled and rectified in place: one planning node each, whose convolution (no out= overload that
    writes in place) computes where the allocator puts it while the scaled result goes into the workspace slot."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = torch.nn.Conv2d(16, 64, 3, padding=1)
        self.fc = torch.nn.Linear(64, 4)

    def forward(self, x):
        y = torch.nn.functional.relu(self.c1(x) * 1.5, inplace=True)
        z = torch.nn.functional.relu(self.c2(y) * 1.5, inplace=True)
        return self.fc(z.mean((2, 3)))


def test_a_result_computed_beside_the_arena_inside_a_node_counts_with_the_kernels_own_scratch():
    """Through the allocator alone, a node's output room takes one of its convolution's result and the kernel's
    own scratch; writing into the arena, the output's room is in the arena and both are beside it. The program's
    bound counted the measured workspace only, and the step held 2 MB more beside the arena than it said."""
    from executor.measure.allocations import AllocationTrace

    torch.manual_seed(0)
    model = _ScaledConvolutions()
    inputs, targets = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    loss_fn = torch.nn.functional.cross_entropy
    profile, captured = _profile(model, (inputs,), {}, targets, loss_fn)
    schedule = addressed(profile, plan(profile, strategy="keep-all"))
    planned = PlannedModule(model, profile, schedule, loss_fn, profiled=captured, arena=True, ledger=False)
    for _ in range(2):
        planned(inputs, targets=targets).backward()
        model.zero_grad(set_to_none=True)
    assert planned.arena_allowances["c2/convolution+2"] == arena.INTERMEDIATES
    with AllocationTrace() as trace:
        planned(inputs, targets=targets).backward()
    gradients = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    assert trace.peak_bytes <= planned._prepared.program.outside_arena_bytes + gradients


def test_a_convolutions_own_scratch_gets_no_empty_slot_in_the_arena():
    """A convolution computes where the allocator puts it, scratch included, and is copied into its slot: its
    measured workspace is beside the arena, and a workspace slot for it stayed empty (every workspace byte of the
    zoo's CNNs, 2-5% of their keep-all arenas). The profile says which part of each workspace the step places in
    the arena (values made and dropped inside a node that an out= overload writes); planned addresses give the
    workspace only that part. The step is plain PyTorch's, bitwise, and what it holds beside the arena stays
    within the program's bound."""
    from executor.measure.allocations import AllocationTrace
    from planner.profile import GraphProfile

    torch.manual_seed(0)
    model = _ScaledConvolutions()
    inputs, targets = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    loss_fn = torch.nn.functional.cross_entropy
    profile, captured = _profile(model, (inputs,), {}, targets, loss_fn)
    parts = {node.id: (node.fastest.workspace_bytes, node.fastest.arena_workspace_bytes) for node in profile.nodes}
    # the filter and input gradients: all scratch of the kernel's own; the scaled convolution: its product only
    assert parts["c2/convolution_backward.weight:bwd"][0] > 0 and parts["c2/convolution_backward.weight:bwd"][1] == 0
    assert parts["c2/convolution+2"][1] == profile.node_by_id["c2/convolution+2"].output_bytes
    assert all(part is not None and part <= workspace for workspace, part in parts.values() if workspace)
    data = profile.model_dump(mode="json")
    for node in data["nodes"]:
        for implementation in node["implementations"]:
            implementation.pop("arena_workspace_bytes", None)
    whole = GraphProfile.model_validate(data)
    recomputing = recompute_everything_schedule(profile).model_copy(update={"budget_bytes": None})
    assert addressed(profile, recomputing).arena_bytes < addressed(
        whole, recomputing.model_copy(update={"profile_digest": whole.digest()})).arena_bytes
    expected_loss = loss_fn(copy.deepcopy(model)(inputs), targets)
    for schedule in (plan(profile, strategy="keep-all"), recomputing):
        planned_model = copy.deepcopy(model)
        planned = PlannedModule(planned_model, profile, addressed(profile, schedule), loss_fn, profiled=captured,
                                arena=True, ledger=False)
        for _ in range(2):
            loss = planned(inputs, targets=targets)
            loss.backward()
            assert torch.equal(loss.detach(), expected_loss.detach())
            planned_model.zero_grad(set_to_none=True)
        assert planned.arena_refused is None
        with AllocationTrace() as trace:
            planned(inputs, targets=targets).backward()
        gradients = sum(p.grad.untyped_storage().nbytes() for p in planned_model.parameters())
        assert trace.peak_bytes <= planned._prepared.program.outside_arena_bytes + gradients


def test_a_plan_for_the_arena_counts_a_kernels_own_scratch_once():
    """The room beside the arena holds a kernel's own scratch (`arena_reserve_bytes` counts it there): the solver
    plans on the profile with each workspace cut to its arena part, or the scratch would count twice. The plan
    that comes back is the profile's, its peak counting every workspace whole; one that fits only with the
    scratch counted once, for a step that would not write into its arena after all, is not handed on."""
    from executor.replay.replay import plan_beside_the_arena, workspaces_in_the_arena
    from planner.errors import BudgetError
    from planner.simulator import simulate
    from tests.conftest import make_profile, node

    scratch = {"name": "default", "time_ms": 1.0, "workspace_bytes": 64_000, "arena_workspace_bytes": 0}
    profile = make_profile([
        node("x", output_bytes=6400),
        node("y", inputs=["x"], output_bytes=12_800, implementations=[scratch]),
        node("loss", kind="loss", inputs=["y"], output_bytes=64),
        node("y:bwd", kind="backward", inputs=["loss", "x"], output_bytes=6400, forward_node="y"),
    ])
    view = workspaces_in_the_arena(profile)
    assert view.node_by_id["y"].fastest.workspace_bytes == 0 and profile.node_by_id["y"].fastest.workspace_bytes
    assert workspaces_in_the_arena(view) is view
    real_peak = plan(profile, strategy="keep-all").summary.peak_memory_bytes
    view_peak = plan(view, strategy="keep-all").summary.peak_memory_bytes
    assert real_peak == view_peak + 64_000 - 64  # the loss's 64 bytes live after y's scratch is gone
    seen = []

    def solve(planned_on, budget_bytes):
        seen.append(planned_on)
        schedule = plan(planned_on, strategy="keep-all")
        if schedule.summary.peak_memory_bytes > budget_bytes:
            raise BudgetError(f"no plan within {budget_bytes}", minimum_budget_bytes=schedule.summary.peak_memory_bytes)
        return addressed(planned_on, schedule.model_copy(update={"budget_bytes": budget_bytes}))

    # room beside the arena for the scratch, and the arena for the rest: counted twice, nothing would fit
    budget = view_peak + 64_000
    with pytest.raises(BudgetError):
        solve(profile, budget - 64_000)
    seen.clear()
    found, room = plan_beside_the_arena(profile, budget, 64_000, solve, lambda message: None)
    assert [p.digest() for p in seen] == [view.digest()] and room == 64_000
    assert found.profile_digest == profile.digest() and found.budget_bytes == budget
    assert found.summary.peak_memory_bytes == simulate(profile, found).peak_memory_bytes == real_peak
    assert found.arena_bytes == view_peak
    # within the keep-all step's room, its own step over the budget with its arena: through the allocator the
    # scratch counts whole, over the budget too
    said: list[str] = []
    found, room = plan_beside_the_arena(profile, view_peak + 1000, 64_000, solve, said.append,
                                        in_order=(lambda: 500, lambda schedule: 10**6))
    assert found is None and room == 64_000 and "counted whole" in said[-1]


def _small_plan():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 10))
    inputs, targets = torch.randn(32, 64), torch.randint(0, 10, (32,))
    profile, _ = _profile(model, (inputs,), {}, targets, torch.nn.functional.cross_entropy)
    return profile, addressed(profile, plan(profile, strategy="keep-all"))


def test_a_plan_beside_the_arena_leaves_room_for_any_order_first_then_for_its_own():
    """plan_beside_the_arena: within the budget less the room for any order where a plan fits it; where none does,
    within the budget less what the keep-all step holds in its own order, its addresses kept only where the plan's
    own step fits the budget with its arena; a room no smaller than a hundredth of the budget is not tried again;
    a plan whose buffers did not place is placed again within the budget less what its own step holds."""
    from executor.replay.replay import plan_beside_the_arena, workspaces_in_the_arena
    from planner.errors import BudgetError

    profile, schedule = _small_plan()
    held_bytes = profile.fixed_bytes + schedule.arena_bytes
    asked: list[int] = []

    def solve_above(least_bytes):
        def solve(view, budget_bytes):
            assert view is workspaces_in_the_arena(profile) or view.digest() == workspaces_in_the_arena(
                profile).digest()  # the solver counts only the workspaces' arena parts
            asked.append(budget_bytes)
            if budget_bytes < least_bytes:
                raise BudgetError(f"no plan within {budget_bytes}", minimum_budget_bytes=least_bytes)
            return schedule.model_copy(update={"profile_digest": view.digest()})
        return solve

    budget = held_bytes + 10_000
    found, room = plan_beside_the_arena(profile, budget, 10_000, solve_above(held_bytes), lambda message: None,
                                        in_order=(lambda: 1_000, lambda plan: 1_000))
    assert found is not None and found.budget_bytes == budget and room == 10_000 and asked == [held_bytes]
    # no plan leaves room for any order: one within the budget less the keep-all step's own, its own step fits
    asked.clear()
    said: list[str] = []
    found, room = plan_beside_the_arena(profile, budget, 20_000, solve_above(held_bytes), said.append,
                                        in_order=(lambda: 4_000, lambda plan: 6_000))
    assert found is not None and room == 6_000 and asked == [budget - 20_000, budget - 4_000]
    assert any("in its own order" in message for message in said)
    # its own step would pass the budget: the plan as it is (the replay goes through the allocator), and why
    asked.clear()
    found, room = plan_beside_the_arena(profile, budget, 20_000, solve_above(held_bytes), said.append,
                                        in_order=(lambda: 4_000, lambda plan: 12_000))
    assert found is not None and found.budget_bytes == budget and room == 4_000 and len(asked) == 2
    assert "over the budget" in said[-1]
    # buffers that did not place within the budget less the room are placed again with the room their step needs
    from planner.addresses import without_addresses

    unplaced = without_addresses(schedule)

    def unplaced_for(view, budget_bytes):
        return unplaced.model_copy(update={"profile_digest": view.digest()})
    assert unplaced.arena_bytes is None and unplaced.summary.arena_bytes == schedule.arena_bytes
    found, room = plan_beside_the_arena(profile, budget, 10_000, unplaced_for, said.append,
                                        in_order=(lambda: 1_000, lambda plan: 3_000))
    assert found.arena_bytes == schedule.arena_bytes and found.budget_bytes == budget and room == 3_000
    found, room = plan_beside_the_arena(profile, budget, 10_000, unplaced_for, said.append,
                                        in_order=(lambda: 1_000, lambda plan: 10_001))
    assert found.arena_bytes is None and room == 10_000 and "over the budget" in said[-1]
    # a room hardly smaller is not tried; without in_order, nothing but the first
    for in_order in ((lambda: 20_000 - budget // 200, lambda plan: 0), None):
        asked.clear()
        found, _ = plan_beside_the_arena(profile, budget, 20_000, solve_above(held_bytes), said.append,
                                         in_order=in_order)
        assert found is None and asked == [budget - 20_000]


def test_an_arena_with_no_room_beside_it_for_what_the_allocator_still_holds_is_refused_with_the_reason():
    """A budget the arena fills exactly leaves nothing for the allocations the program names (a layer norm computed
    elsewhere and copied in): the step goes through the allocator, as planned, and says why."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 10))
    inputs, targets = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss_fn = torch.nn.functional.cross_entropy
    profile, captured = _profile(model, (inputs,), {}, targets, loss_fn)
    unbounded = addressed(profile, plan(profile, strategy="keep-all"))
    # the arena exactly, or the plan's peak where that is more (a workspace beside the arena is not in it)
    budget = max(profile.fixed_bytes + unbounded.arena_bytes, unbounded.summary.peak_memory_bytes)
    tight = addressed(profile, unbounded.model_copy(update={"budget_bytes": budget}))
    assert tight.arena_bytes is not None
    messages = []
    copied = copy.deepcopy(model)
    planned = PlannedModule(copied, profile, tight, loss_fn, profiled=captured, arena=True, progress=messages.append)
    loss = planned(inputs, targets=targets)
    loss.backward()
    assert planned.arena_refused is not None and "pass the budget" in planned.arena_refused
    assert any("not writing into the arena" in message for message in messages)
    assert planned.arena_bytes == 0 and planned.arena_allowances is None
    plain = copy.deepcopy(model)
    assert torch.equal(loss.detach(), loss_fn(plain(inputs), targets).detach())
    roomy = PlannedModule(copy.deepcopy(model), profile, unbounded, loss_fn, profiled=captured, arena=True)
    roomy(inputs, targets=targets).backward()
    assert roomy.arena_refused is None and roomy.arena_bytes == unbounded.arena_bytes


def test_optimize_plans_room_beside_the_arena_and_trains_in_it():
    """optimize(arena=True) plans within the budget less what the step would hold beside the arena, so that the
    arena is used where its buffers place; without a budget it always is. Either way the step is plain PyTorch's."""
    import executor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                torch.nn.LayerNorm(256), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 10))
    inputs, targets = torch.randn(64, 64), torch.randint(0, 10, (64,))
    loss_fn = torch.nn.functional.cross_entropy
    plain = copy.deepcopy(model)
    expected = loss_fn(plain(inputs), targets)
    expected.backward()
    for budget in (None, 0.9):
        messages: list[str] = []
        trained = copy.deepcopy(model)
        planned = executor.optimize(trained, inputs, loss_fn, targets=targets, budget=None,
                                    **({"memory_ratio": budget} if budget else {}), arena=True, time_limit_s=10,
                                    progress=messages.append, cache=False, timed_steps=0)
        loss = planned(inputs, targets=targets)
        loss.backward()
        assert torch.equal(loss.detach(), expected.detach())
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(trained.parameters(), plain.parameters()))
        if budget is None:
            assert planned.arena_refused is None and planned.arena_bytes == planned.schedule.arena_bytes > 0
            continue
        assert any(message.startswith("planning within") for message in messages), messages
        if planned.arena_refused is None:
            program = planned._prepared.program
            assert (planned.profile.fixed_bytes + planned.arena_bytes + program.outside_arena_bytes
                    <= planned.schedule.budget_bytes)
        else:
            assert "planned addresses" in planned.arena_refused or "pass the budget" in planned.arena_refused


def test_the_arena_is_on_by_default_on_a_gpu_only_and_a_wrong_value_is_refused():
    """optimize()'s arena=None means: on a GPU (where fragmentation ran a planned step out of memory, issue 44),
    off on the CPU; anything but True, False or None is named before anything runs."""
    import executor
    from executor.errors import MososError

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    inputs, targets = torch.randn(4, 8), torch.randint(0, 2, (4,))
    with pytest.raises(MososError, match="arena is True, False or None"):
        executor.optimize(model, inputs, torch.nn.functional.cross_entropy, targets=targets, arena="yes",
                          cache=False, progress=False)
    planned = executor.optimize(model, inputs, torch.nn.functional.cross_entropy, targets=targets, cache=False,
                                progress=False, timed_steps=0)
    assert planned.arena_enabled is False
    import inspect

    assert inspect.signature(executor.optimize).parameters["arena"].default is None


def test_a_copied_or_pickled_planned_module_makes_its_own_arena():
    """A deep copy or a pickled planned module (torch.save of the whole module) shares no arena with the original:
    it makes its own at its first step, and trains as the original does."""
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    inputs, targets = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss_fn = torch.nn.functional.cross_entropy
    profile, captured = _profile(model, (inputs,), {}, targets, loss_fn)
    schedule = addressed(profile, plan(profile, strategy="keep-all"))
    planned = PlannedModule(copy.deepcopy(model), profile, schedule, loss_fn, profiled=captured, arena=True)
    expected = planned(inputs, targets=targets)
    expected.backward()
    for other in (copy.deepcopy(planned), pickle.loads(pickle.dumps(planned))):
        assert other.arena_bytes == 0 and other.arena_enabled
        other.model.zero_grad(set_to_none=True)
        loss = other(inputs, targets=targets)
        loss.backward()
        assert torch.equal(loss.detach(), expected.detach())
        assert other.arena_bytes == planned.arena_bytes > 0
        assert other._arena.buffer.data_ptr() != planned._arena.buffer.data_ptr()


def _op(kind, group, offset=None, workspace=None):
    from executor.engine.codegen import Op

    start, size = workspace if workspace is not None else (None, 0)
    return Op(kind, group, offset_bytes=offset, workspace_offset_bytes=start, workspace_bytes=size,
              workspace_slot_bytes=size)


def test_a_slot_freed_under_its_offload_is_waited_for_where_it_is_written_next():
    """On a GPU, the copy reading a freed slot holds back only what writes that slot next (issue 44: a wait at
    the free stopped every later computation, 1.31x the allocator's step on an H200)."""
    operations = [
        _op("compute", 0, 0),  # g0 at [0, 100)
        _op("offload", 0),
        _op("compute", 1, 100),  # elsewhere
        _op("free", 0),  # the copy may still read [0, 100)
        _op("compute", 2, 200, workspace=(300, 50)),  # elsewhere, workspace too
        _op("prefetch", 3, 50),  # [50, 150): its stream waits
        _op("compute", 4, 400, workspace=(0, 40)),  # its workspace overlaps: the compute stream waits
        _op("compute", 5, 0),  # the compute stream already waited
        _op("compute", 6, 500),
        _op("free", 6),  # never offloaded: nothing to wait for
        _op("compute", 7, 500),
    ]
    assert arena.reclaims(operations, lambda group: 100) == {5: [(0, "h2d")], 6: [(0, "compute")]}
    # a node offloaded, prefetched into a new slot and freed there: its new copy was never offloaded
    again = [_op("compute", 0, 0), _op("offload", 0), _op("free", 0), _op("prefetch", 0, 200), _op("free", 0),
             _op("compute", 1, 200), _op("compute", 2, 0)]
    assert arena.reclaims(again, lambda group: 100) == {6: [(0, "compute")]}


def test_every_write_over_a_slot_under_an_offload_waits_for_it_in_a_real_plan():
    """GPT-2, everything offloaded, addressed: each computation writing over a slot freed after its offload comes
    after the compute stream's wait for that copy, and each prefetch after its own stream's wait or the compute
    stream's; the generated GPU code says so where it writes."""
    from executor.engine.codegen import CodeGenerator, Modes, schedule_operations

    model, args, kwargs, targets, loss_fn = ZOO["gpt2"](torch.float32)
    profile, captured = _profile(model, args, kwargs, targets, loss_fn)
    schedule = addressed(profile, offload_everything_schedule(profile).model_copy(update={"budget_bytes": None}))
    groups = captured.planning.groups
    operations = schedule_operations(profile, schedule, {group.id: group.index for group in groups})

    def size_of(index):
        return captured.planning.size_bytes(groups[index])

    found = arena.reclaims(operations, size_of)
    waited = {(position, group, stream) for position, waits in found.items() for group, stream in waits}
    checked = 0
    for p, freed in enumerate(operations):
        made = next((op for op in reversed(operations[:p]) if op.group == freed.group
                     and op.kind in ("compute", "prefetch")), None)
        offloaded = any(op.kind == "offload" and op.group == freed.group
                        for op in operations[operations.index(made) if made else 0:p])
        if freed.kind != "free" or made is None or made.offset_bytes is None or not offloaded:
            continue
        start, end = made.offset_bytes, made.offset_bytes + size_of(freed.group)
        for q in range(p + 1, len(operations)):
            op = operations[q]
            ranges = [(op.offset_bytes, op.offset_bytes + size_of(op.group))] if op.offset_bytes is not None else []
            if op.kind == "compute" and op.workspace_offset_bytes is not None and op.workspace_slot_bytes:
                ranges.append((op.workspace_offset_bytes, op.workspace_offset_bytes + op.workspace_slot_bytes))
            if op.kind not in ("compute", "prefetch") or not any(a < end and start < b for a, b in ranges):
                continue
            compute_waited = any((r, freed.group, "compute") in waited for r in range(p + 1, q + (op.kind == "compute")))
            if op.kind == "compute":
                assert compute_waited, (p, q)
            else:
                # its own stream waited here or at an earlier prefetch over the slot (a stream's wait orders all its
                # later copies)
                h2d_waited = any((r, freed.group, "h2d") in waited for r in range(p + 1, q + 1))
                assert compute_waited or h2d_waited, (p, q)
            checked += 1
    assert checked > 10 and found
    program = CodeGenerator(captured.planning, Modes(arena=True), cuda=True).program(operations, None)
    assert program.source.count("S.reclaim(") == sum(len({s for _, s in waits}) for waits in found.values())
    # on the CPU, copies are synchronous: no wait is generated
    assert "S.reclaim(" not in CodeGenerator(captured.planning, Modes(arena=True), cuda=False).program(
        operations, None).source


@pytest.mark.parametrize("name", ["resnet", "mobilenet", "inplace-cnn"])
def test_batch_norm_under_bf16_autocast_trains_in_the_arena_as_through_the_allocator(name):
    """torch's fake batch norm gives its statistics the input's dtype (bf16 under autocast) where the CPU kernel
    keeps float32: slots laid out from the trace cast them (a clone is a copy into the slot), and the backward
    refused the mixed dtypes. The capture takes the kernel's dtypes (executor.capture.kernel_dtypes), so the
    statistics have float32 slots in the arena and nothing is kept out of it at run time."""
    results = _bf16_steps_without_and_with_the_arena(name)
    planned = results[True][2]
    assert planned.arena_refused is None
    assert planned.arena_kept_out == []
    assert not any("statistic" in reason or "dtype" in reason for reason in planned.arena_allowances.values())
    assert torch.equal(results[False][0], results[True][0])
    for a, b in zip(results[False][1], results[True][1]):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def _bf16_steps_without_and_with_the_arena(name):
    """One planned step of a zoo model under bf16 autocast, through the allocator (False) and in the arena (True):
    per arena setting, the loss, the parameters' gradients and the planned module."""
    import executor

    model, args, kwargs, targets, loss_fn = ZOO[name](torch.float32)
    results = {}
    for use_arena in (False, True):
        trained = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            planned = executor.optimize(trained, args, loss_fn, targets=targets, kwargs=kwargs, arena=use_arena,
                                        cache=False, progress=False, timed_steps=0, time_limit_s=5)
            torch.manual_seed(1)
            loss = planned(*args, targets=targets, **kwargs)
        loss.backward()
        results[use_arena] = (loss.detach(), [p.grad for p in trained.parameters()], planned)
    return results


def test_a_copy_into_a_slot_whose_dtype_is_not_the_runs_keeps_the_value_as_computed(monkeypatch):
    """A guard beside the capture's dtypes: with the trace's own (wrong) dtypes for batch norm's statistics, their
    copies find at run time that their dtype is not the slot's, are kept where they were computed (no cast), and
    the module names them; the step is still the allocator's, bitwise."""
    from executor.capture import planning_graph

    monkeypatch.setattr(planning_graph, "with_kernel_dtypes", lambda target, args, kwargs, value, mode: value)
    results = _bf16_steps_without_and_with_the_arena("resnet")
    planned = results[True][2]
    assert planned.arena_refused is None
    assert planned.arena_kept_out and all("batch_norm" in node for node in planned.arena_kept_out)
    assert results[False][2].arena_kept_out == []
    assert torch.equal(results[False][0], results[True][0])
    assert all(torch.equal(a, b) for a, b in zip(results[False][1], results[True][1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_capture_sizes_batch_norm_statistics_in_the_kernels_dtype(dtype):
    """Under autocast the statistics a batch norm saves for its backward are float32 (the weight's dtype), where
    torch's fake kernel says the input's: the reference run's sizes and layouts follow the kernel, as a real step
    makes them, and the trace's dtype alone would have counted half their bytes."""
    from executor.capture.kernel_dtypes import BATCH_NORMS
    from executor.measure.profiler import plan_step

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 24, 3), torch.nn.BatchNorm2d(24), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(24 * 36, 5))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    with torch.autocast("cpu", dtype=dtype):
        profiled = plan_step(model, (x,), None, y, torch.nn.functional.cross_entropy)
        with torch.no_grad():
            real = torch.ops.aten._native_batch_norm_legit_functional.default(
                model[0](x), model[1].weight, model[1].bias, model[1].running_mean.clone(),
                model[1].running_var.clone(), True, 0.1, 1e-5)
    facts = profiled.planning.facts
    norms = [n for n in profiled.step.graph.nodes if n.target in BATCH_NORMS]
    statistics = [user for n in norms for user in n.users if user.args[1] in (1, 2)]
    assert norms and statistics and real[1].dtype == real[2].dtype == torch.float32
    for item in statistics:
        assert facts.layout_of[item][2] == torch.float32
        assert facts.root_bytes[item] == 24 * 4
        assert item.meta["val"].dtype == dtype  # the trace's own, which the reference run corrects

"""PlannedModule against plain PyTorch: same loss, gradients and buffers, bit for bit, and the planned memory.

The reference networks in float64, profiled with the native convolution only
(the other algorithms agree to rounding, not bitwise): every kind of plan
replays the eager step's ATen operators in the eager order, so loss, every
parameter gradient and every buffer are equal with torch.equal, and the
byte-exact ledger's peak equals the simulator's.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
models = pytest.importorskip("models")

from executor.engine import conv_algorithms  # noqa: E402
from executor.errors import ProfileMismatch, ReplayError  # noqa: E402
from executor.replay.optimize import PlannerServiceError, plan_remotely  # noqa: E402
from executor.replay.optimize import optimize as executor_optimize  # noqa: E402
from executor.measure.profiler import profile_step  # noqa: E402
from executor.replay.replay import PlannedModule  # noqa: E402
from executor.engine.schedules import offload_everything_schedule, recompute_everything_schedule  # noqa: E402
from planner.budget import minimum_budget_bytes  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.planning import InfeasibleBudget, plan, strategy_names  # noqa: E402
from planner.schedule import Compute  # noqa: E402
from planner.strategies.keep_all import keep_all_peak_bytes  # noqa: E402

MODELS = ["vgg19", "unet", "resnet18", "transformer"]
BATCH = 4


@pytest.fixture(scope="module")
def profiled():
    """Each small model in float64, profiled with the native convolution only."""
    cache = {}

    def get(name: str):
        if name not in cache:
            spec = models.get_model(name, small=True)
            torch.manual_seed(0)
            model = spec.build().double()
            inputs, targets = spec.example_inputs(BATCH, dtype=torch.float64)
            profile, step = profile_step(
                model, inputs, spec.loss, targets, repeats=1, warmup=0, algorithms=("native",),
                d2h_gb_per_s=10.0, h2d_gb_per_s=10.0, optimizer="momentum",  # the tests step SGD with momentum
            )
            cache[name] = (spec, model, inputs, targets, profile, step)
        return cache[name]

    return get


def schedule_of(profile, kind: str):
    if kind == "keep-all":
        return plan(profile, strategy="keep-all")
    if kind == "offload-everything":
        return offload_everything_schedule(profile)
    if kind == "recompute-everything":
        return recompute_everything_schedule(profile)
    if kind not in strategy_names():
        pytest.skip(f"strategy {kind!r} is not in this checkout yet")
    if kind == "chen-sqrt":  # it recomputes at any budget: plan it at the smallest budget it meets
        try:
            return plan(profile, memory_ratio=1.0, strategy=kind)
        except InfeasibleBudget as refusal:
            return plan(profile, refusal.minimum_budget_bytes, strategy=kind)
    # half the activation memory (a ratio of the keep-all peak would be below the fixed memory of these small
    # float64 models: parameters dominate at batch 4)
    peak = keep_all_peak_bytes(profile)
    budget = max(minimum_budget_bytes(profile), profile.fixed_bytes + (peak - profile.fixed_bytes) // 2)
    return plan(profile, budget, strategy=kind, workers=1, time_limit_s=2)


def plain_step(model, spec, inputs, targets, seed=1):
    torch.manual_seed(seed)
    loss = spec.loss(model(inputs), targets)
    loss.backward()
    return loss


def assert_same(planned_model, plain_model, planned_loss, plain_loss):
    assert torch.equal(planned_loss.detach(), plain_loss.detach()), (planned_loss.item(), plain_loss.item())
    for (key, a), (_, b) in zip(planned_model.named_parameters(), plain_model.named_parameters()):
        assert a.grad is not None, f"{key} got no gradient"
        assert torch.equal(a.grad, b.grad), f"{key}: max difference {(a.grad - b.grad).abs().max().item():.3e}"
    for (key, a), (_, b) in zip(planned_model.named_buffers(), plain_model.named_buffers()):
        assert torch.equal(a, b), f"buffer {key} differs"


SCHEDULES = ["keep-all", "offload-everything", "recompute-everything", "chen-sqrt", "mosos"]


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("name", MODELS)
def test_one_step_equals_plain_pytorch_and_memory_is_as_simulated(profiled, name, kind):
    spec, model, inputs, targets, profile, step = profiled(name)
    schedule = schedule_of(profile, kind)
    planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile, schedule, spec.loss, profiled=step, strict=True)
    torch.manual_seed(1)
    loss = planned(inputs, targets)
    loss.backward()
    assert_same(planned_model, plain_model, loss, plain_step(plain_model, spec, inputs, targets))
    # the ledger counts the real tensors, and their sizes are the profile's: exactly the simulator's peak
    assert planned.peak_memory_bytes == planned.simulated_peak_bytes
    assert planned.last_ledger.held_bytes() == 0  # everything released by the end of the step


def test_schedules_really_move_and_recompute(profiled):
    *_, profile, _ = profiled("resnet18")
    offload = offload_everything_schedule(profile)
    recompute = recompute_everything_schedule(profile)
    assert offload.summary.offloaded_bytes > 0 and offload.summary.prefetched_bytes > 0
    assert recompute.summary.recompute_time_ms > 0
    recomputed = recompute.compute_order[len(profile.nodes) // 2:]
    assert any("native_batch_norm" in profile.node_by_id[n].op_type for n in recomputed)
    assert len(recompute.compute_order) - len(profile.nodes) > 10


@pytest.mark.parametrize("name,kind", [("vgg19", "recompute-everything"), ("resnet18", "offload-everything"),
                                       ("transformer", "mosos")])
def test_three_steps_equal_three_plain_steps(profiled, name, kind):
    spec, model, inputs, targets, profile, step = profiled(name)
    schedule = schedule_of(profile, kind)
    planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile, schedule, spec.loss, example_inputs=inputs, targets=targets)
    planned_opt = torch.optim.SGD(planned_model.parameters(), lr=0.05, momentum=0.9)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=0.9)
    for index in range(3):
        planned_opt.zero_grad()
        torch.manual_seed(10 + index)
        loss = planned(inputs, targets)
        loss.backward()
        planned_opt.step()
        plain_opt.zero_grad()
        plain_loss = plain_step(plain_model, spec, inputs, targets, seed=10 + index)
        plain_opt.step()
        assert torch.equal(loss.detach(), plain_loss.detach()), f"step {index}"
    for a, b in zip(planned_model.state_dict().values(), plain_model.state_dict().values()):
        assert torch.equal(a, b)


def test_gradients_accumulate_and_scale_like_plain_pytorch(profiled):
    """Two backward passes without zero_grad add up in place, and a scaled loss feeds the scale into the backward
    as plain autograd does (the joint graph's tangent), so even a scale of 3 is bitwise."""
    spec, model, inputs, targets, profile, step = profiled("unet")
    planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile, schedule_of(profile, "offload-everything"), spec.loss,
                            profiled=step)
    for scale in (1.0, 3.0):
        torch.manual_seed(1)
        (planned(inputs, targets) * scale).backward()
        torch.manual_seed(1)
        (spec.loss(plain_model(inputs), targets) * scale).backward()
    for a, b in zip(planned_model.parameters(), plain_model.parameters()):
        assert torch.equal(a.grad, b.grad)
    # the second backward added each new gradient to the first: the ledger counts that transient
    assert planned.peak_memory_bytes >= planned.simulated_peak_bytes


def test_float32_with_every_convolution_algorithm():
    """Profile with all algorithms, then force each one in turn on every convolution (forward and both halves of
    its backward): close to plain PyTorch, and the ledger still equals the simulator."""
    spec = models.get_model("vgg16", small=True)
    torch.manual_seed(0)
    model = spec.build()
    inputs, targets = spec.example_inputs(2)
    profile, step = profile_step(model, inputs, spec.loss, targets, repeats=1, warmup=0)
    # the test swaps implementations (other workspaces) in place: the plan's addresses no longer hold, so it has none
    base = plan(profile, strategy="keep-all", addresses=False)
    plain_model = copy.deepcopy(model)
    plain_loss = plain_step(plain_model, spec, inputs, targets)
    scale = max(p.grad.abs().max().item() for p in plain_model.parameters())
    convolutions = [n for n in profile.nodes if "convolution" in n.op_type]
    assert {n.kind for n in convolutions} == {"forward", "backward"}
    assert any(n.id.endswith("convolution_backward.weight:bwd") for n in convolutions)
    assert any(n.id.endswith("convolution_backward.input:bwd") for n in convolutions)
    for algorithm in conv_algorithms.ALGORITHMS:
        stages = []
        for stage in base.stages:
            operations = []
            for op in stage.operations:
                node = profile.node_by_id.get(getattr(op, "node", ""), None)
                if isinstance(op, Compute) and node is not None and any(i.name == algorithm for i in node.implementations):
                    op = Compute(node=op.node, implementation=algorithm)
                operations.append(op)
            stages.append(stage.model_copy(update={"operations": operations}))
        schedule = base.model_copy(update={"stages": stages, "summary": None})
        planned_model = copy.deepcopy(model)
        planned = PlannedModule(planned_model, profile, schedule, spec.loss, profiled=step, strict=True)
        torch.manual_seed(1)
        loss = planned(inputs, targets)
        loss.backward()
        assert abs(loss.item() - plain_loss.item()) <= 1e-5 * abs(plain_loss.item())
        worst = max((a.grad - b.grad).abs().max().item() / scale
                    for a, b in zip(planned_model.parameters(), plain_model.parameters()))
        assert worst <= 1e-4, f"{algorithm}: relative gradient error {worst:.2e}"
        if algorithm == "native":
            assert worst == 0.0
        assert planned.peak_memory_bytes == planned.simulated_peak_bytes


def test_a_profile_of_another_model_is_refused(profiled):
    spec, model, inputs, targets, profile, _ = profiled("vgg19")
    keep_all = plan(profile, strategy="keep-all")
    other = models.get_model("resnet18", small=True).build().double()
    with pytest.raises(ProfileMismatch, match="another model: planning node 0"):
        PlannedModule(other, profile, keep_all, spec.loss, example_inputs=inputs, targets=targets)
    wider = models.get_model("vgg19", small=True).build().double()
    wider.features[0] = torch.nn.Conv2d(3, 4, 3, padding=2).double()
    with pytest.raises(ProfileMismatch, match="another model"):
        PlannedModule(wider, profile, keep_all, spec.loss, example_inputs=inputs, targets=targets)
    # without example inputs the model is captured, and refused, at its first call
    lazy = PlannedModule(other, profile, keep_all, spec.loss)
    with pytest.raises(ProfileMismatch, match="another model"):
        lazy(inputs, targets)


def test_a_schedule_of_another_profile_is_refused(profiled):
    spec, model, *_ = profiled("vgg19")
    other_profile = profiled("unet")[4]
    with pytest.raises(ProfileMismatch, match="made for profile"):
        PlannedModule(copy.deepcopy(model), profiled("vgg19")[4], plan(other_profile, strategy="keep-all"), spec.loss)


def test_inputs_of_other_shapes_are_refused(profiled):
    spec, model, inputs, targets, profile, step = profiled("vgg19")
    planned = PlannedModule(copy.deepcopy(model), profile, plan(profile, strategy="keep-all"), spec.loss, profiled=step)
    smaller_inputs, smaller_targets = spec.example_inputs(BATCH - 1, dtype=torch.float64)
    with pytest.raises(ProfileMismatch, match=r"measured with inputs float64\[4,3,32,32\].*got float64\[3,3,32,32\]"):
        planned(smaller_inputs, smaller_targets)
    with pytest.raises(ProfileMismatch, match="float32"):
        planned(inputs.float(), targets)


def test_a_profile_without_structure_hash_is_refused(profiled):
    spec, model, inputs, targets, profile, step = profiled("vgg19")
    anonymous = profile.model_copy(update={"provenance": profile.provenance.model_copy(update={"model_structure_sha256": None})})
    with pytest.raises(ProfileMismatch, match="no model structure hash"):
        PlannedModule(copy.deepcopy(model), anonymous, plan(anonymous, strategy="keep-all"), spec.loss, profiled=step)


def test_strict_mode_catches_sizes_that_disagree_with_the_profile(profiled):
    spec, model, inputs, targets, profile, step = profiled("transformer")
    doctored = profile.model_copy(deep=True)
    doctored.nodes[0].output_bytes += 8
    doctored = type(profile).model_validate(doctored.model_dump())
    planned = PlannedModule(copy.deepcopy(model), doctored, plan(doctored, strategy="keep-all"), spec.loss,
                            profiled=step, strict=True)
    with pytest.raises(ReplayError, match="profile says"):
        planned(inputs, targets)


def test_the_generated_step_frees_what_the_schedule_frees(profiled):
    """The code is generated once per schedule: one line per operation, frees exactly where the schedule has them."""
    spec, model, inputs, targets, profile, step = profiled("resnet18")
    schedule = schedule_of(profile, "offload-everything")
    planned = PlannedModule(copy.deepcopy(model), profile, schedule, spec.loss, profiled=step, ledger=False)
    code = planned.code
    operations = [op for _, _, op in schedule.operations()]
    assert code.count("# compute ") == sum(1 for op in operations if op.op == "compute")
    assert code.count("S.offload(") == sum(1 for op in operations if op.op == "offload")
    assert code.count(" = S.prefetch(") == sum(1 for op in operations if op.op == "prefetch")
    assert "S.computed(" not in code  # the ledger is a mode of the generated code, off here
    assert planned.peak_memory_bytes is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_gpu_memory_stays_within_the_plan_and_gradients_match():
    """The loss bitwise, the gradients as close to plain PyTorch's as plain PyTorch's are to themselves run twice:
    a GPU's backward kernels add in an order that is not fixed (on an H200, float64, conv1's weight gradient came
    out 1e-13 apart from plain PyTorch's, with cuDNN's deterministic algorithms too)."""
    spec = models.get_model("resnet18", small=True)
    torch.manual_seed(0)
    model = spec.build().cuda().double()
    inputs, targets = spec.example_inputs(BATCH, device="cuda", dtype=torch.float64)
    profile, step = profile_step(model, inputs, spec.loss, targets, repeats=2, warmup=1, algorithms=("native",))
    assert profile.hardware.d2h_bandwidth_gb_per_s > 0  # measured with pinned buffers
    schedule = offload_everything_schedule(profile)
    planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile, schedule, spec.loss, profiled=step)
    torch.manual_seed(1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = planned(inputs, targets)
    loss.backward()
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    planned_bytes = planned.simulated_peak_bytes - profile.fixed_bytes + profile.fixed_memory.gradients_bytes
    assert grown <= 1.02 * planned_bytes + (4 << 20), (grown, planned_bytes)
    plain_loss = plain_step(plain_model, spec, inputs, targets)
    assert torch.equal(loss.detach(), plain_loss.detach()), (loss.item(), plain_loss.item())
    again = copy.deepcopy(model)
    plain_step(again, spec, inputs, targets)
    for (key, a), b, c in zip(planned_model.named_parameters(), plain_model.parameters(), again.parameters()):
        noise = (c.grad - b.grad).abs().max().item()
        allowed = max(10 * noise, 1e-12 * b.grad.abs().max().item())
        assert (a.grad - b.grad).abs().max().item() <= allowed, f"{key}: plain PyTorch's own spread {noise:.1e}"


def test_optimize_profiles_plans_and_returns_a_module_that_trains():
    spec = models.get_model("transformer", small=True)
    torch.manual_seed(0)
    model = spec.build().double()
    plain_model = copy.deepcopy(model)
    inputs, targets = spec.example_inputs(BATCH, dtype=torch.float64)
    messages = []
    planned = executor_optimize(
        model, inputs, spec.loss, targets=targets, memory_ratio=1.0, strategy="chen-sqrt",
        repeats=1, warmup=0, progress=messages.append, d2h_gb_per_s=10, h2d_gb_per_s=10,
    )
    assert isinstance(planned, PlannedModule) and planned.schedule.summary.strategy == "chen-sqrt"
    assert any("profiled" in m for m in messages) and any("plan (chen-sqrt)" in m for m in messages)
    torch.manual_seed(1)
    loss = planned(inputs, targets)
    loss.backward()
    assert_same(model, plain_model, loss, plain_step(plain_model, spec, inputs, targets))
    assert list(planned.parameters()) == list(model.parameters())  # an optimizer can take either


def test_optimize_with_an_unreachable_planner_service_says_so():
    spec = models.get_model("transformer", small=True)
    model = spec.build()
    inputs, targets = spec.example_inputs(2)
    with pytest.raises(PlannerServiceError, match="cannot reach the planner service at http://127.0.0.1:9"):
        executor_optimize(model, inputs, spec.loss, targets=targets, memory_ratio=0.9, repeats=1, warmup=0,
                          planner_url="http://127.0.0.1:9", progress=False)


class _Odd(torch.nn.Module):
    """Tuples and getitem, chunk, MultiheadAttention with q is k is v, a parameter used directly, `+=`, in-place
    ReLUs, an int from size(), views, dropout, a weight used twice, keyword inputs and a dict output."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.self_attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.head = torch.nn.Linear(8, 3)
        self.tied = torch.nn.Linear(8, 8, bias=False)
        self.act = torch.nn.ReLU(inplace=True)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x, *, scale=None):
        a, b = self.lin(x).chunk(2, dim=-1)
        y, _ = self.attn(a * torch.sigmoid(b), a, b)
        y, _ = self.self_attn(y, y, y)  # packed in-projection: one matmul for q, k and v
        y = torch.nn.functional.linear(y, self.w)
        y += x
        y = self.act(y)
        n = y.size(0)
        z = self.drop(y.view(n, -1)).view(n, -1, 8)
        z = torch.nn.functional.relu(self.tied(z), inplace=True)
        z = self.tied(z).mean(1) * scale
        return {"logits": self.head(z), "extra": z.sum()}


def _odd_loss(output, targets):
    return torch.nn.functional.cross_entropy(output["logits"], targets) + 0.01 * output["extra"]


@pytest.mark.parametrize("kind", ["keep-all", "offload-everything", "recompute-everything"])
def test_unusual_graphs_replay_like_plain_pytorch(kind):
    torch.manual_seed(0)
    model = _Odd().double()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    scale = torch.rand(8, dtype=torch.float64)
    t = torch.tensor([0, 1, 2, 1])
    profile, step = profile_step(model, x, _odd_loss, t, kwargs={"scale": scale}, repeats=1, warmup=0,
                                 d2h_gb_per_s=10, h2d_gb_per_s=10)
    planned_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile, schedule_of(profile, kind), _odd_loss, profiled=step, strict=True)
    torch.manual_seed(3)
    loss = planned(x, t, scale=scale)
    loss.backward()
    torch.manual_seed(3)
    plain_loss = _odd_loss(plain_model(x, scale=scale), t)
    plain_loss.backward()
    assert_same(planned_model, plain_model, loss, plain_loss)  # the tied weight's sum too: the joint graph's order
    assert planned.peak_memory_bytes == planned.simulated_peak_bytes


def test_without_grad_the_module_just_evaluates(profiled):
    spec, model, inputs, targets, profile, step = profiled("vgg19")
    planned = PlannedModule(copy.deepcopy(model), profile, plan(profile, strategy="keep-all"), spec.loss, profiled=step)
    with torch.no_grad():
        loss = planned(inputs, targets)
    assert loss.shape == () and planned.last_ledger is None


def test_transfers_bring_back_any_geometry_on_the_cpu():
    """Offload copies storages byte for byte, so strides, offsets and shared storages come back as they were."""
    from executor.engine.transfers import Transfers

    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    view = base.t()[1:, ::2]  # non-contiguous, offset, on the same storage as base
    mask = torch.tensor([True, False, True])
    transfers = Transfers(torch.device("cpu"))
    copy_ = transfers.offload(7, (base, view, mask))
    assert copy_.size_bytes == base.untyped_storage().nbytes() + mask.untyped_storage().nbytes()
    expected = [t.clone() for t in (base, view, mask)]
    geometry = [(t.shape, t.stride(), t.storage_offset()) for t in (base, view, mask)]
    restored = transfers.prefetch(7)
    for tensor, value, (shape, stride, offset) in zip(restored, expected, geometry):
        assert torch.equal(tensor, value)
        assert (tensor.shape, tensor.stride(), tensor.storage_offset()) == (shape, stride, offset)
    assert restored[0].untyped_storage().data_ptr() == restored[1].untyped_storage().data_ptr()
    pool = transfers.host_pool[7]
    transfers.offload(7, restored)
    assert transfers.host_pool[7] is pool  # host buffers are allocated once and reused


def test_transfers_leave_a_storage_that_is_not_on_the_device_where_it_is():
    """CUDA attention hands its backward its generator's seed and offset as CPU scalars: offloading the node moves
    its device tensors only, and the scalars come back as themselves, still on the CPU (rebuilt on the device, an
    H200 step failed in the attention's backward). A meta device stands in for the GPU here."""
    from executor.engine.transfers import Transfers

    seed, offset = torch.tensor(1234), torch.tensor(56)
    transfers = Transfers(torch.device("meta"))
    copy_ = transfers.offload(3, (seed, offset))
    assert copy_.size_bytes == 0  # nothing of theirs goes to host memory
    restored = transfers.prefetch(3)
    assert [t.device.type for t in restored] == ["cpu", "cpu"]
    assert restored[0].item() == 1234 and restored[1].item() == 56


def test_optimize_plans_on_a_planner_service(tmp_path):
    """The plugin posts its measured profile to `mosos serve` and replays the schedule it gets back."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--port", str(port), "--db", str(tmp_path / "plans.sqlite3")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mosos serve did not start"
            time.sleep(0.3)
        spec = models.get_model("transformer", small=True)
        torch.manual_seed(0)
        model = spec.build().double()
        plain_model = copy.deepcopy(model)
        inputs, targets = spec.example_inputs(BATCH, dtype=torch.float64)
        planned = executor_optimize(
            model, inputs, spec.loss, targets=targets, memory_ratio=1.0, strategy="chen-sqrt",
            planner_url=f"http://127.0.0.1:{port}", repeats=1, warmup=0, progress=False,
            d2h_gb_per_s=10, h2d_gb_per_s=10,
        )
        assert planned.schedule.summary.strategy == "chen-sqrt"
        torch.manual_seed(1)
        loss = planned(inputs, targets)
        loss.backward()
        assert_same(model, plain_model, loss, plain_step(plain_model, spec, inputs, targets))
        # a budget below the model's fixed memory is refused here, before anything is measured or sent
        with pytest.raises(BudgetError, match="fixed memory.*smallest budget"):
            executor_optimize(model, inputs, spec.loss, targets=targets, budget="1KiB", strategy="chen-sqrt",
                              planner_url=f"http://127.0.0.1:{port}", repeats=1, warmup=0, progress=False)
        # and a plan the service cannot make comes back as its answer, with the smallest budget it knows
        with pytest.raises(PlannerServiceError, match="no plan fits.*smallest budget that works"):
            plan_remotely(f"http://127.0.0.1:{port}", planned.profile, 1024, None, "chen-sqrt", 10)
    finally:
        server.terminate()
        server.wait(timeout=30)

"""The compiled replay (executor.engine.compiled_nodes): planning nodes as Inductor kernels.

The zoo trains under keep-all, mosos at 0.6 and recompute-heavy plans with compiled nodes: loss and every
gradient within the rounding fusion changes of plain PyTorch's (float32: 1e-5 of the gradient's largest
magnitude; float64: 1e-12), bitwise equal to itself from run to run, every node at its profiled size and the
ledger within the budget; nodes alike share one kernel; and a node Inductor refuses runs eagerly, reported with
the reason."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import executor  # noqa: E402
from executor.engine import conv_algorithms  # noqa: E402
from executor.engine import compiled_nodes  # noqa: E402
from executor.measure import profiler  # noqa: E402
from executor.engine.compiled_nodes import EAGER  # noqa: E402
from executor.measure.measuring import with_implementations  # noqa: E402
from executor.measure.profiler import profile_step  # noqa: E402
from executor.replay.replay import PlannedModule  # noqa: E402
from executor.engine.schedules import recompute_everything_schedule  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.schedule import Compute  # noqa: E402
from tests.zoo import ZOO, plannable_ratio  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.fixture(autouse=True)
def _kernels_only(request, monkeypatch):
    """These tests are about the kernels: the profile offers no eager alternative beside a node's kernel, so which
    nodes run compiled does not hang on which of the two a noisy clock timed faster (the alternative has tests of
    its own, marked `eager_alternative`)."""
    if request.node.get_closest_marker("eager_alternative") is None:
        monkeypatch.setattr(profiler, "_eager_pass", lambda *args, **kwargs: [])


def _plain_step(model, args, kwargs, targets, loss_fn):
    output = model(*args, **kwargs)
    loss = loss_fn(output, targets) if targets is not None else loss_fn(output)
    loss.backward()
    return loss


def _planned_step(planned, args, kwargs, targets):
    loss = planned(*args, targets=targets, **kwargs)
    loss.backward()
    return loss


def _gradients(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close(kind, loss, plain_loss, gradients, plain_gradients, dtype, exact_gradients=None):
    """`exact_gradients` (float64): a gradient that is a sum cancelling to far below its terms (a bias's, summed
    over the batch) is as exact as its terms' rounding, and a kernel that rounds those terms otherwise (Inductor's
    vectorised tanh, fused backward chains) moves it by as much: such a gradient may differ from plain PyTorch's
    by up to ten times plain PyTorch's own error."""
    tolerance = TOLERANCE[dtype]
    assert abs(loss.item() - plain_loss.item()) <= tolerance * max(abs(plain_loss.item()), 1e-30), (
        f"{kind}: loss {loss.item()} vs {plain_loss.item()}")
    assert gradients.keys() == plain_gradients.keys(), kind
    # a gradient zero in exact arithmetic (a key projection's bias, which softmax cancels) is rounding alone: it is
    # measured against the model's largest gradient, as is every gradient below 1000 ulps of that
    largest = max(reference.abs().max().item() for reference in plain_gradients.values())
    floor = 1000 * torch.finfo(dtype).eps * largest
    for name, reference in plain_gradients.items():
        scale = reference.abs().max().item()
        difference = (gradients[name] - reference).abs().max().item()
        allowed = tolerance * (scale if scale >= floor else largest)
        if exact_gradients is not None:
            allowed = max(allowed, 10 * (reference.double() - exact_gradients[name]).abs().max().item())
        assert difference <= allowed, (
            f"{kind}: {name} differs by {difference:.3e} of {scale:.3e} (relative {difference / scale:.2e})")


def _exact_gradients(model, x, y) -> dict:
    exact = copy.deepcopy(model).double()
    _plain_step(exact, (x.double(),), {}, y, nn.functional.cross_entropy)
    return _gradients(exact)


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", [(name, torch.float32) for name in ZOO] + [("bert", torch.float64)])
def test_the_zoo_trains_under_the_compiled_replay_within_rounding(name, dtype):
    model, args, kwargs, targets, loss_fn = ZOO[name](dtype)
    profile, captured = profile_step(model, args, loss_fn, targets, kwargs=kwargs, repeats=1, warmup=0,
                                     algorithms=("native",), compile=True)
    record = captured.compiled
    assert record is not None and record.compiled, f"{name}: no node was compiled ({record.describe()})"
    assert len(set(record.compiled.values())) <= len(record.compiled)
    budget = max(int(profile.fixed_bytes + 0.6 * (max(1, _keep_all_peak(profile) - profile.fixed_bytes))),
                 int(plannable_ratio(profile) * _keep_all_peak(profile)))  # the CNNs' stem bounds every plan
    schedules = {
        "keep-all": plan(profile, strategy="keep-all"),
        "mosos at 0.6": plan(profile, budget, strategy="mosos", time_limit_s=2, workers=1, seed=0),
        "recompute-heavy": recompute_everything_schedule(profile),
    }
    regions_ran = 0
    for kind, schedule in schedules.items():
        runs = []
        # node kernels, strict (every node's real size against the profile, freed memory released); then twice
        # with consecutive nodes compiled as regions (strict mode checks node by node, so it runs none)
        for strict in (True, False, False):
            planned_model = copy.deepcopy(model)
            planned = PlannedModule(planned_model, profile, schedule, loss_fn, profiled=captured, strict=strict,
                                    compile=True)
            torch.manual_seed(3)
            loss = _planned_step(planned, args, kwargs, targets)
            runs.append((loss.detach().clone(), _gradients(planned_model)))
            assert planned.peak_memory_bytes == planned.simulated_peak_bytes, kind
            if schedule.budget_bytes is not None:
                assert planned.peak_memory_bytes <= schedule.budget_bytes, kind
            if not strict:
                regions_ran += len(planned.compiled_nodes.regions)
        plain_model = copy.deepcopy(model)
        torch.manual_seed(3)
        plain_loss = _plain_step(plain_model, args, kwargs, targets, loss_fn)
        plain_gradients = _gradients(plain_model)
        _assert_close(f"{name} {dtype} {kind}", runs[0][0], plain_loss, runs[0][1], plain_gradients, dtype)
        _assert_close(f"{name} {dtype} {kind} regions", runs[1][0], plain_loss, runs[1][1], plain_gradients, dtype)
        assert torch.equal(runs[1][0], runs[2][0]) and _bitwise(runs[1][1], runs[2][1]), (
            f"{name} {kind}: two compiled runs differ")
    assert regions_ran, f"{name}: no region was compiled"


def _keep_all_peak(profile) -> int:
    from planner.strategies.keep_all import keep_all_peak_bytes

    return keep_all_peak_bytes(profile)


class Chain(nn.Module):
    """Elementwise chains between matrix products: what fusion is for."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        x = torch.tanh(self.a(x) * 0.5 + 1.0).sigmoid()
        x = torch.tanh(self.b(x) * 0.5 + 1.0).sigmoid()
        x = torch.relu(self.c(x) - 0.1) * 2.0
        return self.head(x)


def _refuse_graphs(monkeypatch, refusal) -> None:
    """Inductor made to refuse every graph for which `refusal(graph)` gives a reason (as it refuses what it cannot
    lower), with the process' kernels and refusals emptied for the test."""
    real_compile = compiled_nodes._compile

    def refusing(module, examples):
        reason = refusal(module.graph)
        if reason is not None:
            raise NotImplementedError(reason)
        return real_compile(module, examples)

    monkeypatch.setattr(compiled_nodes, "_compile", refusing)
    monkeypatch.setattr(compiled_nodes, "_KERNELS", {})
    monkeypatch.setattr(compiled_nodes, "_FAILURES", {})


def test_a_node_inductor_refuses_runs_eagerly_and_the_report_says_why(monkeypatch):
    """Inductor made to refuse every graph holding tanh (as it refuses what it cannot lower): those nodes run
    eagerly, the step still matches plain PyTorch, and the progress and the report name them with the reason."""
    _refuse_graphs(monkeypatch, lambda graph: "no lowering for aten.tanh in this test" if any(
        node.target is torch.ops.aten.tanh.default for node in graph.nodes) else None)
    torch.manual_seed(0)
    model = Chain()
    x, y = torch.randn(512, 64), torch.randint(0, 8, (512,))
    messages = []
    planned = executor.optimize(copy.deepcopy(model), (x,), nn.functional.cross_entropy, targets=y, repeats=1, warmup=0, time_limit_s=5, workers=1, progress=messages.append,
                                compile=True, cache=False, timed_steps=1)
    record = planned.compiled_nodes
    refused = {node: reason for node, reason in record.eager.items() if reason.startswith("Inductor refused")}
    assert refused, record.describe()
    assert all("no lowering for aten.tanh" in reason for reason in refused.values())
    assert record.compiled, "the nodes without tanh still compile"
    assert any(m.startswith("compiled:") and "Inductor refused" in m for m in messages), messages
    plain_model = copy.deepcopy(model)
    plain_loss = _plain_step(plain_model, (x,), {}, y, nn.functional.cross_entropy)
    loss = _planned_step(planned, (x,), {}, y)
    _assert_close("refused", loss, plain_loss, _gradients(planned.model), _gradients(plain_model), torch.float32)
    report = planned.report().describe()
    for node in refused:
        assert f"eager {node}: Inductor refused it" in report, report


def test_a_region_inductor_refuses_runs_node_by_node_and_the_report_says_why(monkeypatch):
    """Inductor made to refuse every graph with two matrix products (a region across two linear layers; no
    single node has two): those regions run node by node, each node compiled on its own where it can be, the
    step still matches plain PyTorch, and the record names the regions and the reason."""
    products = (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
    _refuse_graphs(monkeypatch, lambda graph: "no two matrix products in one kernel in this test" if sum(
        node.target in products for node in graph.nodes) >= 2 else None)
    torch.manual_seed(0)
    model = Chain()
    x, y = torch.randn(512, 64), torch.randint(0, 8, (512,))
    planned = executor.optimize(copy.deepcopy(model), (x,), nn.functional.cross_entropy, targets=y, repeats=1,
                                warmup=0, time_limit_s=5, workers=1, progress=False, compile=True, cache=False,
                                timed_steps=0)
    record = planned.compiled_nodes
    refused = record.regions_refused
    assert refused and all("no two matrix products" in reason for reason in refused.values()), record.describe()
    assert "regions ran node by node: " in record.describe() and "no two matrix products" in record.describe()
    assert record.compiled, "the nodes still compile on their own"
    plain_model = copy.deepcopy(model)
    plain_loss = _plain_step(plain_model, (x,), {}, y, nn.functional.cross_entropy)
    loss = _planned_step(planned, (x,), {}, y)
    _assert_close("refused region", loss, plain_loss, _gradients(planned.model), _gradients(plain_model),
                  torch.float32, _exact_gradients(model, x, y))
    assert planned.peak_memory_bytes == planned.simulated_peak_bytes


def test_consecutive_nodes_run_as_one_region_within_the_budget():
    """Nothing scheduled between them: the nodes of Chain's forward run as compiled regions (fewer kernels called
    than nodes computed), the step matches plain PyTorch within rounding and itself bitwise, and the ledger, which
    counts a node computed and freed inside a region at its planned size, equals the simulator's peak."""
    torch.manual_seed(0)
    model = Chain()
    x, y = torch.randn(512, 64), torch.randint(0, 8, (512,))
    profile, captured = profile_step(copy.deepcopy(model), (x,), nn.functional.cross_entropy, y, repeats=1, warmup=0,
                                     algorithms=("native",), compile=True)
    budget = int(profile.fixed_bytes + 0.6 * (_keep_all_peak(profile) - profile.fixed_bytes))
    for schedule in (plan(profile, strategy="keep-all"), plan(profile, budget, strategy="mosos", time_limit_s=2,
                                                                workers=1, seed=0)):
        runs = []
        for regions in (True, True, False):
            planned_model = copy.deepcopy(model)
            planned = PlannedModule(planned_model, profile, schedule, nn.functional.cross_entropy,
                                    profiled=captured, compile=True, compile_regions=regions)
            loss = _planned_step(planned, (x,), {}, y)
            runs.append((loss.detach().clone(), _gradients(planned_model)))
            assert planned.peak_memory_bytes == planned.simulated_peak_bytes
            assert planned.peak_memory_bytes <= (schedule.budget_bytes or planned.peak_memory_bytes)
            if regions:
                record = planned.compiled_nodes
                assert record.regions, record.describe()
                assert "region_" in planned._prepared.source
        plain_model = copy.deepcopy(model)
        plain_loss = _plain_step(plain_model, (x,), {}, y, nn.functional.cross_entropy)
        _assert_close("regions", runs[0][0], plain_loss, runs[0][1], _gradients(plain_model), torch.float32,
                      _exact_gradients(model, x, y))
        assert torch.equal(runs[0][0], runs[1][0]) and _bitwise(runs[0][1], runs[1][1])
        assert "region_" not in planned._prepared.source  # compile_regions=False: node kernels only


def test_optimize_compiles_measures_and_reports_the_compiled_step():
    torch.manual_seed(0)
    model = Chain()
    x, y = torch.randn(512, 64), torch.randint(0, 8, (512,))
    messages = []
    planned = executor.optimize(copy.deepcopy(model), (x,), nn.functional.cross_entropy, targets=y, memory_ratio=0.8,
                                repeats=1, warmup=0, time_limit_s=5, workers=1, progress=messages.append,
                                compile=True, cache=False, timed_steps=1)
    assert any(m.startswith("compiled:") and "kernels" in m for m in messages), messages
    assert "compiled nodes (Inductor)" in planned.profile.provenance.notes
    plain_model = copy.deepcopy(model)
    plain_loss = _plain_step(plain_model, (x,), {}, y, nn.functional.cross_entropy)
    loss = _planned_step(planned, (x,), {}, y)
    _assert_close("optimize", loss, plain_loss, _gradients(planned.model), _gradients(plain_model), torch.float32)
    assert planned.peak_memory_bytes <= planned.schedule.budget_bytes
    assert "compiled:" in planned.report().describe()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["channels-last", "batch-split", "batch-split-sum"])
@pytest.mark.parametrize("name", ["resnet", "mobilenet"])
def test_compiled_plans_may_run_convolutions_on_channels_last_or_split_within_rounding(name, algorithm):
    """optimize(compile=True) offers ATen's convolutions on channels-last copies and on parts of the batch beside
    native ones (and nothing else: im2col and winograd only when asked for); with every convolution on either,
    depthwise ones included, the step is plain PyTorch's within the compiled replay's tolerance, and the ledger is
    the simulator's. On channels-last the loss comes out bitwise (oneDNN's NHWC forward rounds as its NCHW one
    here); the batch splits are offered from a batch of 64."""
    from executor.measure.measuring import substituted

    model, args, kwargs, targets, loss_fn = ZOO[name](torch.float32)
    split = algorithm in conv_algorithms.BATCH_SPLITS
    if split:  # offered from a batch of 64 (parts of 16 samples)
        generator = torch.Generator().manual_seed(5)
        args, targets = (torch.randn(64, 3, 32, 32, generator=generator),), torch.randint(0, 4, (64,),
                                                                                         generator=generator)
    planned = executor.optimize(copy.deepcopy(model), args, loss_fn, targets=targets, kwargs=kwargs, budget=None,
                                strategy="keep-all", repeats=1, warmup=0, progress=False, compile=True, cache=False)
    profile = planned.profile
    convolutions = [n for n in profile.nodes if "convolution" in n.op_type]
    offered = {i.name for n in convolutions for i in n.implementations}
    # the batch splits from a batch of 64: the zoo's 16 images make channels-last the only other
    assert offered == {"native", "channels-last"} | (set(conv_algorithms.BATCH_SPLITS) if split else set())
    on_algorithm = {n.id for n in convolutions if any(i.name == algorithm for i in n.implementations)}
    # batch-split where it is not native's very call: the forward and input-gradient nodes, not a filter gradient
    # alone (the whole batch's call; the stem's backward is one, its input needing no gradient); batch-split-sum
    # where it is not batch-split's: the filter gradients
    def splits(node):
        return node.kind == "forward" or "convolution_backward.input" in node.id

    expected = [n for n in convolutions if algorithm == "channels-last"
                or (splits(n) if algorithm == "batch-split" else not splits(n))]
    assert on_algorithm == {n.id for n in expected}, sorted({n.id for n in expected} ^ on_algorithm)
    schedule = substituted(plan(profile, strategy="keep-all"), lambda node: algorithm, on_algorithm)
    planned_model = copy.deepcopy(model)
    replayed = PlannedModule(planned_model, profile, schedule, loss_fn, example_inputs=args, kwargs=kwargs,
                             targets=targets, compile=True)
    torch.manual_seed(3)
    loss = _planned_step(replayed, args, kwargs, targets)
    assert "conv_backward" in replayed.code and repr(algorithm) in replayed.code
    assert "conv_forward" in replayed.code or algorithm == "batch-split-sum"  # that one runs filter gradients alone
    assert replayed.peak_memory_bytes == replayed.simulated_peak_bytes
    plain_model = copy.deepcopy(model)
    torch.manual_seed(3)
    plain_loss = _plain_step(plain_model, args, kwargs, targets, loss_fn)
    if algorithm == "channels-last":
        assert torch.equal(loss.detach(), plain_loss.detach())
    # at batch 64, with every node compiled, MobileNetV2's features.1.conv.1.weight gradient (largest value 1.5e-4)
    # comes out 4.9e-5 of itself from plain PyTorch's, native convolutions too: measured against float64 as well
    _assert_close(f"{name} {algorithm}", loss, plain_loss, _gradients(planned_model), _gradients(plain_model),
                  torch.float32, _exact_gradients(model, args[0], targets))


@pytest.mark.slow
@pytest.mark.parametrize("name,memory_ratio", [("bert", 0.6), ("gpt2", 0.6), ("inplace-cnn", 0.7)])
def test_the_allocators_peak_stays_within_the_budget_with_compiled_nodes(name, memory_ratio):
    """Compiling, profiling on the kernels, planning, the timed step and one with compiled regions, every
    allocation counted by the allocator's own events: the rise over what the caller already holds stays within the budget. (The CNN's measuring
    pass needs 0.68 of its keep-all peak, now that keep-all holds no more than eager autograd does.)"""
    from executor.measure.allocations import AllocationTrace
    from tests.test_budgeted_profiling import _resident_bytes

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, args, kwargs, targets, loss_fn = ZOO[name]()
    resident = _resident_bytes(model, args, kwargs, targets)
    with AllocationTrace() as trace:
        planned = executor.optimize(model, args, loss_fn, targets=targets, kwargs=kwargs,
                                    memory_ratio=memory_ratio, repeats=1, warmup=0, time_limit_s=5, workers=1,
                                    progress=False, compile=True, cache=False, timed_steps=1)
        for _ in range(2):  # the timed step runs node by node, the next one with compiled regions
            for parameter in planned.parameters():
                parameter.grad = None  # as optimizer.zero_grad() leaves them
            _planned_step(planned, args, kwargs, targets)
    budget = planned.schedule.budget_bytes
    assert planned.compiled_nodes.compiled, planned.compiled_nodes.describe()
    assert planned.compiled_nodes.regions, planned.compiled_nodes.describe()
    assert trace.peak_bytes <= budget - resident, (
        f"{name}: live storage rose by {trace.peak_bytes} bytes over the {resident} held, budget {budget}")


@pytest.mark.slow
def test_the_cli_and_the_training_example_compile_as_a_user_runs_them(tmp_path):
    from planner.profile import load_profile
    from tests.test_budgeted_profiling import _fresh

    out = tmp_path / "tanh.json"
    done = _fresh("-m", "cli", "profile", "benchmarks/workloads.py:elementwise", "--budget", "256MiB", "--compile",
                  "--repeats", "1", "--warmup", "0", "-o", str(out))
    assert done.returncode == 0, done.stderr
    text = done.stdout.replace("\n", " ")
    assert "compiled:" in text and "kernels" in text, text
    assert "compiled nodes (Inductor)" in load_profile(out).provenance.notes
    trained = _fresh("examples/train.py", "--model", "benchmarks/workloads.py:elementwise", "--budget", "256MiB",
                     "--compile", "--steps", "2", "--time-limit", "5")
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "compiled:" in trained.stdout and "OVER THE BUDGET" not in trained.stdout, trained.stdout


def test_a_kernel_whose_strides_are_not_eagers_runs_eagerly_with_eagers_random_numbers():
    """The first call finds the kernel's output strides are not the graph's: the node runs its graph eagerly from
    then on, from the RNG state the kernel started from, so its dropout mask is eager's."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8, 4)
    dropped = graph.call_function(torch.ops.aten.native_dropout.default, (x, 0.5, True))
    mask_applied = graph.call_function(__import__("operator").getitem, (dropped, 0))
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (mask_applied, 2.0))
    doubled.meta["val"] = torch.empty(8, 4)
    graph.output((doubled,))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)

    def wrong_strides(value):
        torch.rand(100)  # draws random numbers, as a compiled dropout would
        return (torch.empty(4, 8).t(),)

    kernel = object.__new__(compiled_nodes._Kernel)
    kernel.module, kernel.random, kernel.compiled = module, True, wrong_strides
    kernel.layout = (((4, 1), torch.float32),)  # each input's strides and dtype
    kernel.output_layout, kernel.output_dtypes = ((4, 1),), (torch.float32,)
    kernel.forced = True  # compiled again with eager's strides required already, and still other strides
    record = compiled_nodes.CompiledNodes(compiled={"n": "key"})
    call = compiled_nodes._NodeCall(kernel, ["n"], record)
    value = torch.randn(8, 4)
    torch.manual_seed(7)
    (expected,) = module(value)
    torch.manual_seed(7)
    (got,) = call(value)
    assert torch.equal(got, expected)
    assert record.eager == {"n": "compiled, its outputs' strides were not eager's"} and not record.compiled
    torch.manual_seed(7)
    assert torch.equal(call(value)[0], expected)  # and eagerly from then on


def test_a_kernel_whose_output_strides_are_not_eagers_is_compiled_again_requiring_them():
    """Inductor lays out a value it makes as it likes; the graph (eager) made it transposed. The first call sees
    other strides, compiles the kernel again requiring eager's, and hands on eager's values in eager's layout."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8, 4)
    y = graph.placeholder("y")
    y.meta["val"] = torch.empty(8, 4)
    summed = graph.call_function(torch.ops.aten.add.Tensor, (x, y))
    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (summed, 3.0))
    scaled.meta["val"] = torch.empty_strided((8, 4), (1, 8))  # eager's layout: column-major
    graph.output((scaled,))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    fake = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake:
        examples = [torch.empty(8, 4), torch.empty(8, 4)]
    kernel = compiled_nodes._Kernel(module, examples, "test transposed output")
    record = compiled_nodes.CompiledNodes(compiled={"n": kernel.key})
    call = compiled_nodes._NodeCall(kernel, ["n"], record)
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    (got,) = call(a, b)
    assert kernel.forced and record.kernels_compiled == 1 and record.eager == {}
    assert got.stride() == (1, 8) and torch.equal(got, (a + b) * 3.0)
    (again,) = call(a, b)
    assert again.stride() == (1, 8) and torch.equal(again, got)


def _matmul_then_add_graph():
    """(a @ b + c) * 2 in float32, as a captured graph holds it (a float32 matrix product autocast would cast)."""
    graph = torch.fx.Graph()
    inputs = []
    for name in "abc":
        node = graph.placeholder(name)
        node.meta["val"] = torch.empty(16, 16)
        inputs.append(node)
    product = graph.call_function(torch.ops.aten.mm.default, (inputs[0], inputs[1]))
    summed = graph.call_function(torch.ops.aten.add.Tensor, (product, inputs[2]))
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (summed, 2.0))
    doubled.meta["val"] = torch.empty(16, 16)
    graph.output((doubled,))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        examples = [torch.empty(16, 16) for _ in range(3)]
    return module, examples


def test_a_kernel_compiled_under_the_users_autocast_computes_the_graphs_dtypes():
    """Regions compile when the planned module is first called, inside the user's `with torch.autocast(...)`. The
    graph already carries autocast's casts, so the compile ignores the ambient autocast: traced under it, this
    float32 product came out in bfloat16 (GPT-2's attention recomputed in a backward region, bf16: the next node
    read float32 values from bfloat16 storage, gradients of 1e26)."""
    module, examples = _matmul_then_add_graph()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kernel = compiled_nodes._Kernel(module, examples, "test ambient autocast")
    a, b, c = (torch.randn(16, 16) for _ in range(3))
    (got,) = kernel.compiled(a, b, c)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (a @ b + c) * 2.0, rtol=1e-6, atol=1e-6)


def test_a_kernel_whose_output_dtypes_are_not_eagers_runs_eagerly():
    """A kernel handing on another dtype than the graph's (what the ambient autocast once caused) is caught at its
    first call: the node runs its graph eagerly from then on, and the report says why."""
    module, _ = _matmul_then_add_graph()
    kernel = object.__new__(compiled_nodes._Kernel)
    kernel.module, kernel.random, kernel.forced = module, False, False
    kernel.layout = (((16, 1), torch.float32),) * 3  # each input's strides and dtype
    kernel.output_layout, kernel.output_dtypes = ((16, 1),), (torch.float32,)
    kernel.compiled = lambda a, b, c: (((a @ b + c) * 2.0).bfloat16(),)
    record = compiled_nodes.CompiledNodes(compiled={"n": "key"})
    call = compiled_nodes._NodeCall(kernel, ["n"], record)
    a, b, c = (torch.randn(16, 16) for _ in range(3))
    (got,) = call(a, b, c)
    assert got.dtype == torch.float32 and torch.equal(got, module(a, b, c)[0])
    assert record.eager == {"n": "compiled, its outputs' dtypes were not eager's"} and not record.compiled


class MixedPrecisionChain(nn.Module):
    """Under bfloat16 autocast, with a float32 block (autocast off) whose matrix product and chain fuse."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.w = nn.Parameter(torch.randn(64, 64) / 8)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        x = torch.tanh(self.a(x) * 0.5 + 1.0)
        with torch.autocast("cpu", enabled=False):
            x = torch.tanh(x.float() @ self.w * 0.5 + 1.0).sigmoid()
        return self.head(x)


def test_regions_compiled_under_the_users_autocast_train_as_eager_autocast_does():
    """The planned module is called as users call it, inside `with torch.autocast("cpu", dtype=torch.bfloat16)`,
    and compiles its regions there: every kernel keeps the graph's dtypes (none falls back for it) and the step
    matches plain autocast within bfloat16's rounding."""
    torch.manual_seed(0)
    model = MixedPrecisionChain()
    x, y = torch.randn(256, 64), torch.randint(0, 8, (256,))
    plain_model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_loss = nn.functional.cross_entropy(plain_model(x), y)
    plain_loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = executor.optimize(model, (x,), nn.functional.cross_entropy, targets=y, memory_ratio=1.0,
                                    repeats=1, warmup=0, time_limit_s=5, workers=1, progress=False, compile=True,
                                    cache=False, timed_steps=0)
        loss = planned(x, targets=y)
    loss.backward()
    record = planned.compiled_nodes
    assert record.regions, record.describe()
    assert not [reason for reason in record.eager.values() if "dtypes" in reason], record.describe()
    gradients, plain_gradients = _gradients(model), _gradients(plain_model)
    largest = max(g.abs().max().item() for g in plain_gradients.values())
    for name, reference in plain_gradients.items():
        assert gradients[name].dtype == reference.dtype, name
        assert (gradients[name] - reference).abs().max().item() <= 2e-2 * largest, name
    assert abs(loss.item() - plain_loss.item()) <= 1e-2 * abs(plain_loss.item())


def test_regions_stop_at_a_convolutions_input_stand_in():
    """A convolution's input gradient reads a stand-in of its input (its shape over one element's storage, so the
    input can go once the filter gradient is done). Regions stop there and run on around it: before, every region
    holding one was refused as reading a value that is not a tensor (8 of ResNet-18-small's), and compiled, the
    stand-in could be written out in full, memory the plan does not have."""
    import models

    spec = models.get_model("resnet18", small=True)
    torch.manual_seed(0)
    model = spec.build()
    inputs, targets = spec.example_inputs(16)
    profile, captured = profile_step(copy.deepcopy(model), (inputs,), spec.loss, targets, repeats=1, warmup=0,
                                     algorithms=("native",), compile=True)
    planned_model = copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile, plan(profile, strategy="keep-all"), spec.loss,
                            profiled=captured, compile=True)
    loss = _planned_step(planned, (inputs,), {}, targets)
    record = planned.compiled_nodes
    assert record.regions and not [r for r in record.regions_refused.values() if "not a tensor" in r], \
        record.describe()
    assert "region_" in planned._prepared.source
    assert planned.peak_memory_bytes == planned.simulated_peak_bytes
    plain_model = copy.deepcopy(model)
    plain_loss = _plain_step(plain_model, (inputs,), {}, targets, spec.loss)
    _assert_close("regions", loss, plain_loss, _gradients(planned_model), _gradients(plain_model), torch.float32)


class Normalised(nn.Module):
    """Convolutions, batch norms and ReLUs, as a CNN's blocks: the batch norms' first computations write the
    model's running statistics."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.a_norm = nn.BatchNorm2d(8)
        self.b = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.b_norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.a_norm(self.a(x)))
        x = torch.relu(self.b_norm(self.b(x)) + x)
        return self.head(x.mean((2, 3)))


def test_batch_norms_writing_running_statistics_compile_and_join_regions():
    """A batch norm's first computation hands its new running statistics on from its kernel (eager's own batch norm
    call inside, so eager's values) and they are written into the model's buffers after it: it compiles and joins
    regions with the ReLU after it, where it used to run eagerly (reported as updating the statistics in place).
    After two steps the buffers are plain PyTorch's bitwise, under keep-all and under a recompute-heavy plan."""
    torch.manual_seed(0)
    model = Normalised()
    x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 4, (32,))
    profile, captured = profile_step(copy.deepcopy(model), (x,), nn.functional.cross_entropy, y, repeats=1, warmup=0,
                                     algorithms=("native",), compile=True)
    plain_model = copy.deepcopy(model)
    for _ in range(2):
        plain_model.zero_grad(set_to_none=True)
        plain_loss = _plain_step(plain_model, (x,), {}, y, nn.functional.cross_entropy)
    for schedule in (plan(profile, strategy="keep-all"), recompute_everything_schedule(profile)):
        planned_model = copy.deepcopy(model)
        planned = PlannedModule(planned_model, profile, schedule, nn.functional.cross_entropy, profiled=captured,
                                compile=True)
        for _ in range(2):
            planned_model.zero_grad(set_to_none=True)
            loss = _planned_step(planned, (x,), {}, y)
        record = planned.compiled_nodes
        assert not [reason for reason in record.eager.values() if "batch norm" in reason], record.describe()
        norms = [node for node in profile.node_by_id if "norm" in node and not node.startswith("backward")]
        in_regions = {node for nodes in record.regions.values() for node in nodes}
        assert in_regions & set(norms), (norms, record.describe())
        for (name, buffer), plain_buffer in zip(planned_model.named_buffers(), plain_model.buffers()):
            assert torch.equal(buffer, plain_buffer), name
        assert planned.peak_memory_bytes == planned.simulated_peak_bytes
        _assert_close("batch norm", loss, plain_loss, _gradients(planned_model), _gradients(plain_model),
                      torch.float32)


@pytest.mark.eager_alternative
def test_a_compiled_profile_offers_each_kernels_eager_code_and_the_plan_chooses():
    """Beside each compiled node's kernel ("default") the profile offers its eager code ("eager"), timed and measured
    in a pass of its own, so the planner keeps eager code where Inductor's is slower (a max pool's backward on the
    CPU). A node the plan runs eagerly is reported so, stays out of regions, and the step still matches plain
    PyTorch with the ledger at the simulated peak."""
    torch.manual_seed(0)
    model = Chain()
    x, y = torch.randn(512, 64), torch.randint(0, 8, (512,))
    profile, captured = profile_step(copy.deepcopy(model), (x,), nn.functional.cross_entropy, y, repeats=1, warmup=0,
                                     algorithms=("native",), compile=True)
    compiled = set(captured.compiled.compiled)
    assert compiled, captured.compiled.describe()
    for node in profile.nodes:
        names = [implementation.name for implementation in node.implementations]
        assert names == (["default", EAGER] if node.id in compiled else ["default"]), (node.id, names)
        assert all(implementation.time_ms > 0 for implementation in node.implementations), node.id
    keep_all = plan(profile, strategy="keep-all")
    for _, _, op in keep_all.operations():
        if isinstance(op, Compute):  # keep-all runs each node's fastest code
            assert op.implementation == profile.node_by_id[op.node].fastest.name, op.node
    run_eagerly = set(sorted(compiled)[::2])
    schedule = with_implementations(profile, keep_all, lambda node: EAGER if node in run_eagerly else "default", None)
    assert {op.node for _, _, op in schedule.operations()
            if isinstance(op, Compute) and op.implementation == EAGER} == run_eagerly
    planned_model = copy.deepcopy(model)
    planned = PlannedModule(planned_model, profile, schedule, nn.functional.cross_entropy, profiled=captured,
                            compile=True)
    loss = _planned_step(planned, (x,), {}, y)
    record = planned.compiled_nodes
    for node in run_eagerly:
        assert record.eager.get(node) == "the plan runs it eagerly (measured faster than its kernel)", node
    assert not run_eagerly & {node for nodes in record.regions.values() for node in nodes}
    assert planned.peak_memory_bytes == planned.simulated_peak_bytes
    plain_model = copy.deepcopy(model)
    plain_loss = _plain_step(plain_model, (x,), {}, y, nn.functional.cross_entropy)
    _assert_close("eager alternative", loss, plain_loss, _gradients(planned_model), _gradients(plain_model),
                  torch.float32, _exact_gradients(model, x, y))


_UNDER_CI = """
import copy, torch
from torch import nn
from executor.engine import batch_norm_decomposition
# batch norm as on a GPU, where it stays ATen's kernel inside a compiled one (on the CPU it is decomposed)
batch_norm_decomposition.DECOMPOSITIONS.clear()
from executor.measure.profiler import profile_step
from executor.replay.replay import PlannedModule
from planner.planning import plan
from tests.test_compiled_nodes import Normalised
torch.manual_seed(0)
model = Normalised()
x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 4, (32,))
profile, captured = profile_step(copy.deepcopy(model), (x,), nn.functional.cross_entropy, y, repeats=1, warmup=0,
                                 algorithms=("native",), compile=True)
planned = PlannedModule(copy.deepcopy(model), profile, plan(profile, strategy="keep-all"),
                        nn.functional.cross_entropy, profiled=captured, compile=True)
planned(x, targets=y).backward()
record = planned.compiled_nodes
refused = [r for r in list(record.eager.values()) + list(record.regions_refused.values()) if "Inductor" in r]
assert not refused, refused
assert any("norm" in node for nodes in record.regions.values() for node in nodes), record.describe()
print("ok")
"""


def _in_a_fresh_process(script: str, **environment: str):
    """Run `script` in a fresh interpreter at the repository's root: a fallback Inductor makes stays its own for
    the process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(repo), **environment))


def test_kernels_holding_a_batch_norm_compile_with_ci_set_in_the_environment():
    """With `CI` set (a user's CI job, ours), Inductor refuses a fallback to ATen's kernel for an operation that has
    a decomposition, which is how batch norm, dropout and an embedding's backward stay eager's inside a kernel: every
    kernel holding one ran eagerly ("Inductor refused it ... add a decomposition to core_aten_decompositions").
    A fresh process, since a fallback once made stays Inductor's for the process."""
    result = _in_a_fresh_process(_UNDER_CI, CI="true")
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


_AS_TORCH_2_11 = """
import torch._inductor.graph as graph
from executor.engine import compiled_nodes
checked_by_table_given = graph.make_fallback


def make_fallback(op, *args, get_decomp_fn=None, **kwargs):  # torch 2.11: checked against Inductor's own table
    return checked_by_table_given(op, *args, **kwargs)


graph.make_fallback = make_fallback
if WITHOUT_REGISTERING:
    compiled_nodes._register_kept_whole_fallbacks = lambda: None
"""


@pytest.mark.parametrize("registering", [True, False], ids=["fallbacks registered up front", "as before"])
def test_kernels_holding_a_batch_norm_compile_where_inductor_checks_fallbacks_against_its_own_table(registering):
    """torch 2.11's Inductor (the GPU machines' image) checked an implicit fallback against its own decomposition
    table, not the one it was given, and refused every kernel holding a batch norm: on the GPU, ResNet's 37 batch
    norm regions ran node by node. Emulated here in a fresh process: as before, the refusal; with the kept-whole
    operations registered as fallbacks up front, they compile, and into regions."""
    result = _in_a_fresh_process(f"WITHOUT_REGISTERING = {not registering}\n" + _AS_TORCH_2_11 + _UNDER_CI)
    if registering:
        assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    else:
        assert result.returncode != 0 and "both a fallback and a decomp for same op" in result.stderr, \
            result.stderr[-3000:]


def test_measuring_passes_are_checked_against_the_budget_where_the_profile_drops_what_they_ran():
    """A compiled CNN's profile (one thread, one repeat) offered its forward convolutions on channels-last only, so
    the measuring passes, which ran native, could not be replayed on the measured figures: the check that they held
    within the budget was skipped, with a warning that read like an internal error. The replay now takes the
    provisional figures (upper estimates) for what the profile does not offer."""
    from torch.utils._pytree import tree_flatten

    from executor.measure.profiler import _check_measuring_peak, provisional_profile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1), nn.Flatten(),
                          nn.LazyLinear(10))
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    model(x)
    algorithms = ("native", "channels-last")
    profile, profiled = profile_step(model, (x,), nn.functional.cross_entropy, y, repeats=1, warmup=0,
                                     algorithms=algorithms, budget_bytes=2**30)
    provisional = provisional_profile(profiled, tree_flatten((((x,), {}, y), {}))[0], torch.device("cpu"), "sgd",
                                      algorithms, None, None, "provisional", None, lambda message: None)
    document = profile.model_dump(mode="json")
    for node in document["nodes"]:
        if node["id"].endswith("convolution") and len(node["implementations"]) > 1:
            node["implementations"] = [i for i in node["implementations"] if i["name"] != "native"]
    dropped = type(profile).model_validate(document)
    chosen = profiled.measuring
    chosen.measured_peak_bytes = None
    messages: list[str] = []
    _check_measuring_peak(dropped, provisional, chosen, messages.append)
    assert not messages and chosen.measured_peak_bytes is not None
    assert chosen.measured_peak_bytes <= 2**30

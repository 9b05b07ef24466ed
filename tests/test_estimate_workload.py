"""A user's own model estimated for a GPU of the table (executor.measure.estimate): no step run, no activation allocated,
agreeing with the reference estimator on the reference networks and with MONeT's measured P100 convolutions."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from benchmarks.estimate_agreement import NETWORKS, agreement, calibration  # noqa: E402
from executor.measure.estimate import EstimateError, estimate_profile, estimate_step, op_bytes, op_flops  # noqa: E402
from executor.measure.profiler import profile_model  # noqa: E402
from models.calibration import DEFAULT_DATA  # noqa: E402
from models.workload import load_workload  # noqa: E402
from planner.profile import load_profile  # noqa: E402
from tests.conftest import REPO, requires_shared  # noqa: E402

BERT_SMALL = "benchmarks/workloads.py:bert_small"


def _mosos(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


class _Small(nn.Module):
    """A convolution, a chain of cheap operations whose intermediates only it reads, and a linear layer."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        y = torch.nn.functional.max_pool2d(y, 2)
        return self.fc((y * 2 + 1).tanh().flatten(1))


def _small_step(batch=4):
    torch.manual_seed(0)
    return _Small(), torch.randn(batch, 3, 16, 16), torch.randint(10, (batch,))


# --- agreement with the reference estimator and with measurements --------------------------------------------------


@pytest.mark.parametrize("network,batch,tokens", NETWORKS, ids=[n[0] for n in NETWORKS])
def test_per_operation_estimate_agrees_with_the_per_layer_one(network, batch, tokens):
    """Keep-all at the fastest algorithms on a V100: step time within 15%, peak memory within 0.1% (the same
    tensors: the new path adds the loss and its incoming gradient to fixed memory, a few bytes)."""
    found = agreement(network, batch, tokens)
    assert abs(found.step_difference) <= 0.15, found
    assert abs(found.peak_difference) <= 0.001, found


def test_convolution_times_fall_within_the_calibration_tolerance():
    """VGG16 at batch 176 on a P100, captured: each forward convolution's fastest family within 1.5x of MONeT's
    measured fastest and each backward half within 2x, as the reference estimator is held to."""
    rows = calibration(requires_shared(DEFAULT_DATA))
    assert len(rows) == 13
    for row in rows:
        assert 1 / 1.5 <= row.new_ms / row.measured_ms <= 1.5, row
        assert 0.5 <= row.new_filter_ms / row.measured_filter_ms <= 2.0, row
        if row.measured_data_ms is not None:
            assert 0.5 <= row.new_data_ms / row.measured_data_ms <= 2.0, row
    assert rows[0].new_data_ms is None and all(r.new_data_ms is not None for r in rows[1:])


# --- what the profile holds ---------------------------------------------------------------------------------------


def test_the_estimate_has_the_measured_profiles_nodes_and_sizes():
    """Same planning nodes, edges, tensor sizes and fixed memory as a profile measured on this machine; times and
    workspaces are the GPU's (the measured ones hold a node's parameter gradients for accumulation too); convolutions
    carry cuDNN's families."""
    model, x, y = _small_step()
    estimated = estimate_profile(model, x, nn.functional.cross_entropy, y, gpu="a100", optimizer="sgd")
    measured = profile_model(model, x, nn.functional.cross_entropy, y, repeats=1, warmup=0, algorithms=("native",))
    assert [(n.id, n.kind, n.inputs, n.forward_node) for n in estimated.nodes] == \
        [(n.id, n.kind, n.inputs, n.forward_node) for n in measured.nodes]
    assert [(n.output_bytes, n.extra_saved_bytes) for n in estimated.nodes] == \
        [(n.output_bytes, n.extra_saved_bytes) for n in measured.nodes]
    # resident memory alike; the optimizer step's temporaries are the GPU's (a Python number wrapped for SGD's
    # update stays in host memory there, and is allowed for on the CPU)
    resident = {"optimizer_step_bytes"}
    assert estimated.fixed_memory.model_dump(exclude=resident) == measured.fixed_memory.model_dump(exclude=resident)
    assert estimated.fixed_memory.optimizer_step_bytes == 0 and measured.fixed_memory.optimizer_step_bytes == 64
    assert estimated.provenance.source == "estimated" and estimated.provenance.model_structure_sha256 is None
    assert estimated.hardware.name == "A100 SXM4 40 GB" and estimated.hardware.d2h_bandwidth_gb_per_s == 24.0
    convolutions = [n for n in estimated.nodes if n.implementations[0].name != "default"]
    # the forward convolution, and its filter gradient (its input, the model's, needs no gradient: no data half)
    assert [n.kind for n in convolutions] == ["forward", "backward"]
    assert {i.name for i in convolutions[0].implementations} >= {"implicit_gemm", "gemm", "winograd"}
    assert "implicit_gemm" in {i.name for i in convolutions[1].implementations}
    assert all(len(n.implementations) == 1 for n in estimated.nodes if n not in convolutions)


def test_a_nodes_workspace_is_its_transient_intermediates_plus_the_algorithms():
    model, x, y = _small_step(batch=8)
    profile, profiled = estimate_step(model, x, nn.functional.cross_entropy, y, gpu="v100")
    chain = next(n for n in profile.nodes if n.kind == "forward" and "tanh" in n.op_type)
    # (y * 2 + 1).tanh(): the product and the sum are transients of 8*8*8*8 floats each; the sum is made while the
    # product lives (both at once), the product is freed before tanh makes the node's output
    assert chain.implementations[0].workspace_bytes == 2 * 8 * 8 * 8 * 8 * 4
    conv = next(n for n in profile.nodes if n.kind == "forward" and n.implementations[0].name != "default")
    # the convolution's own output is a transient: only the ReLU folded into the node reads it
    transient = 8 * 8 * 16 * 16 * 4
    assert conv.implementation("implicit_gemm").workspace_bytes == transient
    assert conv.implementation("gemm").workspace_bytes == transient + 3 * 3 * 3 * 16 * 16 * 8 * 4  # + im2col


def test_flops_are_flop_counter_mode_s_and_bytes_the_tensors_sizes():
    """Each operation's FLOPs equal what FlopCounterMode counts when the operation really runs."""
    model, x, y = _small_step()
    _, profiled = estimate_step(model, x, nn.functional.cross_entropy, y, gpu="v100")
    gm = profiled.step.graph_module
    counted = 0
    for node in profiled.step.graph.nodes:
        if node.op != "call_function" or node.target.__module__ == "_operator":
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _real(n, gm))
        with FlopCounterMode(display=False) as counter:
            node.target(*args, **kwargs)
        assert op_flops(node, gm) == counter.get_total_flops(), node
        counted += counter.get_total_flops() > 0
    assert counted >= 5  # convolution, its two backward halves, the linear layer's forward and backward GEMMs
    mm = next(n for n in profiled.step.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.addmm.default)
    # bias (10, broadcast: read once), input (4, 512), weight (512, 10) read; output (4, 10) written
    assert op_bytes(mm, gm) == (10 + 4 * 512 + 512 * 10 + 4 * 10) * 4


def _real(node, gm):
    value = node.meta.get("val") if node.op != "get_attr" else getattr(gm, node.target)
    if isinstance(value, torch.Tensor):
        if value.dtype in (torch.int64, torch.int32):
            return torch.zeros(value.shape, dtype=value.dtype)
        if value.dtype == torch.bool:
            return torch.ones(value.shape, dtype=torch.bool)
        return torch.rand(value.shape, dtype=value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(torch.rand(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def test_tf32_and_the_gpu_table_change_the_times_not_the_sizes():
    model, x, y = _small_step(batch=64)
    fp32 = estimate_profile(model, x, nn.functional.cross_entropy, y, gpu="h100")
    tf32 = estimate_profile(model, x, nn.functional.cross_entropy, y, gpu="h100", math="tf32")
    p100 = estimate_profile(model, x, nn.functional.cross_entropy, y, gpu="p100")
    assert [n.size_bytes for n in fp32.nodes] == [n.size_bytes for n in tf32.nodes] == [n.size_bytes for n in p100.nodes]
    total = lambda p: sum(n.fastest.time_ms for n in p.nodes)  # noqa: E731
    assert total(tf32) < total(fp32) < total(p100)
    with pytest.raises(EstimateError, match="unknown GPU 'k80'; known: titanx, p40, p100, v100, a100, h100"):
        estimate_profile(model, x, nn.functional.cross_entropy, y, gpu="k80")
    with pytest.raises(EstimateError, match="math must be fp32 or tf32"):
        estimate_profile(model, x, nn.functional.cross_entropy, y, gpu="h100", math="fp8")


# --- no step, no activation ------------------------------------------------------------------------------------


def _allocations(run):
    """Every c10 CPU allocation and free while `run()` runs (the allocator's events, executor.measure.allocations)."""
    from executor.measure.allocations import AllocationTrace

    with AllocationTrace() as trace:
        run()
    return trace


@pytest.mark.parametrize("spec", ["benchmarks/workloads.py:elementwise", BERT_SMALL])
def test_nothing_activation_sized_is_allocated_during_the_estimate(spec):
    """The estimate allocates less at its peak than a sixteenth of the step's smallest large activation, while one
    real forward pass, watched the same way, allocates at least the largest (the watch sees what it should)."""
    workload = load_workload(spec)
    found = {}

    def run():
        found["profile"] = estimate_profile(workload.model, workload.inputs, workload.loss_fn, workload.targets,
                                            kwargs=workload.kwargs, gpu="v100")

    during = _allocations(run)
    largest_activation = max(n.output_bytes for n in found["profile"].nodes)
    assert largest_activation >= 4 * 2**20
    assert during.peak_bytes < largest_activation / 16, (max(size for _, size in during.events), during.peak_bytes)
    with torch.no_grad():
        forward = _allocations(lambda: workload.model(*workload.inputs, **workload.kwargs))
    assert max(size for _, size in forward.events) >= largest_activation


# --- the command line ----------------------------------------------------------------------------------------------


def test_cli_estimates_bert_small_in_a_fresh_process_and_mosos_plans_it(tmp_path):
    out = tmp_path / "x.json"
    done = _mosos("estimate", BERT_SMALL, "--gpu", "v100", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "keep-all" in done.stdout and "Tesla V100" in done.stdout
    profile = load_profile(out)
    assert profile.provenance.source == "estimated" and profile.provenance.input_signature == "input_ids=int64[8,128]"
    assert any("encoder.layer.0.attention" in n.id for n in profile.nodes)
    schedule = tmp_path / "s.json"
    planned = _mosos("plan", str(out), "--memory-ratio", "0.6", "--time-limit", "20", "--workers", "1",
                     "-o", str(schedule), "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(schedule.read_text())["summary"]["peak_memory_bytes"] > 0


WORKLOAD = """
import torch
from torch import nn
import torch.nn.functional as F


def build(batch_size=4):
    torch.manual_seed(0)
    return {"model": nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2)), "inputs": torch.randn(batch_size, 6),
            "targets": torch.randint(2, (batch_size,)), "loss_fn": F.cross_entropy}


def one_batch():
    return build(4)


def broken(batch_size=4):
    raise RuntimeError("no data here")
"""


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("workload") / "mine.py"
    path.write_text(textwrap.dedent(WORKLOAD))
    return path


def test_cli_estimates_a_workload_at_a_batch(workload, tmp_path):
    out = tmp_path / "w.json"
    done = _mosos("estimate", f"{workload}:build", "--gpu", "h100", "--batch", "32", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert load_profile(out).provenance.input_signature == "float32[32,6]"
    summary = _mosos("estimate", "--model", f"{workload}:build", "--gpu", "h100")  # -o is optional: a summary
    assert summary.returncode == 0 and "fits" in summary.stdout


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["{w}:build", "--gpu", "k80"], "unknown GPU 'k80'; known: titanx, p40, p100, v100, a100, h100"),
        (["{w}:build"], "needs --gpu"),
        (["{w}:nothing", "--gpu", "v100"], "defines no 'nothing'"),
        (["missing.py:build", "--gpu", "v100"], "the file missing.py does not exist"),
        (["{w}:broken", "--gpu", "v100"], "broken() raised RuntimeError: no data here"),
        (["{w}:one_batch", "--gpu", "v100", "--batch", "8"], "one_batch() takes no batch_size parameter"),
        (["{w}:build", "--gpu", "v100", "--math", "fp8"], "math must be fp32 or tf32"),
        (["{w}:build", "--gpu", "v100", "--small"], "--small is for reference networks"),
        (["vgg19", "--gpu", "v100"], "not a workload spec"),
    ],
)
def test_bad_inputs_are_messages_with_exit_code_2(workload, arguments, message):
    from typer.testing import CliRunner

    from cli import app

    result = CliRunner().invoke(app, ["estimate", *[a.format(w=workload) for a in arguments]])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output

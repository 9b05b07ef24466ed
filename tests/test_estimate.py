"""Estimated profiles: graph convention, sizes from shapes, convolution families, CLI and clear failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from models import cudnn, get_model, list_models  # noqa: E402
from models.estimator import EstimateError, estimate, estimate_module, fold_split_backward  # noqa: E402
from models.gpus import GPUS, get_gpu  # noqa: E402
from models.make_profiles import PROFILE_DIR, SHIPPED  # noqa: E402
from models.roofline import Device  # noqa: E402
from models.trace import TraceFailure  # noqa: E402
from cli import app  # noqa: E402
from planner.planning import plan  # noqa: E402
from planner.profile import load_profile, parse_profile  # noqa: E402
from planner.simulator import simulate  # noqa: E402
from planner.strategies.keep_all import keep_all_schedule  # noqa: E402

FLOAT = 4


@pytest.mark.parametrize("name", list_models())
def test_small_models_give_valid_profiles_that_keep_all_can_run(name):
    profile = estimate(name, 2, "p40", small=True)
    again = parse_profile(json.loads(profile.to_json()))  # the JSON round trip validates
    assert again.digest() == profile.digest()
    assert profile.provenance.source == "estimated"
    assert "v1.2" in profile.provenance.estimator and profile.provenance.device == "Tesla P40"
    kinds = [node.kind for node in profile.nodes]
    assert kinds.count("loss") == 1
    loss_at = kinds.index("loss")
    assert set(kinds[:loss_at]) == {"forward"} and set(kinds[loss_at + 1 :]) == {"backward"}
    by_id = profile.node_by_id
    backward = profile.nodes[loss_at + 1 :]
    for i, node in enumerate(backward):
        forward_id, suffix = node.id.rsplit(":", 1)
        assert forward_id in by_id and by_id[forward_id].kind == "forward"
        assert node.forward_node in (forward_id, f"{forward_id}:saved", None)  # :saved: the statistics handed on
        if by_id[forward_id].op_type in ("conv2d", "conv_transpose2d"):  # two nodes: filter, then data gradient
            assert suffix in ("bwd_filter", "bwd_data") and node.op_type == f"{by_id[forward_id].op_type}_{suffix.replace('bwd', 'backward')}"
            if suffix == "bwd_data":
                assert backward[i - 1].id == f"{forward_id}:bwd_filter"
        else:
            assert suffix == "bwd"
    result = simulate(profile, keep_all_schedule(profile))
    assert result.peak_memory_bytes > profile.fixed_bytes


def test_node_ids_follow_the_fx_graph():
    spec = get_model("resnet18", small=True)
    traced = torch.fx.symbolic_trace(spec.build())
    work = [n.name for n in traced.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    profile = estimate("resnet18", 2, "v100", small=True)
    forward = [node.id for node in profile.nodes if node.kind == "forward"]
    # a batch norm hands its statistics to the backward through a node of their own, right after it (its output
    # goes to a ReLU or an add, which do not save it), where they are at most a quarter of its output's bytes: all
    # but those at 1x1 pixels in the last stage (at batch 2 the statistics outweigh the output there)
    nodes = profile.node_by_id
    batch_norms = [name for name in work if nodes[name].op_type == "batch_norm"]
    handing = [name for name in batch_norms if nodes[name].extra_saved_bytes <= nodes[name].output_bytes / 4]
    assert len(batch_norms) == 20 and len(handing) == 15
    assert forward == [item for name in work for item in ([name, f"{name}:saved"] if name in handing else [name])]
    for name in batch_norms:
        if name in handing:
            saved = nodes[f"{name}:saved"]
            assert saved.inputs == [name] and saved.output_bytes == nodes[name].extra_saved_bytes
            assert nodes[f"{name}:bwd"].forward_node == saved.id and name not in nodes[f"{name}:bwd"].inputs
        else:
            assert nodes[f"{name}:bwd"].forward_node == name and name in nodes[f"{name}:bwd"].inputs
    # backward nodes per forward node (all are on the gradient path here), in reverse order: one each, except
    # a convolution's filter gradient then data gradient (none for the stem, whose input needs no gradient)
    backward = [node.id for node in profile.nodes if node.kind == "backward"]
    expected = []
    for name in reversed(work):
        if profile.node_by_id[name].op_type == "conv2d":
            expected += [f"{name}:bwd_filter"] + ([f"{name}:bwd_data"] if name != "conv1" else [])
        else:
            expected.append(f"{name}:bwd")
    assert backward == expected
    flatten = profile.node_by_id["flatten:bwd"]  # a view's backward: 0 bytes, shows the fc's gradient
    assert flatten.output_bytes == 0 and flatten.inputs == ["fc:bwd"]
    assert profile.node_by_id["avgpool:bwd"].inputs == ["flatten:bwd", "fc:bwd"]


def test_sizes_and_saved_tensors_of_vgg16():
    batch = 8
    profile = estimate("vgg16", batch, "titanx")
    nodes = profile.node_by_id
    conv1 = nodes["features_0"]
    assert conv1.op_type == "conv2d" and conv1.output_bytes == batch * 64 * 224 * 224 * FLOAT
    relu1 = nodes["features_1"]
    assert nodes["features_1:bwd"].inputs == ["features_2:bwd_data", "features_1"]  # ReLU backward reads its output
    pool = nodes["features_4"]
    assert pool.extra_saved_bytes == batch * 64 * 112 * 112 * 8  # int64 indices
    assert set(nodes["features_4:bwd"].inputs) == {"features_5:bwd_data", "features_3", "features_4"}
    # a convolution's backward is two nodes: the filter gradient reads the output gradient and the input,
    # then the data gradient reads the output gradient only (and the weights: fixed memory) and makes dx
    filter2, data2 = nodes["features_2:bwd_filter"], nodes["features_2:bwd_data"]
    assert profile.order.index(filter2.id) + 1 == profile.order.index(data2.id)
    assert filter2.inputs == ["features_3:bwd", "features_1"] and filter2.output_bytes == 0
    assert data2.inputs == ["features_3:bwd"] and data2.output_bytes == relu1.output_bytes
    assert filter2.forward_node == data2.forward_node == "features_2"
    assert (filter2.op_type, data2.op_type) == ("conv2d_backward_filter", "conv2d_backward_data")
    # the first one has no input gradient to produce: no data-gradient node
    assert "features_0:bwd_data" not in nodes and "features_0:bwd" not in nodes
    assert nodes["features_0:bwd_filter"].forward_node is None  # it reads only gradients and the model input
    assert nodes["features_0:bwd_filter"].inputs == ["features_1:bwd"]
    dropout = next(n for n in profile.nodes if n.op_type == "dropout")
    assert dropout.extra_saved_bytes == batch * 4096  # bool mask
    flatten = nodes["flatten"]
    assert flatten.output_bytes == 0 and flatten.op_type == "view"
    assert set(nodes["classifier_0"].inputs) == {"flatten", "avgpool"}  # reads the view and what it views
    params = 138_357_544 * FLOAT
    fixed = profile.fixed_memory
    assert fixed.parameters_bytes == fixed.gradients_bytes == fixed.optimizer_state_bytes == params
    assert fixed.inputs_bytes == batch * 3 * 224 * 224 * FLOAT + batch * 8
    assert nodes["loss"].output_bytes == batch * 1000 * FLOAT + FLOAT  # gradient of the logits + the loss
    adam = estimate("vgg16", batch, "titanx", optimizer="adam")
    assert adam.fixed_memory.optimizer_state_bytes == 2 * params


def test_convolutions_get_one_implementation_per_applicable_family():
    profile = estimate("resnet50", 4, "v100", small=True)
    stem = profile.node_by_id["conv1"]  # 7x7, stride 2
    names = {i.name for i in stem.implementations}
    assert names == {"implicit_gemm", "implicit_precomp_gemm", "gemm"}
    three = profile.node_by_id["layer1_0_conv2"]  # 3x3, stride 1
    assert {"winograd", "winograd_nonfused", "fft", "fft_tiling"} <= {i.name for i in three.implementations}
    assert three.smallest_workspace.workspace_bytes == 0  # a zero-workspace algorithm always exists
    families = {
        "bwd_filter": {"implicit_gemm", "gemm", "fft", "fft_tiling", "winograd_nonfused"},
        "bwd_data": {"implicit_gemm", "fft", "fft_tiling", "winograd", "winograd_nonfused"},
    }
    for part, allowed in families.items():  # each its own cuDNN algorithms, times and workspaces
        backward = profile.node_by_id[f"layer1_0_conv2:{part}"].implementations
        times = [i.time_ms for i in backward]
        workspaces = [i.workspace_bytes for i in backward]
        assert times == sorted(times) and workspaces == sorted(workspaces, reverse=True)  # a Pareto front
        assert {i.name for i in backward} <= allowed and workspaces[-1] == 0
    # strided: only the implicit algorithms compute the data gradient
    assert [i.name for i in profile.node_by_id["layer2_0_conv2:bwd_data"].implementations] == ["implicit_gemm"]


def test_folding_the_split_backward_gives_one_node_per_convolution():
    profile = estimate("vgg16", 2, "p40", small=True)
    folded = {n.id: n for n in fold_split_backward(profile.nodes)}
    nodes = profile.node_by_id
    conv = folded["features_2:bwd"]
    assert set(conv.inputs) == {"features_3:bwd", "features_1"}
    assert conv.output_bytes == nodes["features_2:bwd_data"].output_bytes
    assert conv.implementations[0].time_ms == pytest.approx(
        nodes["features_2:bwd_filter"].fastest.time_ms + nodes["features_2:bwd_data"].fastest.time_ms)
    names = [i.name for i in conv.implementations]  # Pareto pairs of the two parts' algorithms, as v1.0 had
    assert names and all(name.startswith("data=") and "+filter=" in name for name in names)
    assert conv.implementations[-1].workspace_bytes == 0
    assert [i.name for i in folded["features_0:bwd"].implementations] == [
        f"filter={i.name}" for i in nodes["features_0:bwd_filter"].implementations]
    assert folded["features_1:bwd"].inputs == ["features_2:bwd", "features_1"]
    assert "features_0:bwd" in folded and not any(":bwd_" in node_id for node_id in folded)
    parse_profile({**json.loads(profile.to_json()), "nodes": [json.loads(n.model_dump_json()) for n in folded.values()]})


def test_transformer_has_attention_and_residual_gradient_nodes():
    profile = estimate("transformer", 2, "h100", small=True, math="tf32")
    nodes = profile.node_by_id
    attention = nodes["scaled_dot_product_attention"]
    assert attention.op_type == "attention" and attention.extra_saved_bytes == 2 * 2 * 8 * 4  # log-sum-exp
    assert {"blocks_0_q", "blocks_0_k", "blocks_0_v"} <= set(nodes["scaled_dot_product_attention:bwd"].inputs)
    assert nodes["add:bwd"].forward_node is None and nodes["add:bwd"].output_bytes == nodes["add"].output_bytes
    # residual gradients do not pile up: each backward node reads at most 3 gradients
    assert max(sum(source.endswith(":bwd") for source in node.inputs) for node in profile.nodes) <= 3
    tf32 = estimate("transformer", 8, "h100", tokens=256, math="tf32")
    fp32 = estimate("transformer", 8, "h100", tokens=256)
    assert sum(n.fastest.time_ms for n in tf32.nodes) < 0.5 * sum(n.fastest.time_ms for n in fp32.nodes)


def test_gpu_table_has_sourced_figures():
    assert {"titanx", "p40", "p100", "v100", "a100", "h100"} <= set(GPUS)
    for gpu in GPUS.values():
        assert gpu.sources and gpu.memory_bytes > 0 and gpu.fp32_tflops > 0 and gpu.pcie.startswith("PCIe")
    p40 = get_gpu("P40")
    assert p40.d2h_gb_per_s >= 12 and p40.h2d_gb_per_s >= 11 and p40.memory_bytes == 24 * 2**30
    assert get_gpu("h100").peak_tflops("tf32") > get_gpu("h100").peak_tflops("fp32")
    assert get_gpu("p100").peak_tflops("tf32") == 9.3  # no tensor cores: FP32
    profile = estimate("vgg16", 1, "p40", small=True)
    assert profile.hardware.d2h_bandwidth_gb_per_s == 12 and profile.hardware.h2d_bandwidth_gb_per_s == 11


def test_cudnn_family_rules():
    device = Device(get_gpu("p100"))
    conv = cudnn.ConvShape(176, 3, 224, 224, 64, 3, 3, padding=(1, 1))
    assert cudnn.workspace_bytes("gemm", conv) == 3 * 9 * 224 * 224 * 176 * FLOAT
    assert cudnn.workspace_bytes("implicit_gemm", conv) == 0
    strided = cudnn.ConvShape(8, 64, 56, 56, 128, 3, 3, stride=(2, 2), padding=(1, 1))
    families = {a.family for a in cudnn.forward_algorithms(strided, device)}
    assert families == {"implicit_gemm", "implicit_precomp_gemm", "gemm"}
    big = cudnn.ConvShape(176, 64, 224, 224, 64, 3, 3, padding=(1, 1))  # GEMM would need 20 GB on a 16 GB card
    assert "gemm" not in {a.family for a in cudnn.forward_algorithms(big, device)}
    a, b, c = cudnn.Algorithm("a", 1.0, 100), cudnn.Algorithm("b", 2.0, 200), cudnn.Algorithm("c", 3.0, 0)
    assert cudnn.pareto([b, c, a]) == [a, c]


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor's value: fx cannot trace it
            return self.conv(x)
        return x


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 3, 1)
        self.body = nn.Sequential(nn.ReLU(), DataDependent())

    def forward(self, x):
        return self.body(self.stem(x))


def test_untraceable_model_names_the_module():
    with pytest.raises(TraceFailure) as caught:
        estimate_module(Wrapper(), (2, 3, 8, 8), "p40")
    message = str(caught.value)
    assert "'body.1'" in message and "DataDependent" in message and "test_estimate.py" in message
    assert "Traceback" not in message


def test_estimate_module_leaves_the_callers_weights_alone():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    profile = estimate_module(model, (4, 3, 16, 16), "a100")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert [n.id for n in profile.nodes if n.kind == "forward"] == ["_0", "_1", "_2", "_3"]


def test_bad_arguments_are_clear_errors():
    with pytest.raises(EstimateError, match="unknown GPU"):
        estimate("vgg16", 1, "k80")
    with pytest.raises(EstimateError, match="unknown model"):
        estimate("alexnet", 1, "p40")
    with pytest.raises(EstimateError, match="batch size"):
        estimate("vgg16", 0, "p40")
    with pytest.raises(EstimateError, match="optimizer"):
        estimate("vgg16", 1, "p40", small=True, optimizer="lion")
    with pytest.raises(EstimateError, match="math"):
        estimate("vgg16", 1, "h100", small=True, math="bf16")


def test_a_batch_beyond_the_profiles_bounds_names_the_node():
    with pytest.raises(EstimateError, match=r"out of bounds: node 'features_0' \(features\.0, conv2d\): time_ms: "
                                            r"must be at most"):
        estimate("vgg16", 100_000_000, "p40")
    model = nn.Sequential(nn.Linear(4, 4))  # tiny times, but the output alone is over a pebibyte
    with pytest.raises(EstimateError, match=r"node '_0' \(0, linear\): output_bytes: must be at most"):
        estimate_module(model, (2**47, 4), "a100")


def test_cli_estimate_writes_a_valid_profile(tmp_path: Path):
    out = tmp_path / "p.json"
    runner = CliRunner()
    result = runner.invoke(app, ["estimate", "--model", "unet", "--small", "--batch", "2", "--gpu", "p40",
                                 "--memory", "12GiB", "-o", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.hardware.memory_capacity_bytes == 12 * 2**30
    bad = runner.invoke(app, ["estimate", "--model", "unet", "--batch", "2", "--gpu", "k80", "-o", str(out)])
    assert bad.exit_code == 2 and "unknown GPU" in bad.output and "Traceback" not in bad.output
    missing = runner.invoke(app, ["estimate", "--model", "unet"])
    assert missing.exit_code == 2 and "--batch" in missing.output
    # without -o, as for a workload: the keep-all figures, nothing written
    summary = runner.invoke(app, ["estimate", "--model", "unet", "--small", "--batch", "2", "--gpu", "p40"])
    assert summary.exit_code == 0 and "keep-all (fastest algorithms): step" in summary.output, summary.output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["p.json"]


def test_every_estimated_profile_is_shipped():
    for file_name, *_ in SHIPPED:
        assert load_profile(PROFILE_DIR / file_name).provenance.source == "estimated"


@pytest.mark.parametrize("file_name", sorted(p.name for p in PROFILE_DIR.glob("*.json")))
def test_shipped_profiles_validate_and_plan_with_keep_all(file_name):
    profile = load_profile(PROFILE_DIR / file_name)
    schedule = plan(profile, strategy="keep-all")
    assert schedule.summary.peak_memory_bytes > profile.fixed_bytes


@pytest.mark.parametrize("name", ["vgg16", "resnet18", "unet", "transformer"])
def test_estimated_and_measured_profiles_describe_the_same_step(name):
    """The estimator plans module by module, the measured profiler ATen planning node by node (other ids, other
    granularity); both describe the same step: the same parameters and inputs, forward tensors of the same order."""
    profiler = pytest.importorskip("executor.measure.profiler")
    spec = get_model(name, small=True)
    inputs, targets = spec.example_inputs(2)
    measured = profiler.profile_model(spec.build(), inputs, spec.loss, targets, repeats=1, warmup=0,
                                      algorithms=("native",))
    estimated = estimate(name, 2, "p40", small=True)
    assert measured.fixed_memory.parameters_bytes == estimated.fixed_memory.parameters_bytes
    assert measured.fixed_memory.inputs_bytes == estimated.fixed_memory.inputs_bytes
    kinds = [n.kind for n in measured.nodes]
    assert kinds.index("backward") > kinds.index("loss")
    forward_bytes = [sum(n.size_bytes for n in p.nodes if n.kind != "backward") for p in (measured, estimated)]
    assert 0.5 <= forward_bytes[0] / forward_bytes[1] <= 2.0, forward_bytes


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum", "adam", "adamw"])
def test_the_optimizer_steps_temporaries_are_what_its_foreach_step_on_a_gpu_takes(optimizer):
    """The estimator's table against the executor's measurement (two steps on fake tensors on a 'cuda' device,
    where PyTorch takes its foreach kernels), on the small transformer's own parameters."""
    from executor.measure.optimizer_step import optimizer_step_bytes

    with torch.device("meta"):
        model = get_model("transformer", True).build()
    parameters = [p for p in model.parameters() if p.requires_grad]
    measured = optimizer_step_bytes(optimizer, parameters, "cuda")
    profile = estimate("transformer", 8, "h100", small=True, optimizer=optimizer)
    assert profile.fixed_memory.optimizer_step_bytes == measured
    assert measured == (profile.fixed_memory.parameters_bytes if optimizer.startswith("adam") else 0)

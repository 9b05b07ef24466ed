"""The measured profiler: the graph and its edges come from fx and from what backward really saves."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from executor.capture import capture  # noqa: E402
from executor.errors import CaptureError  # noqa: E402
from executor.profiler import optimizer_state_bytes, profile_model  # noqa: E402
from planner.errors import MososError  # noqa: E402
from planner.profile import parse_profile  # noqa: E402


class Small(nn.Module):
    """conv -> BN -> ReLU -> maxpool -> dropout -> linear, plus a skip add: every kind of saved tensor."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        y = self.drop(self.pool(y + self.conv(x)))
        return self.fc(torch.flatten(y, 1))


def _loss(output, targets):
    return nn.functional.cross_entropy(output, targets)


@pytest.fixture(scope="module")
def small_profile():
    torch.manual_seed(0)
    model = Small().double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    y = torch.tensor([1, 3])
    profile = profile_model(model, x, _loss, y, repeats=2, warmup=1, d2h_gb_per_s=8, h2d_gb_per_s=9, optimizer="adam")
    return model, x, y, profile


def test_nodes_and_edges_match_the_fx_graph(small_profile):
    model, _, _, profile = small_profile
    graph = capture(model)
    forward = [n for n in profile.nodes if n.kind == "forward"]
    assert [n.id for n in forward] == [n.id for n in graph.nodes]
    fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    for node in forward:
        expected = [s.name for s in fx_nodes[node.id].all_input_nodes if s.op not in ("placeholder", "get_attr")]
        assert node.inputs == expected
    assert [n.id for n in profile.nodes if n.kind == "loss"] == ["loss"]
    assert profile.node_by_id["loss"].inputs == ["fc"]
    backward = {n.id: n for n in profile.nodes if n.kind == "backward"}
    assert set(backward) == {f"{n.id}:bwd" for n in forward}


def test_backward_edges_are_what_backward_saves(small_profile):
    _, _, _, profile = small_profile
    nodes = profile.node_by_id
    # ReLU saves its result: its backward reads its own output, not its input
    assert "relu" in nodes["relu:bwd"].inputs and "bn" not in nodes["relu:bwd"].inputs
    # a convolution saves its input (here the model input, fixed memory): no forward edge at all
    assert not any(not s.endswith(":bwd") for s in nodes["conv:bwd"].inputs)
    # BatchNorm saves its input and batch statistics (extra saved bytes)
    assert "conv" in nodes["bn:bwd"].inputs and nodes["bn"].extra_saved_bytes > 0
    # max pooling saves its input and the indices (extra); dropout its mask (extra)
    assert {"add", "pool"} <= set(nodes["pool:bwd"].inputs) and nodes["pool"].extra_saved_bytes > 0
    assert "drop" in nodes["drop:bwd"].inputs and nodes["drop"].extra_saved_bytes > 0
    # add saves nothing; its backward reads only the gradient
    assert nodes["add:bwd"].inputs == ["pool:bwd"]
    # the gradient of a tensor read twice comes from both readers' backward nodes
    assert set(nodes["conv:bwd"].inputs) == {"bn:bwd", "add:bwd"} or set(nodes["conv_1:bwd"].inputs) == {"add:bwd"}
    assert nodes["fc:bwd"].inputs == ["flatten", "loss"]


def test_sizes_times_and_fixed_memory(small_profile):
    model, x, y, profile = small_profile
    nodes = profile.node_by_id
    assert nodes["conv"].output_bytes == 2 * 4 * 8 * 8 * 8
    assert nodes["pool"].output_bytes == 2 * 4 * 4 * 4 * 8
    assert nodes["pool"].extra_saved_bytes == 2 * 4 * 4 * 4 * 8  # int64 indices
    # the dropout mask: one element per output element (torch's CPU kernel keeps it in the input's dtype)
    assert nodes["drop"].extra_saved_bytes in (2 * 4 * 4 * 4, 2 * 4 * 4 * 4 * 8)
    assert {i.name for i in nodes["conv"].implementations} == {"native", "im2col", "im2col-chunked", "winograd"}
    assert nodes["conv"].implementation("im2col").workspace_bytes == 2 * 27 * 64 * 8
    # times are net of the timing harness's own cost, clamped at 0: tiny nodes may come out at 0
    assert all(i.time_ms >= 0 for n in profile.nodes for i in n.implementations)
    assert sum(n.fastest.time_ms for n in profile.nodes) > 0
    assert "share of a real training step" in profile.provenance.notes
    assert "less the timing's own cost" in profile.provenance.notes
    params = sum(p.numel() * 8 for p in model.parameters())
    fixed = profile.fixed_memory
    assert fixed.parameters_bytes == params and fixed.gradients_bytes == params
    assert fixed.optimizer_state_bytes == 2 * params
    assert fixed.inputs_bytes == x.numel() * 8 + y.numel() * 8
    assert fixed.other_bytes == sum(b.numel() * b.element_size() for b in model.buffers())
    assert profile.hardware.d2h_bandwidth_gb_per_s == 8 and profile.hardware.h2d_bandwidth_gb_per_s == 9
    provenance = profile.provenance
    assert provenance.source == "measured" and provenance.repeats == 2 and provenance.spread_percent >= 0
    assert provenance.model_structure_sha256 == capture(model).structure_sha256()
    assert provenance.input_signature == "float64[2,3,8,8]" and provenance.target_signature == "int64[2]"
    parse_profile(json.loads(profile.to_json()))  # round-trips through the contract


def test_a_whole_step_is_shared_out_among_its_nodes():
    """Every autograd node of a real step belongs to exactly one profile node, and every backward node
    of the profile gets a share of the step's backward."""
    from executor.profiler import LOSS_ID, Timer, _time_in_step, step_context

    torch.manual_seed(0)
    model = Small()
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    graph = capture(model)
    ctx = step_context(graph, (x,), y, _loss)
    timer = Timer(torch.device("cpu"), repeats=1, warmup=0)
    _time_in_step(ctx, timer, 0)
    ids = [node.id for node in graph.nodes] + [LOSS_ID]
    hooks = {node_id: timer.samples[("step-hooks", node_id)][0] for node_id in ids}
    assert all(hooks[node_id] >= 1 for node_id in ids)  # each call created its own autograd nodes
    assert all(timer.samples[("step", node_id, phase)][0] >= 0 for node_id in ids for phase in ("forward", "backward"))
    assert timer.samples[("step", "conv", "backward")][0] > 0 and timer.samples[("step", LOSS_ID, "backward")][0] > 0
    assert all(p.grad is None for p in model.parameters())


def test_profiling_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    rng = torch.get_rng_state()
    profile_model(model, x, _loss, torch.tensor([0, 1]), repeats=1, warmup=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_optimizer_state():
    assert optimizer_state_bytes("sgd", 100) == 0
    assert optimizer_state_bytes("momentum", 100) == 100
    assert optimizer_state_bytes("adamw", 100) == 200
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    assert optimizer_state_bytes(sgd, 100) == 100
    with pytest.raises(MososError, match="unknown optimizer"):
        optimizer_state_bytes("lion-ish", 100)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Gate()

    def forward(self, x):
        return self.inner(x)


class _Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_untraceable_model_fails_with_the_module_named():
    with pytest.raises(CaptureError) as error:
        profile_model(_Branchy(), torch.randn(2, 3), lambda out: out.sum())
    message = str(error.value)
    assert "'inner'" in message and "_Gate" in message and "control flow" in message
    assert "Traceback" not in message


def test_wrong_number_of_inputs_is_a_clear_error():
    with pytest.raises(CaptureError, match="takes 1 input"):
        profile_model(Small(), (torch.randn(2, 3, 8, 8), torch.randn(1)), lambda out: out.sum())


def test_profile_cli_writes_a_valid_profile(tmp_path):
    pytest.importorskip("models")
    output = tmp_path / "vgg.json"
    result = subprocess.run(
        [sys.executable, "-m", "cli", "profile", "--model", "vgg16", "--small", "--batch", "1",
         "--repeats", "1", "--warmup", "0", "--d2h-gb-per-s", "12", "--h2d-gb-per-s", "11", "-o", str(output)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    profile = parse_profile(json.loads(output.read_text()))
    assert profile.provenance.source == "measured" and profile.hardware.d2h_bandwidth_gb_per_s == 12
    bad = subprocess.run(
        [sys.executable, "-m", "cli", "profile", "--model", "vgg99", "--batch", "1", "-o", str(output)],
        capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2 and "unknown model" in bad.stderr and "Traceback" not in bad.stderr


SHIPPED = sorted((Path(__file__).resolve().parent.parent / "models" / "profiles").glob("*-small-cpu.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_cpu_profiles_match_todays_networks(path):
    """Each shipped measured profile validates and was made from the network `models` builds now."""
    models = pytest.importorskip("models")
    from executor.replay import check_model
    from planner.profile import load_profile

    profile = load_profile(path)
    assert profile.provenance.source == "measured"
    name = path.stem.removesuffix("-small-cpu")
    spec = models.get_model(name, small=True)
    check_model(capture(spec.build()), profile)  # raises ProfileMismatch, saying what differs
    batch = int(profile.provenance.input_signature.split("[")[1].split(",")[0])
    inputs, targets = spec.example_inputs(batch)
    from executor.capture import tensor_signature

    assert profile.provenance.input_signature == tensor_signature(inputs)
    assert profile.provenance.target_signature == tensor_signature(targets)

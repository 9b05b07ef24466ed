"""The measured profiler: planning nodes from the ATen joint graph, edges from what backward reads, sizes and
workspaces from the allocator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from executor.engine import conv_algorithms  # noqa: E402
from executor.errors import CaptureError  # noqa: E402
from executor.measure.profiler import optimizer_state_bytes, plan_step, profile_model, profile_step  # noqa: E402
from executor.measure.optimizer_step import WRAPPED_SCALARS_BYTES  # noqa: E402
from planner.errors import MososError  # noqa: E402
from planner.profile import parse_profile  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


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
    profile, step = profile_step(model, x, _loss, y, repeats=2, warmup=1, d2h_gb_per_s=8, h2d_gb_per_s=9,
                                 optimizer="adam")
    return model, x, y, profile, step


def test_planning_nodes_are_named_after_module_and_operators(small_profile):
    *_, profile, _ = small_profile
    ids = [n.id for n in profile.nodes]
    assert ids[:5] == ["conv/convolution", "bn/add", "bn/native_batch_norm", "bn/native_batch_norm:saved", "relu/relu"]
    assert "conv/convolution#2" in ids  # the same module called twice
    kinds = [n.kind for n in profile.nodes]
    assert kinds.count("loss") == 1 and kinds.index("loss") < kinds.index("backward")
    assert all(n.id.endswith(":bwd") for n in profile.nodes if n.kind == "backward")
    nodes = profile.node_by_id
    assert nodes["relu/relu"].module == "relu" and nodes["bn/native_batch_norm"].op_type == "native_batch_norm"
    # a linear layer and the log-softmax that follows it fold (nothing reads the linear's output but log-softmax)
    assert nodes["fc/addmm+1"].op_type == "addmm+log_softmax"


def test_edges_are_the_storages_each_node_reads(small_profile):
    *_, profile, _ = small_profile
    nodes = profile.node_by_id
    # ReLU's backward reads its output, not its input; BatchNorm's its input and its batch statistics, handed on
    # apart from its output (which only the ReLU reads, so that it can go after the forward, as in eager PyTorch)
    assert set(nodes["relu/threshold_backward:bwd"].inputs) == {"pool/max_pool2d_with_indices_backward:bwd", "relu/relu"}
    statistics = nodes["bn/native_batch_norm:saved"]
    assert statistics.inputs == ["bn/native_batch_norm"] and statistics.op_type == "clone"
    assert 4 * 4 * 4 <= statistics.size_bytes <= 4 * 64  # four copies: mean, inverse std, the new running pair
    assert set(nodes["bn/native_batch_norm_backward:bwd"].inputs) == {"relu/threshold_backward:bwd", "conv/convolution",
                                                                      "bn/native_batch_norm:saved"}
    assert nodes["bn/native_batch_norm_backward:bwd"].forward_node == "bn/native_batch_norm:saved"
    assert nodes["bn/native_batch_norm"].extra_saved_bytes > 0  # mean and inverse std beside the output
    # max pooling saves its input and the indices; dropout its mask, and here its output too (the linear layer
    # after it saves its input), so the mask is not handed on apart
    assert {"<root>/add", "pool/max_pool2d_with_indices"} <= set(nodes["pool/max_pool2d_with_indices_backward:bwd"].inputs)
    assert nodes["pool/max_pool2d_with_indices"].extra_saved_bytes == 2 * 4 * 4 * 4 * 8  # int64 indices
    assert "drop/native_dropout" in nodes["drop/native_dropout_backward:bwd"].inputs
    # a convolution reads the model input (fixed memory): its backward reads only the gradient
    assert all(s.endswith(":bwd") for s in nodes["conv/convolution_backward:bwd"].inputs)
    assert nodes["drop/native_dropout_backward:bwd"].forward_node == "drop/native_dropout"


def test_the_convolution_backward_is_split_in_two_planning_nodes():
    """Filter gradient first (it reads the input), then data gradient (it does not): two of the three tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 8, 3, padding=1), nn.Tanh())
    x = torch.randn(2, 3, 8, 8)
    profile = profile_model(model, x, lambda out: out.square().mean(), repeats=1, warmup=0)
    nodes = profile.node_by_id
    weight, data = nodes["2/convolution_backward.weight:bwd"], nodes["2/convolution_backward.input:bwd"]
    order = [n.id for n in profile.nodes]
    assert order.index(weight.id) < order.index(data.id)
    assert "0/convolution+1" in weight.inputs and "0/convolution+1" not in data.inputs  # only the filter half reads x
    # every algorithm but the batch splits, which a batch of 2 is too small for
    assert {i.name for i in data.implementations} == set(conv_algorithms.ALGORITHMS) - set(conv_algorithms.BATCH_SPLITS)
    assert data.output_bytes == 2 * 8 * 8 * 8 * 4  # the input gradient
    assert weight.output_bytes == 0  # the weight and bias gradients are fixed memory


def test_sizes_fixed_memory_and_provenance(small_profile):
    model, x, y, profile, step = small_profile
    nodes = profile.node_by_id
    assert nodes["conv/convolution"].output_bytes == 2 * 4 * 8 * 8 * 8
    assert nodes["pool/max_pool2d_with_indices"].output_bytes == 2 * 4 * 4 * 4 * 8
    assert {i.name for i in nodes["conv/convolution"].implementations} == set(conv_algorithms.ALGORITHMS) - set(
        conv_algorithms.BATCH_SPLITS)  # from a batch of 64
    assert all(i.time_ms >= 0 for n in profile.nodes for i in n.implementations)
    assert sum(n.fastest.time_ms for n in profile.nodes) > 0
    params = sum(p.numel() * 8 for p in model.parameters())
    fixed = profile.fixed_memory
    assert fixed.parameters_bytes == params and fixed.gradients_bytes == params
    counters = 4 * len(list(model.parameters()))  # Adam's step count per parameter, a float32 on the CPU
    assert fixed.optimizer_state_bytes == 2 * params + counters
    largest = max(p.numel() * 8 for p in model.parameters())  # Adam's step: sqrt of the second moment, the update
    assert 2 * largest <= fixed.optimizer_step_bytes - WRAPPED_SCALARS_BYTES <= 2 * largest + params
    assert fixed.inputs_bytes == x.numel() * 8 + y.numel() * 8
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # buffers, their staging copies (written back once at the end of the step), the loss handed back and its gradient
    assert fixed.other_bytes >= 2 * buffers
    assert profile.hardware.d2h_bandwidth_gb_per_s == 8 and profile.hardware.h2d_bandwidth_gb_per_s == 9
    provenance = profile.provenance
    assert provenance.source == "measured" and provenance.repeats == 2 and provenance.spread_percent >= 0
    assert provenance.model_structure_sha256 == step.step.structure_sha256()
    assert provenance.input_signature == "float64[2,3,8,8]" and provenance.target_signature == "int64[2]"
    assert "torch.profiler memory events" in provenance.notes and "share of a real step" in provenance.notes
    parse_profile(json.loads(profile.to_json()))  # round-trips through the contract


def test_workspace_counts_what_a_node_allocates_beyond_its_outputs():
    """12 x tanh(x * s): each planning node is mul+tanh, and the product is its workspace (the bytes the old
    ledger missed); im2col's measured workspace is at least its columns."""
    torch.manual_seed(0)
    model = ElementwiseChain(12)
    x = torch.randn(4, 1 << 14)  # 256 KiB
    profile = profile_model(model, x, lambda out: out.mean(), repeats=1, warmup=0)
    chain = [n for n in profile.nodes if n.op_type == "mul+tanh"]
    assert len(chain) == 12
    for node in chain:
        assert node.output_bytes == x.numel() * 4
        assert node.fastest.workspace_bytes >= x.numel() * 4  # the product x * s, freed inside the node
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Tanh())
    images = torch.randn(4, 3, 16, 16)
    measured = profile_model(conv, images, lambda out: out.mean(), repeats=1, warmup=0).node_by_id["0/convolution+1"]
    geometry = conv_algorithms.ConvGeometry.of(images.shape, (8, 3, 3, 3), 1, 1)
    columns = conv_algorithms.workspace_bytes("im2col", geometry, 4)
    assert measured.implementation("im2col").workspace_bytes >= columns


class ElementwiseChain(nn.Module):
    """Cheap element-wise operations with large activations: tanh(x * s), `layers` times."""

    def __init__(self, layers: int):
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.tensor(1.0 + 0.01 * i)) for i in range(layers))

    def forward(self, x):
        for scale in self.scales:
            x = torch.tanh(x * scale)
        return x


def test_profiling_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    rng = torch.get_rng_state()
    profile_model(model, x, _loss, torch.tensor([0, 1]), repeats=1, warmup=0, algorithms=("native",))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_optimizer_state():
    assert optimizer_state_bytes("sgd", 100) == 0
    assert optimizer_state_bytes("momentum", 100) == 100
    assert optimizer_state_bytes("adamw", 100) == 200
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    assert optimizer_state_bytes(sgd, 100) == 100
    amsgrad = torch.optim.Adam([nn.Parameter(torch.zeros(1))], amsgrad=True)
    assert optimizer_state_bytes(amsgrad, 100) == 300  # the running maximum of the second moment too
    with pytest.raises(MososError, match="unknown optimizer"):
        optimizer_state_bytes("lion-ish", 100)


def test_the_plan_key_follows_the_optimizers_state_not_its_learning_rate():
    """A run resumed after a scheduler lowered the learning rate finds its kept plan; amsgrad's extra state does not."""
    from executor.plan.cache import plan_key

    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def key(optimizer):
        return plan_key(model, lambda out: out.sum(), (x,), None, None, device=torch.device("cpu"),
                        budget={"bytes": None}, strategy="mosos", optimizer=optimizer, settings={}).digest

    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = key(adam)
    adam.param_groups[0]["lr"] = 1e-4
    assert key(adam) == first
    assert key(torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)) != first
    assert key(torch.optim.SGD(model.parameters(), lr=0.1)) != key(torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                   momentum=0.9))


def test_wrong_inputs_are_clear_errors():
    with pytest.raises(CaptureError, match=r"Small fails on these inputs .*in plain PyTorch as well: TypeError: "
                                           r"Small.forward\(\) takes 2 positional arguments but 3") as error:
        profile_model(Small(), (torch.randn(2, 3, 8, 8), torch.randn(1)), lambda out: out.sum())
    assert "Traceback" not in str(error.value)
    with pytest.raises(CaptureError, match="not ndarray"):
        profile_model(Small(), torch.randn(2, 3, 8, 8).numpy(), lambda out: out.sum())
    with pytest.raises(CaptureError, match="no trainable parameters"):
        profile_model(Small().requires_grad_(False), torch.randn(2, 3, 8, 8), lambda out: out.sum())


def test_planning_from_shapes_needs_no_memory():
    """plan_step groups the graph on fake tensors: a model far larger than this machine's memory is planned."""
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(1 << 12, 1 << 12) for _ in range(2)))
        huge = torch.empty(1 << 22, 1 << 12)  # 64 GiB of float32
    planned = plan_step(model, (huge,), None, None, lambda out: out.mean())
    assert len(planned.planning.groups) > 4


def test_profile_cli_measures_a_reference_network_and_a_users_workload(tmp_path):
    pytest.importorskip("models")
    output = tmp_path / "vgg.json"
    result = subprocess.run(
        [sys.executable, "-m", "cli", "profile", "--model", "vgg16", "--small", "--batch", "1",
         "--repeats", "1", "--warmup", "0", "--d2h-gb-per-s", "12", "--h2d-gb-per-s", "11", "-o", str(output)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    profile = parse_profile(json.loads(output.read_text()))
    assert profile.provenance.source == "measured" and profile.hardware.d2h_bandwidth_gb_per_s == 12
    workload = tmp_path / "mine.py"
    workload.write_text(
        "import torch\n"
        "def build(batch_size=3):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))\n"
        "    return {'model': model, 'inputs': torch.randn(batch_size, 6), 'targets': torch.tensor([0, 1, 1][:batch_size]),\n"
        "            'loss_fn': torch.nn.functional.cross_entropy}\n"
    )
    mine = tmp_path / "mine.json"
    result = subprocess.run(
        [sys.executable, "-m", "cli", "profile", f"{workload}:build", "--batch", "2", "--repeats", "1", "--warmup", "0",
         "-o", str(mine)], capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    profile = parse_profile(json.loads(mine.read_text()))
    assert profile.provenance.input_signature == "float32[2,6]" and profile.provenance.target_signature == "int64[2]"
    assert any(n.id == "1/gelu" for n in profile.nodes)
    # the same workload as package.module:build, importable from PYTHONPATH
    module_output = tmp_path / "module.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "cli", "profile", "mine:build", "--batch", "2", "--repeats", "1", "--warmup", "0",
         "-o", str(module_output)], capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )
    assert result.returncode == 0, result.stderr
    assert parse_profile(json.loads(module_output.read_text())).provenance.model_structure_sha256 == \
        profile.provenance.model_structure_sha256
    for arguments, message in (
        (["--model", "vgg99", "--batch", "1"], "unknown model"),
        (["not_a_module_anywhere:build"], "no module named 'not_a_module_anywhere'"),
        (["mine.py"], "is not a workload spec"),
        ([f"{workload}:nope"], "defines no 'nope'"),
        ([f"{workload}:build", "--model", "vgg16"], "either a workload"),
    ):
        bad = subprocess.run([sys.executable, "-m", "cli", "profile", *arguments, "-o", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=300, cwd=REPO)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


SHIPPED = sorted((REPO / "models" / "profiles").glob("*-small-cpu.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_cpu_profiles_match_todays_networks(path):
    """Each shipped measured profile validates and was made from the network `models` builds now."""
    models = pytest.importorskip("models")
    from executor.replay.replay import check_model
    from planner.profile import load_profile

    profile = load_profile(path)
    assert profile.provenance.source == "measured"
    name = path.stem.removesuffix("-small-cpu")
    spec = models.get_model(name, small=True)
    batch = int(profile.provenance.input_signature.split("[")[1].split(",")[0])
    inputs, targets = spec.example_inputs(batch)
    check_model(plan_step(spec.build(), (inputs,), None, targets, spec.loss), profile)  # raises ProfileMismatch
    from executor.capture.capture import tensor_signature

    assert profile.provenance.input_signature == tensor_signature((inputs,))
    assert profile.provenance.target_signature == tensor_signature(targets)

"""Reference networks: every small variant trains one step on the CPU; full sizes have the papers' shapes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
fx = pytest.importorskip("torch.fx")

from torch import nn  # noqa: E402

from models import get_model, list_models  # noqa: E402
from models.networks.vgg import vgg_blocks  # noqa: E402

ALL = ["vgg16", "vgg19", "vgg116", "vgg216", "vgg316", "vgg416", "unet", "resnet18", "resnet50", "resnet101",
       "transformer"]


def test_registry_lists_every_network():
    assert list_models() == ALL


@pytest.mark.parametrize("name", ALL)
def test_small_variant_runs_forward_and_backward_on_cpu(name):
    torch.manual_seed(0)
    spec = get_model(name, small=True)
    assert spec.name == name and spec.small
    model = spec.build()
    inputs, targets = spec.example_inputs(2)
    assert tuple(inputs.shape) == (2, *spec.input_shape)
    loss = spec.loss(model(inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000  # tiny


def _kinds(module: nn.Module) -> set[type]:
    return {type(m) for m in module.modules()}


def _functions(module: nn.Module) -> set[str]:
    graph = fx.symbolic_trace(module).graph
    return {getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("small", [True, False])
def test_structure_types_survive_in_the_small_variants(small):
    with torch.device("meta"):
        vgg = get_model("vgg16", small).build()
        resnet = get_model("resnet50", small).build()
        unet = get_model("unet", small).build()
        transformer = get_model("transformer", small).build()
    assert {nn.Conv2d, nn.ReLU, nn.MaxPool2d, nn.Dropout, nn.Linear} <= _kinds(vgg)
    assert {nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d, nn.Linear} <= _kinds(resnet)
    assert "add" in _functions(resnet)  # residual adds
    assert {nn.ConvTranspose2d, nn.MaxPool2d, nn.Dropout} <= _kinds(unet)
    assert "cat" in _functions(unet)  # skip connections
    assert {nn.LayerNorm, nn.Linear, nn.GELU} <= _kinds(transformer)
    assert {"scaled_dot_product_attention", "add"} <= _functions(transformer)


def test_full_size_parameter_counts_match_the_published_networks():
    with torch.device("meta"):
        counts = {name: sum(p.numel() for p in get_model(name).build().parameters())
                  for name in ("vgg16", "vgg19", "resnet18", "resnet50", "resnet101")}
    # torchvision's VGG16/19 and ResNet-18/50/101 (ImageNet, 1000 classes)
    assert counts == {"vgg16": 138_357_544, "vgg19": 143_667_240, "resnet18": 11_689_512,
                      "resnet50": 25_557_032, "resnet101": 44_549_160}


def test_vdnn_deep_vggs_add_twenty_convolutions_per_block_per_hundred_layers():
    assert vgg_blocks("vgg16") == (2, 2, 3, 3, 3)
    assert vgg_blocks("vgg116") == (22, 22, 23, 23, 23)
    assert vgg_blocks("vgg416") == (82, 82, 83, 83, 83)
    for name in ("vgg116", "vgg216", "vgg316", "vgg416"):
        depth = int(name[3:])
        assert sum(vgg_blocks(name)) + 3 == depth  # convolutions + 3 fully connected layers
    with pytest.raises(ValueError):
        vgg_blocks("vgg150")


def test_input_sizes_and_targets():
    spec = get_model("vgg19", image_size=227)
    assert spec.input_shape == (3, 227, 227)
    assert get_model("unet").input_shape == (3, 256, 256)
    unet = get_model("unet", small=True)
    inputs, targets = unet.example_inputs(3)
    assert targets.shape == (3, *unet.input_shape[1:]) and targets.dtype == torch.int64
    assert get_model("transformer", tokens=64).input_shape == (64, 1024)
    with pytest.raises(KeyError, match="unknown model"):
        get_model("alexnet")
    with pytest.raises(ValueError):
        get_model("unet", image_size=250)
    with pytest.raises(ValueError):
        get_model("transformer", image_size=224)
    with pytest.raises(ValueError):
        spec.example_inputs(0)


def test_example_inputs_repeat():
    spec = get_model("resnet18", small=True)
    a, _ = spec.example_inputs(2)
    b, _ = spec.example_inputs(2)
    assert torch.equal(a, b)

"""The executor's convolution algorithms agree with F.conv2d and its gradients.

Tolerances (measured on this CPU, relative to the largest magnitude of each
result): float64 at most 8e-16 (asserted at 1e-10, as promised); float32 at
most 4e-7 (asserted at 2e-5).
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from executor.conv_algorithms import (  # noqa: E402
    ALGORITHMS,
    ConvGeometry,
    applicable,
    applicable_algorithms,
    backward_algorithm,
    conv2d,
    why_not_applicable,
    workspace_bytes,
)

CASES = [
    # input, weight, stride, padding, dilation
    ((3, 5, 9, 7), (6, 5, 3, 3), 1, 1, 1),
    ((2, 4, 8, 8), (3, 4, 3, 3), 1, 0, 1),
    ((2, 4, 8, 8), (3, 4, 3, 3), 1, 2, 1),
    ((2, 3, 9, 9), (4, 3, 5, 3), 2, (1, 2), 1),
    ((5, 3, 7, 7), (2, 3, 3, 3), 1, 1, 2),
    ((1, 2, 5, 6), (4, 2, 1, 1), 1, 0, 1),
]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


def _relative_error(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_every_pair_of_forward_and_backward_algorithms_matches_torch(dtype, case):
    shape, wshape, stride, padding, dilation = case
    generator = torch.Generator().manual_seed(hash(case) % 1000)
    x = torch.randn(shape, dtype=dtype, generator=generator, requires_grad=True)
    w = torch.randn(wshape, dtype=dtype, generator=generator, requires_grad=True)
    b = torch.randn(wshape[0], dtype=dtype, generator=generator, requires_grad=True)
    reference = F.conv2d(x, w, b, stride, padding, dilation)
    grad = torch.randn(reference.shape, dtype=dtype, generator=generator)
    expected = (reference, *torch.autograd.grad(reference, (x, w, b), grad))
    geometry = ConvGeometry.of(shape, wshape, stride, padding, dilation)
    names = applicable_algorithms(geometry)
    assert "native" in names and "im2col" in names and "im2col-chunked" in names
    for forward, backward in itertools.product(names, names):
        out = conv2d(x, w, b, stride, padding, dilation, algorithm=forward)
        with backward_algorithm(backward):
            got = (out, *torch.autograd.grad(out, (x, w, b), grad))
        for what, a, e in zip(("output", "grad input", "grad weight", "grad bias"), got, expected):
            assert a.shape == e.shape
            error = _relative_error(a, e)
            assert error <= TOLERANCE[dtype], f"{forward}/{backward} {what}: relative error {error:.2e}"


def test_native_is_bitwise_torch_in_float64():
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    reference = F.conv2d(x, w, None, 1, 1)
    grad = torch.randn_like(reference)
    out = conv2d(x, w, None, 1, 1, algorithm="native")
    assert torch.equal(out, reference)
    for a, e in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(reference, (x, w), grad)):
        assert torch.equal(a, e)


def test_winograd_applies_only_to_3x3_stride_1():
    assert applicable("winograd", ConvGeometry.of((1, 2, 8, 8), (2, 2, 3, 3), 1, 1))
    assert "3x3" in why_not_applicable("winograd", ConvGeometry.of((1, 2, 8, 8), (2, 2, 5, 5), 1, 1))
    assert "stride 1" in why_not_applicable("winograd", ConvGeometry.of((1, 2, 8, 8), (2, 2, 3, 3), 2, 1))
    grouped = ConvGeometry.of((1, 4, 8, 8), (4, 2, 3, 3), 1, 1, 1, 2)
    assert applicable_algorithms(grouped) == ["native"]
    with pytest.raises(ValueError, match="winograd"):
        conv2d(torch.randn(1, 2, 8, 8), torch.randn(2, 2, 5, 5), algorithm="winograd")
    with pytest.raises(ValueError, match="unknown"):
        with backward_algorithm("fft-magic"):
            pass


def test_workspaces_differ_and_chunking_caps_them():
    geometry = ConvGeometry.of((8, 16, 32, 32), (32, 16, 3, 3), 1, 1)
    sizes = {name: workspace_bytes(name, geometry, 4) for name in ALGORITHMS}
    assert sizes["native"] == 0
    # the columns of im2col: N * C*3*3 * H*W elements
    assert sizes["im2col"] == 8 * 16 * 9 * 32 * 32 * 4
    assert sizes["im2col-chunked"] == sizes["im2col"] // 4
    assert 0 < sizes["winograd"] != sizes["im2col"]
    for name in ALGORITHMS:
        assert workspace_bytes(name, geometry, 4, "backward") >= sizes[name]


def test_conv_module_backward_follows_the_block_it_runs_in():
    """The schedule picks the backward algorithm when the backward runs, not when the forward did."""
    calls = []
    import executor.conv_algorithms as algorithms

    original = algorithms._winograd_backward

    def spy(*args, **kwargs):
        calls.append("winograd")
        return original(*args, **kwargs)

    algorithms._winograd_backward = spy
    try:
        x = torch.randn(1, 2, 6, 6, dtype=torch.float64, requires_grad=True)
        w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
        out = conv2d(x, w, None, 1, 1, algorithm="im2col")
        with backward_algorithm("winograd"):
            out.sum().backward()
    finally:
        algorithms._winograd_backward = original
    assert calls == ["winograd"]

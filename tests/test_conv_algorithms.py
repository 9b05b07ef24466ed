"""The executor's convolution algorithms agree with aten.convolution and both halves of its backward.

Tolerances (measured on this CPU, relative to the largest magnitude of each
result): float64 at most 8e-16 (asserted at 1e-10, as promised); float32 at
most 4e-7 (asserted at 2e-5).
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from executor.engine.conv_algorithms import (  # noqa: E402
    ALGORITHMS,
    ConvGeometry,
    applicable,
    applicable_algorithms,
    backward,
    forward,
    geometry_of,
    why_not_applicable,
    workspace_bytes,
)

ATEN = torch.ops.aten

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


def _native(x, w, b, stride, padding, dilation):
    stride, padding, dilation = [_pair(stride), _pair(padding), _pair(dilation)]
    return ATEN.convolution(x, w, b, stride, padding, dilation, False, [0, 0], 1)


def _pair(value):
    return [value, value] if isinstance(value, int) else list(value)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_every_algorithm_matches_aten_forward_and_both_backward_halves(dtype, case):
    shape, wshape, stride, padding, dilation = case
    generator = torch.Generator().manual_seed(hash(case) % 1000)
    x = torch.randn(shape, dtype=dtype, generator=generator)
    w = torch.randn(wshape, dtype=dtype, generator=generator)
    b = torch.randn(wshape[0], dtype=dtype, generator=generator)
    arguments = (_pair(stride), _pair(padding), _pair(dilation), False, [0, 0], 1)
    reference = ATEN.convolution(x, w, b, *arguments)
    grad = torch.randn(reference.shape, dtype=dtype, generator=generator)
    expected = ATEN.convolution_backward(grad, x, w, [wshape[0]], *arguments, [True, True, True])
    geometry = geometry_of(shape, wshape, _pair(stride), _pair(padding), _pair(dilation), False, 1)
    names = applicable_algorithms(geometry)
    assert "native" in names and "im2col" in names and "im2col-chunked" in names
    for name in names:
        if name == "native":
            continue
        out = forward(name, x, w, b, *arguments)
        filter_half = backward(name, grad, x, w, [wshape[0]], *arguments, [False, True, True])
        input_half = backward(name, grad, x, w, [wshape[0]], *arguments, [True, False, False])
        got = (out, input_half[0], filter_half[1], filter_half[2])
        assert input_half[1] is None and filter_half[0] is None
        for what, a, e in zip(("output", "grad input", "grad weight", "grad bias"), got, (reference, *expected)):
            assert a.shape == e.shape
            # each result owns exactly its storage, as the native one does (the profile has one size per node)
            assert a.untyped_storage().nbytes() == a.numel() * a.element_size()
            error = _relative_error(a, e)
            assert error <= TOLERANCE[dtype], f"{name} {what}: relative error {error:.2e}"


def test_the_two_halves_of_native_convolution_backward_are_bitwise_the_combined_call():
    """What capture relies on when it splits convolution_backward into a filter and a data half."""
    for dtype in (torch.float64, torch.float32):
        for groups, stride in ((1, 1), (2, 2), (8, 1)):
            x = torch.randn(4, 8, 9, 9, dtype=dtype)
            w = torch.randn(16, 8 // groups, 3, 3, dtype=dtype)
            y = ATEN.convolution(x, w, None, [stride] * 2, [1, 1], [1, 1], False, [0, 0], groups)
            g = torch.randn_like(y)
            arguments = (g, x, w, [16], [stride] * 2, [1, 1], [1, 1], False, [0, 0], groups)
            combined = ATEN.convolution_backward(*arguments, [True, True, True])
            data = ATEN.convolution_backward(*arguments, [True, False, False])
            filters = ATEN.convolution_backward(*arguments, [False, True, True])
            assert torch.equal(combined[0], data[0])
            assert torch.equal(combined[1], filters[1]) and torch.equal(combined[2], filters[2])


def _laid_out_as_natives_results(algorithm, input_layout, seed, batches=(3, 3, 3, 3)):
    """Groups 1 and 2, depthwise and a 1x1 kernel: every result of `algorithm` with native's shape and strides (every
    one, those of a dimension of size 1 included: a kernel compiled for the node after checks them all), owning
    exactly its storage, within float32's tolerance; the input gradient alone from a one-element stand-in of a
    contiguous input, as the capture hands it, equal to the one computed beside the filter gradient. Each case's
    results and native's."""
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for (groups, (c, o), k), n in zip(((1, (4, 6), 3), (2, (4, 6), 3), (4, (4, 4), 3), (1, (4, 8), 1)), batches):
        x = torch.randn(n, c, 9, 9, generator=generator).contiguous(memory_format=input_layout)
        w = torch.randn(o, c // groups, k, k, generator=generator)
        b = torch.randn(o, generator=generator)
        arguments = ([2, 2], [k // 2] * 2, [1, 1], False, [0, 0], groups)
        reference = ATEN.convolution(x, w, b, *arguments)
        grad = torch.randn(reference.shape, generator=generator).contiguous(memory_format=input_layout)
        expected = ATEN.convolution_backward(grad, x, w, [o], *arguments, [True, True, True])
        out = forward(algorithm, x, w, b, *arguments)
        got = backward(algorithm, grad, x, w, [o], *arguments, [True, True, True])
        results = zip(("output", "grad input", "grad weight", "grad bias"), (out, *got), (reference, *expected))
        for what, a, e in results:
            assert a.shape == e.shape and a.stride() == e.stride(), (groups, k, what, a.stride(), e.stride())
            assert a.untyped_storage().nbytes() == a.numel() * a.element_size()
            assert _relative_error(a, e) <= TOLERANCE[torch.float32], what
        cases.append(((out, *got), (reference, *expected)))
        if input_layout == torch.channels_last:
            continue  # the capture hands a stand-in for a contiguous input only
        alone = backward(algorithm, grad, x.new_empty(1).expand(x.shape), w, [o], *arguments, [True, False, False])
        assert alone[1] is None and alone[2] is None
        assert torch.equal(alone[0], got[0]) and alone[0].stride() == expected[0].stride()
    return cases


@pytest.mark.parametrize("input_layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_channels_last_agrees_with_native_for_groups_and_hands_back_natives_strides(input_layout):
    """Any groups (depthwise too) and 1x1 kernels; every result with native's strides, those of a dimension of size
    1 included (a kernel compiled for the node after checks them all); the input gradient computed from a
    one-element stand-in of the input, as the capture hands it, without writing the stand-in out."""
    from executor.measure.allocations import AllocationTrace

    _laid_out_as_natives_results("channels-last", input_layout, seed=7)
    generator = torch.Generator().manual_seed(7)
    # large enough that oneDNN's own scratch (about 100 KiB here) is small beside the input
    x, w = torch.randn(64, 4, 32, 32, generator=generator), torch.randn(4, 4, 3, 3, generator=generator)
    grad = torch.randn(64, 4, 32, 32, generator=generator)
    with AllocationTrace() as trace:
        backward("channels-last", grad, x.new_empty(1).expand(x.shape), w, [4], [1, 1], [1, 1], [1, 1], False,
                 [0, 0], 1, [True, False, False])
    # the gradient's channels-last copy, the result in that layout and laid out again: not the input's 1 MiB on top
    assert trace.peak_bytes < 3 * x.nbytes + (256 << 10), "the stand-in was written out"


@pytest.mark.parametrize("input_layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_batch_split_is_natives_per_sample_and_holds_a_part_at_a_time(input_layout):
    """Any groups and a batch that does not divide by four: native's results to rounding (parts of one sample
    take another oneDNN kernel) and the filter and bias gradients bitwise (native's call on the whole batch), laid
    out as native's. With parts of many samples, each sample's output and input gradient are native's bit for bit,
    and the peak is below native's where native's scratch is large (the stem of ResNet-18-small: oneDNN reorders
    the whole input)."""
    from executor.measure.allocations import AllocationTrace

    for got, expected in _laid_out_as_natives_results("batch-split", input_layout, seed=11, batches=(7, 5, 9, 2)):
        assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])  # the filter and bias gradients
    generator = torch.Generator().manual_seed(11)
    assert "at least 64" in why_not_applicable("batch-split", ConvGeometry.of((63, 3, 8, 8), (4, 3, 3, 3)))
    assert applicable("batch-split", ConvGeometry.of((64, 3, 8, 8), (4, 3, 3, 3), 1, 1, 1, 3))
    x, w = torch.randn(256, 3, 32, 32, generator=generator), torch.randn(4, 3, 7, 7, generator=generator)
    arguments = ([2, 2], [3, 3], [1, 1], False, [0, 0], 1)
    peaks, outputs = {}, {}
    for name in ("native", "batch-split"):
        with AllocationTrace() as trace:
            out = ATEN.convolution(x, w, None, *arguments) if name == "native" else \
                forward(name, x, w, None, *arguments)
        peaks[name] = trace.peak_bytes - out.nbytes
        outputs[name] = out
    assert torch.equal(outputs["batch-split"], outputs["native"])
    grad = torch.randn(outputs["native"].shape, generator=generator)
    expected = ATEN.convolution_backward(grad, x, w, None, *arguments, [True, False, False])[0]
    assert torch.equal(backward("batch-split", grad, x, w, None, *arguments, [True, False, False])[0], expected)
    assert peaks["batch-split"] < peaks["native"] / 2, peaks


def test_batch_split_sum_sums_the_filter_gradient_over_parts_within_a_quarter_of_natives_scratch():
    """Its filter and bias gradients are the parts' sum, within rounding of native's (not bitwise: another order),
    laid out as native's; its other results are batch-split's. On the stem of ResNet-18-small oneDNN reorders the
    whole input for the filter gradient: summed over quarters, the peak is below half of native's."""
    from executor.measure.allocations import AllocationTrace

    _laid_out_as_natives_results("batch-split-sum", torch.contiguous_format, seed=12, batches=(7, 5, 9, 2))
    assert "batch-split-sum needs a batch of at least 64" in why_not_applicable(
        "batch-split-sum", ConvGeometry.of((63, 3, 8, 8), (4, 3, 3, 3)))
    generator = torch.Generator().manual_seed(12)
    x, w = torch.randn(256, 3, 32, 32, generator=generator), torch.randn(4, 3, 7, 7, generator=generator)
    arguments = ([2, 2], [3, 3], [1, 1], False, [0, 0], 1)
    out = ATEN.convolution(x, w, None, *arguments)
    split_forward = forward("batch-split", x, w, None, *arguments)
    assert torch.equal(forward("batch-split-sum", x, w, None, *arguments), split_forward)
    grad = torch.randn(out.shape, generator=generator)
    peaks, filters = {}, {}
    for name in ("native", "batch-split", "batch-split-sum"):
        with AllocationTrace() as trace:
            result = (ATEN.convolution_backward(grad, x, w, [4], *arguments, [False, True, True]) if name == "native"
                      else backward(name, grad, x, w, [4], *arguments, [False, True, True]))
        peaks[name] = trace.peak_bytes - result[1].nbytes - result[2].nbytes
        filters[name] = result[1:]
    assert torch.equal(filters["batch-split"][0], filters["native"][0])  # native's whole-batch call
    for got, expected in zip(filters["batch-split-sum"], filters["native"]):
        assert _relative_error(got, expected) <= TOLERANCE[torch.float32]
    assert peaks["batch-split-sum"] < peaks["native"] / 2, peaks


def test_winograd_applies_only_to_3x3_stride_1():
    assert applicable("winograd", ConvGeometry.of((1, 2, 8, 8), (2, 2, 3, 3), 1, 1))
    assert "3x3" in why_not_applicable("winograd", ConvGeometry.of((1, 2, 8, 8), (2, 2, 5, 5), 1, 1))
    assert "stride 1" in why_not_applicable("winograd", ConvGeometry.of((1, 2, 8, 8), (2, 2, 3, 3), 2, 1))
    grouped = ConvGeometry.of((1, 4, 8, 8), (4, 2, 3, 3), 1, 1, 1, 2)
    assert applicable_algorithms(grouped) == ["native", "channels-last"]
    assert geometry_of((1, 2, 8), (2, 2, 3), [1], [1], [1], False, 1) is None  # 1-D: native only
    assert geometry_of((1, 2, 8, 8), (2, 2, 3, 3), [1, 1], [1, 1], [1, 1], True, 1) is None  # transposed
    with pytest.raises(ValueError, match="unknown"):
        forward("fft-magic", torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3), None, [1, 1], [1, 1], [1, 1],
                False, [0, 0], 1)


def test_workspace_formulas_differ_and_chunking_caps_them():
    geometry = ConvGeometry.of((8, 16, 32, 32), (32, 16, 3, 3), 1, 1)
    sizes = {name: workspace_bytes(name, geometry, 4) for name in ALGORITHMS}
    assert sizes["native"] == 0
    # the columns of im2col: N * C*3*3 * H*W elements
    assert sizes["im2col"] == 8 * 16 * 9 * 32 * 32 * 4
    assert sizes["im2col-chunked"] == sizes["im2col"] // 4
    assert 0 < sizes["winograd"] != sizes["im2col"]
    # batch-split holds one part's result at a time: a quarter of the output, or of the input gradient
    assert sizes["batch-split"] == 2 * 32 * 32 * 32 * 4
    assert workspace_bytes("batch-split", geometry, 4, "backward") == 2 * 16 * 32 * 32 * 4
    # batch-split-sum: batch-split's, and one part's filter gradient beside their sum
    assert sizes["batch-split-sum"] == sizes["batch-split"]
    assert workspace_bytes("batch-split-sum", geometry, 4, "backward") == (2 * 16 * 32 * 32 + 32 * 16 * 9) * 4
    for name in set(ALGORITHMS) - {"batch-split", "batch-split-sum"}:
        assert workspace_bytes(name, geometry, 4, "backward") >= sizes[name]

"""The kernels the provisional profile allows no scratch for (executor.measure.measuring.NO_SCRATCH_OPERATIONS) make
none, by the allocator's own events: each one's rise of live storage is its results and nothing more. The same
measurement sees the scratch of the kernels left out of the set, so it would see theirs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from executor.measure.allocations import AllocationTrace  # noqa: E402
from executor.measure.measuring import (NO_SCRATCH_OPERATIONS, NO_SCRATCH_WHEN_CONTIGUOUS,  # noqa: E402
                                        SCRATCH_SLACK_BYTES)

aten = torch.ops.aten
SHAPE = (64, 32, 16, 16)  # 2 MiB of float32: scratch as large as a result would stand far above the slack


def _cases(memory_format, dtype=torch.float32):
    torch.manual_seed(0)

    def tensor(*shape, low=-3.0, high=3.0):
        value = torch.empty(shape or SHAPE).uniform_(low, high).to(dtype)
        return value.contiguous(memory_format=memory_format) if value.dim() == 4 else value

    x, y, g = tensor(), tensor(), tensor()
    channels = SHAPE[1]
    bias = tensor(channels, 1, 1)
    mask = (tensor() > 0)
    pooled, indices = aten.max_pool2d_with_indices.default(x, [3, 3], [2, 2], [1, 1])
    pooled_gradient = torch.ones_like(pooled)
    weight, shift = tensor(channels), tensor(channels)

    def statistics():
        return torch.zeros(channels, dtype=dtype), torch.ones(channels, dtype=dtype)

    return {
        "aten.relu.default": lambda: aten.relu.default(x),
        "aten.threshold_backward.default": lambda: aten.threshold_backward.default(g, x, 0.0),
        "aten.hardtanh.default": lambda: aten.hardtanh.default(x, 0.0, 6.0),
        "aten.hardtanh_backward.default": lambda: aten.hardtanh_backward.default(g, x, 0.0, 6.0),
        "aten.gelu.default": lambda: (aten.gelu.default(x), aten.gelu.default(x, approximate="tanh")),
        "aten.gelu_backward.default": lambda: (aten.gelu_backward.default(g, x),
                                               aten.gelu_backward.default(g, x, approximate="tanh")),
        "aten.silu.default": lambda: aten.silu.default(x),
        "aten.silu_backward.default": lambda: aten.silu_backward.default(g, x),
        "aten.sigmoid.default": lambda: aten.sigmoid.default(x),
        "aten.sigmoid_backward.default": lambda: aten.sigmoid_backward.default(g, y),
        "aten.tanh.default": lambda: aten.tanh.default(x),
        "aten.tanh_backward.default": lambda: aten.tanh_backward.default(g, y),
        "aten.add.Tensor": lambda: (aten.add.Tensor(x, y), aten.add.Tensor(x, bias, alpha=0.5)),
        "aten.sub.Tensor": lambda: aten.sub.Tensor(x, bias),
        "aten.mul.Tensor": lambda: (aten.mul.Tensor(g, mask), aten.mul.Tensor(x, bias)),
        "aten.div.Tensor": lambda: aten.div.Tensor(x, bias),
        "aten.clone.default": lambda: (aten.clone.default(x),
                                       aten.clone.default(x, memory_format=torch.channels_last),
                                       aten.clone.default(x, memory_format=torch.contiguous_format)),
        "aten.max_pool2d_with_indices.default": lambda: aten.max_pool2d_with_indices.default(
            x, [3, 3], [2, 2], [1, 1]),
        "aten.max_pool2d_with_indices_backward.default": lambda: aten.max_pool2d_with_indices_backward.default(
            pooled_gradient, x, [3, 3], [2, 2], [1, 1], [1, 1], False, indices),
        "aten._native_batch_norm_legit_functional.default":
            lambda: aten._native_batch_norm_legit_functional.default(x, weight, shift, *statistics(), True, 0.1,
                                                                     1e-5),
        "aten._native_batch_norm_legit.default":
            lambda: aten._native_batch_norm_legit.default(x, weight, shift, *statistics(), True, 0.1, 1e-5),
        "aten._native_batch_norm_legit_no_training.default":
            lambda: aten._native_batch_norm_legit_no_training.default(x, weight, shift, *statistics(), 0.1, 1e-5),
    }


def _contiguous_cases(dtype):
    """NO_SCRATCH_WHEN_CONTIGUOUS on contiguous operands: attention's shapes (batch, heads, tokens, tokens)."""
    torch.manual_seed(0)
    scores = torch.randn(8, 4, 128, 128).to(dtype)
    gradient = torch.randn(scores.shape).to(dtype)
    probabilities = aten._softmax.default(scores, -1, False)
    log_probabilities = aten._log_softmax.default(scores, -1, False)
    mask = torch.rand(8, 1, 128, 128) > 0.5  # broadcast over the heads, as an attention mask is
    hidden = torch.randn(8, 128, 256).to(dtype)
    weight, shift = torch.ones(256, dtype=dtype), torch.zeros(256, dtype=dtype)
    rows = torch.log_softmax(torch.randn(1024, 1000), 1).to(dtype)  # a loss over 1000 classes
    labels = torch.randint(0, 1000, (1024,))
    labels[::7] = -100
    _, total_weight = aten.nll_loss_forward.default(rows, labels, None, 1, -100)
    return {
        "aten._softmax.default": lambda: (aten._softmax.default(scores, -1, False),
                                          aten._softmax.default(scores, 1, False)),
        "aten._softmax_backward_data.default": lambda: aten._softmax_backward_data.default(
            gradient, probabilities, -1, dtype),
        "aten._log_softmax.default": lambda: aten._log_softmax.default(scores, -1, False),
        "aten._log_softmax_backward_data.default": lambda: aten._log_softmax_backward_data.default(
            gradient, log_probabilities, -1, dtype),
        "aten.native_layer_norm.default": lambda: aten.native_layer_norm.default(hidden, [256], weight, shift, 1e-5),
        "aten.masked_fill.Scalar": lambda: aten.masked_fill.Scalar(scores, mask, -1e9),
        "aten.where.self": lambda: aten.where.self(mask, scores, gradient),
        "aten.exp.default": lambda: aten.exp.default(scores),
        "aten.neg.default": lambda: aten.neg.default(scores),
        "aten.pow.Tensor_Scalar": lambda: (aten.pow.Tensor_Scalar(scores, 2), aten.pow.Tensor_Scalar(scores, 0.5)),
        "aten.nll_loss_forward.default": lambda: (aten.nll_loss_forward.default(rows, labels, None, 1, -100),
                                                  aten.nll_loss_forward.default(rows, labels, None, 0, -100)),
        "aten.nll_loss_backward.default": lambda: aten.nll_loss_backward.default(
            torch.ones((), dtype=dtype), rows, labels, None, 1, -100, total_weight),
        "aten._to_copy.default": lambda: (aten._to_copy.default(scores, dtype=torch.float32),
                                          aten._to_copy.default(scores, dtype=torch.bfloat16),
                                          aten._to_copy.default(scores, dtype=torch.float64)),
    }


def _results_bytes(value) -> int:
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    flat = [t for item in tensors for t in (item if isinstance(item, (tuple, list)) else (item,))]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in flat
                if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def _scratch_bytes(call) -> int:
    """The most the call held beyond the results it returned (all of them alive at its end)."""
    call()  # a kernel's first call of a kind may set up what it keeps
    with AllocationTrace() as trace:
        result = call()
    return trace.peak_bytes - _results_bytes(result)


def test_every_operation_of_the_set_is_measured_here():
    assert set(_cases(torch.contiguous_format)) == set(NO_SCRATCH_OPERATIONS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last],
                         ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernels_allowed_no_scratch_make_none(memory_format, threads, dtype):
    """In bfloat16 too, where the provisional profile allows no widening scratch for them either."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        over = {name: scratch for name, call in _cases(memory_format, dtype).items()
                if (scratch := _scratch_bytes(call)) > SCRATCH_SLACK_BYTES}
    finally:
        torch.set_num_threads(previous)
    assert not over, f"scratch beyond the results, bytes: {over}"


def test_every_operation_allowed_none_where_contiguous_is_measured_here():
    assert set(_contiguous_cases(torch.float32)) == set(NO_SCRATCH_WHEN_CONTIGUOUS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernels_allowed_none_where_contiguous_make_none_there(dtype, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        over = {name: scratch for name, call in _contiguous_cases(dtype).items()
                if (scratch := _scratch_bytes(call)) > SCRATCH_SLACK_BYTES}
    finally:
        torch.set_num_threads(previous)
    assert not over, f"scratch beyond the results, bytes: {over}"


def test_a_non_contiguous_operand_gets_the_allowance():
    """A softmax over a transposed tensor and a layer norm's backward on one copy it first (as large as the
    result, twice): the contiguous set is allowed no scratch only where every operand is contiguous."""
    import torch.fx as fx

    from executor.measure.measuring import _makes_no_scratch

    torch.manual_seed(0)
    transposed = torch.randn(8, 4, 128, 128).transpose(-1, -2)
    result_bytes = transposed.untyped_storage().nbytes()
    assert _scratch_bytes(lambda: aten._softmax.default(transposed, -1, False)) >= result_bytes // 2
    hidden = torch.randn(8, 256, 128).transpose(1, 2)
    weight, shift = torch.ones(256), torch.zeros(256)
    _, mean, rstd = aten.native_layer_norm.default(hidden, [256], weight, shift, 1e-5)
    assert _scratch_bytes(lambda: aten.native_layer_norm_backward.default(
        hidden, hidden, [256], mean, rstd, weight, shift, [True, True, True])) >= hidden.numel() * 4
    assert "aten.native_layer_norm_backward.default" not in NO_SCRATCH_WHEN_CONTIGUOUS | NO_SCRATCH_OPERATIONS

    graph = fx.Graph()
    strided, dense = graph.placeholder("strided"), graph.placeholder("dense")
    strided.meta["val"], dense.meta["val"] = transposed, transposed.contiguous()
    for operand, makes_none in ((strided, False), (dense, True)):
        softmax = graph.call_function(aten._softmax.default, (operand, -1, False))
        softmax.meta["val"] = aten._softmax.default(operand.meta["val"], -1, False)
        assert _makes_no_scratch(softmax) == makes_none


def test_the_measurement_sees_the_scratch_of_kernels_left_out():
    """native_dropout_backward widens its mask to the gradient's type; native_batch_norm_backward holds a buffer
    as large as its input: both are left out of the set, and the same measurement sees why."""
    torch.manual_seed(0)
    x, g = torch.randn(SHAPE), torch.randn(SHAPE)
    mask = torch.rand(SHAPE) > 0.1
    channels = SHAPE[1]
    weight = torch.ones(channels)
    _, mean, invstd = aten._native_batch_norm_legit.no_stats(x, weight, None, True, 0.1, 1e-5)
    result_bytes = x.untyped_storage().nbytes()
    dropout = _scratch_bytes(lambda: aten.native_dropout_backward.default(g, mask, 1 / 0.9))
    batch_norm = _scratch_bytes(lambda: aten.native_batch_norm_backward.default(
        g, x, weight, None, None, mean, invstd, True, 1e-5, [True, True, True]))
    assert dropout >= result_bytes // 2
    assert batch_norm >= result_bytes // 2
    assert not {"aten.native_dropout_backward.default", "aten.native_batch_norm_backward.default"} \
        & NO_SCRATCH_OPERATIONS


def test_operands_of_one_shape_laid_out_apart_get_the_allowance():
    """gelu_backward on a transposed gradient (wav2vec2 after its feature extractor) made dense copies: twice its
    result. A kernel of the set is allowed no scratch only where its operands of one shape share a layout."""
    import torch.fx as fx

    from executor.measure.measuring import _same_layouts

    torch.manual_seed(0)
    x = torch.randn(SHAPE[0], SHAPE[1], SHAPE[2] * SHAPE[3])
    transposed = torch.randn(SHAPE[0], SHAPE[2] * SHAPE[3], SHAPE[1]).transpose(1, 2)
    result_bytes = x.untyped_storage().nbytes()
    assert _scratch_bytes(lambda: aten.gelu_backward.default(transposed, x)) >= result_bytes // 2

    graph = fx.Graph()
    a, b, bias = graph.placeholder("a"), graph.placeholder("b"), graph.placeholder("bias")
    a.meta["val"], b.meta["val"], bias.meta["val"] = x, transposed, torch.randn(SHAPE[1], 1)
    assert not _same_layouts(graph.call_function(aten.gelu_backward.default, (b, a)))
    assert _same_layouts(graph.call_function(aten.gelu_backward.default, (a, a)))
    assert _same_layouts(graph.call_function(aten.add.Tensor, (a, bias)))  # a broadcast operand: no copy


def test_operands_of_two_floating_types_get_the_allowance():
    """On the CPU TensorIterator copies an operand of another floating type into the common one first (autocast's
    float32 residual plus a bf16 projection): a result's size of scratch, which the set's kernels were allowed
    none of. Scalars (0-dim) it reads as they are."""
    import torch.fx as fx

    from executor.measure.measuring import _makes_no_scratch

    torch.manual_seed(0)
    stream = torch.randn(256, 1024)
    projection = torch.randn(256, 1024).to(torch.bfloat16)
    assert _scratch_bytes(lambda: aten.add.Tensor(stream, projection)) >= stream.untyped_storage().nbytes()

    graph = fx.Graph()
    scalar = torch.tensor(2.0, dtype=torch.float64)
    a, b, c = graph.placeholder("a"), graph.placeholder("b"), graph.placeholder("c")
    a.meta["val"], b.meta["val"], c.meta["val"] = stream, projection, scalar
    mixed = graph.call_function(aten.add.Tensor, (a, b))
    mixed.meta["val"] = stream + projection
    scaled = graph.call_function(aten.mul.Tensor, (a, c))
    scaled.meta["val"] = stream * scalar
    assert not _makes_no_scratch(mixed)
    assert _makes_no_scratch(scaled)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_half_precision_products_scratch_is_within_its_allowance(threads):
    """oneDNN widens a bf16 product's operands and packs them in buffers of each thread's own: on small products
    (peft's DoRA, a 32x512 by 512x4 product with the first transposed) more than twice the operands' bytes."""
    from executor.measure.measuring import HALF_PRECISION_PACKING_BYTES_PER_STEP

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    for m, k, n, transposed in [(32, 512, 4, True), (32, 512, 4, False), (4, 512, 64, True), (128, 2048, 128, True),
                                (64, 64, 64, True), (512, 32, 4, True)]:
        a = torch.randn(k, m).to(torch.bfloat16).t() if transposed else torch.randn(m, k).to(torch.bfloat16)
        b = torch.randn(k, n).to(torch.bfloat16)
        half_bytes = 2 * (m * k + k * n + m * n)
        packing = threads * k * HALF_PRECISION_PACKING_BYTES_PER_STEP
        allowance = m * n * 2 + 2 * half_bytes + packing + SCRATCH_SLACK_BYTES
        assert _scratch_bytes(lambda: torch.mm(a, b)) <= allowance, (m, k, n, transposed)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_embeddings_gradient_holds_scratch_of_its_incoming_gradient_not_of_the_table(threads):
    """embedding_dense_backward's result is the whole table's gradient (50,257 x 256 for GPT-2's tied LM head: 49
    MiB); what it holds beyond it is a dense copy of the incoming gradient where that is strided. The allowance
    follows that operand (SCRATCH_OF_OPERANDS): counted from the result, it alone set a language model's floor."""
    import torch.fx as fx

    from executor.measure.measuring import scratch_bound_bytes

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    for vocab, hidden, rows, by_frequency, padding in [(50257, 256, 512, False, -1), (50257, 256, 512, True, -1),
                                                       (1000, 64, 4096, False, 3), (1000, 64, 4096, True, 3)]:
        indices = torch.randint(0, vocab, (4, rows // 4))
        for gradient in (torch.randn(4, rows // 4, hidden), torch.randn(hidden, rows).t().reshape(4, rows // 4, -1),
                         torch.randn(rows // 4, 4, hidden).transpose(0, 1)):
            graph = fx.Graph()
            g, i = graph.placeholder("g"), graph.placeholder("i")
            g.meta["val"], i.meta["val"] = gradient, indices
            op = graph.call_function(aten.embedding_dense_backward.default, (g, i, vocab, padding, by_frequency))
            op.meta["val"] = aten.embedding_dense_backward.default(gradient, indices, vocab, padding, by_frequency)
            allowance = scratch_bound_bytes(op, {op: op.meta["val"].untyped_storage().nbytes()})
            if vocab == 50257:
                assert allowance < op.meta["val"].untyped_storage().nbytes() // 10
            measured = _scratch_bytes(lambda: aten.embedding_dense_backward.default(
                gradient, indices, vocab, padding, by_frequency))
            assert measured <= allowance, (vocab, hidden, rows, by_frequency, gradient.stride(), measured, allowance)

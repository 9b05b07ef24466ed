"""Interchangeable 2-D convolution algorithms with different time and workspace, at the ATen level.

PyTorch exposes no per-layer choice of cuDNN algorithm, so the executor
carries its own: each algorithm computes what `aten.convolution` computes
(forward) or one half of what `aten.convolution_backward` computes (the
filter gradient with the bias gradient, or the input gradient) with a
different trade-off. The profiler times and measures each of them; the
planner picks one per planning node; the generated step calls the pick.

- native: ATen's own operator (oneDNN / cuDNN): bitwise what plain PyTorch computes.
- channels-last: ATen's own operator on channels-last (NHWC) copies of its operands, the results laid out as
  native's: oneDNN's NHWC kernels for a network with few channels (ResNet-18-small's backward on the CPU: 1.6 ms
  where NCHW takes 7.1 for a 4-channel 3x3 layer), cuDNN's tensor-core layout; the copies are the workspace.
- batch-split: ATen's own operator on a quarter of the batch at a time, written into one result laid out as
  native's: a quarter of native's scratch, and on the CPU faster where native's buffers are 32 MiB or more, which
  glibc maps afresh on every call (ResNet-18-small's stem at batch 2048: 8 ms where native takes 16). The filter
  and bias gradients are native's call on the whole batch (summed over parts, they would round otherwise). Offered
  for a batch of 64 or more: on parts of 16 samples or more oneDNN runs the kind of kernel it runs on the whole
  batch (the results came out native's bit for bit), where on parts of one sample it took another.
- batch-split-sum: batch-split with the filter and bias gradients summed over the parts too: a quarter of native's
  scratch there as well (ResNet-18-small's stem at batch 2048: 8 MiB where native's filter gradient takes 32, and
  12.8 ms where it takes 20.5: benchmarks/batch_split_sum.py), in another summation order: there, on the model's
  own gradient, 1.1e-5 of the largest value from native's, which is itself 1.3e-5 from the float64 answer where
  the sum of parts is 0.5e-5 from it. Offered for the nodes that compute a filter or bias gradient (elsewhere it
  is batch-split).
- im2col: unfold the input into columns and multiply (GEMM); the columns are the workspace.
- im2col-chunked: the same, a quarter of the batch at a time: a quarter of the workspace, more passes.
- winograd: F(2x2, 3x3) for 3x3 kernels, stride 1: 16 element-wise products per 2x2 output tile
  instead of 36 multiplications, at the price of transformed copies of input and output tiles.
  Its filter gradient is im2col's.

Only `native` reproduces plain PyTorch's numbers bit for bit; the others agree
to rounding (float64 within 1e-10, float32 within 2e-5 of the largest value).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ALGORITHMS = ("native", "channels-last", "batch-split", "batch-split-sum", "im2col", "im2col-chunked", "winograd")
BATCH_SPLITS = ("batch-split", "batch-split-sum")
CHUNKS = 4
SMALLEST_PART_SAMPLES = 16  # batch-split: on fewer samples oneDNN may run another kind of kernel than on the batch

def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


@dataclass(frozen=True)
class ConvGeometry:
    """Shapes and settings of one convolution."""

    input_shape: tuple[int, int, int, int]
    weight_shape: tuple[int, int, int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    @classmethod
    def of(cls, input_shape, weight_shape, stride=1, padding=0, dilation=1, groups=1) -> "ConvGeometry":
        return cls(tuple(input_shape), tuple(weight_shape), _pair(stride), _pair(padding), _pair(dilation), int(groups))

    @property
    def output_hw(self) -> tuple[int, int]:
        (_, _, h, w), (_, _, kh, kw) = self.input_shape, self.weight_shape
        ho = (h + 2 * self.padding[0] - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        wo = (w + 2 * self.padding[1] - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        return ho, wo

    @property
    def columns_elements(self) -> int:
        n, c, _, _ = self.input_shape
        _, _, kh, kw = self.weight_shape
        ho, wo = self.output_hw
        return n * c * kh * kw * ho * wo

    @property
    def winograd_tiles(self) -> int:
        ho, wo = self.output_hw
        return self.input_shape[0] * math.ceil(ho / 2) * math.ceil(wo / 2)


def why_not_applicable(name: str, geometry: ConvGeometry) -> str | None:
    """None if algorithm `name` can compute this convolution, else the reason."""
    if name not in ALGORITHMS:
        return f"unknown convolution algorithm {name!r}"
    if name in ("native", "channels-last"):
        return None
    if name in BATCH_SPLITS:
        if geometry.input_shape[0] < CHUNKS * SMALLEST_PART_SAMPLES:
            return (f"{name} needs a batch of at least {CHUNKS * SMALLEST_PART_SAMPLES} (parts of "
                    f"{SMALLEST_PART_SAMPLES} samples: on fewer, oneDNN may run another kind of kernel)")
        return None
    if geometry.groups != 1:
        return f"{name} handles groups=1 only"
    if name == "winograd":
        if geometry.weight_shape[2:] != (3, 3):
            return "winograd F(2x2,3x3) needs a 3x3 kernel"
        if geometry.stride != (1, 1) or geometry.dilation != (1, 1):
            return "winograd F(2x2,3x3) needs stride 1 and dilation 1"
        if max(geometry.padding) > 2:
            return "winograd F(2x2,3x3) needs padding of at most 2"
    return None


def applicable(name: str, geometry: ConvGeometry) -> bool:
    return why_not_applicable(name, geometry) is None


def applicable_algorithms(geometry: ConvGeometry) -> list[str]:
    return [name for name in ALGORITHMS if applicable(name, geometry)]


def workspace_bytes(name: str, geometry: ConvGeometry, element_size: int, phase: str = "forward") -> int:
    """Scratch memory algorithm `name` allocates beyond inputs, output and gradients it returns."""
    n, c, _, _ = geometry.input_shape
    o, _, kh, kw = geometry.weight_shape
    ho, wo = geometry.output_hw
    cols = geometry.columns_elements
    if name == "native":
        return 0
    if name == "channels-last":
        # the operands' channels-last copies, and the results in that layout until they are laid out as native's
        _, _, h, w = geometry.input_shape
        operands = n * c * h * w + o * (c // geometry.groups) * kh * kw
        if phase == "forward":
            return (operands + n * o * ho * wo) * element_size
        return (2 * operands + n * o * ho * wo) * element_size
    if name in BATCH_SPLITS:
        # one part's result before it is written into the whole (and native's own scratch for a part; batch-split's
        # filter gradient is native's whole-batch call, whose scratch the profile measures); batch-split-sum's
        # backward also holds one part's filter gradient beside their running sum
        _, _, h, w = geometry.input_shape
        part = math.ceil(n / CHUNKS)
        if phase == "forward":
            return part * o * ho * wo * element_size
        summed = o * (c // geometry.groups) * kh * kw if name == "batch-split-sum" else 0
        return (part * c * h * w + summed) * element_size
    if name == "im2col":
        if phase == "forward":
            return cols * element_size
        # columns, their gradient, and one weight-gradient product per sample
        return (2 * cols + n * o * c * kh * kw) * element_size
    if name == "im2col-chunked":
        chunk = math.ceil(n / CHUNKS)
        chunk_cols = cols // n * chunk
        if phase == "forward":
            return chunk_cols * element_size
        return (2 * chunk_cols + chunk * o * c * kh * kw) * element_size
    if name == "winograd":
        tiles = geometry.winograd_tiles
        forward = 16 * (c * tiles + o * tiles + o * c)
        if phase == "forward":
            return forward * element_size
        # grad_input is a winograd convolution of the output gradient (roles of c and o swapped),
        # grad_weight an im2col product
        backward_input = 16 * (o * tiles_for_input(geometry) + c * tiles_for_input(geometry) + o * c)
        return max(backward_input, cols + n * o * c * kh * kw) * element_size
    raise ValueError(f"unknown convolution algorithm {name!r}")


def tiles_for_input(geometry: ConvGeometry) -> int:
    n, _, h, w = geometry.input_shape
    return n * math.ceil(h / 2) * math.ceil(w / 2)


# --- the algorithms -------------------------------------------------------------------------


def _im2col_forward(x, w, stride, padding, dilation):
    n = x.shape[0]
    o, _, kh, kw = w.shape
    ho, wo = ConvGeometry.of(x.shape, w.shape, stride, padding, dilation).output_hw
    cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # [N, C*kh*kw, L]
    out = x.new_empty((n, o, ho, wo))  # the result owns its storage (not a view of a temporary)
    torch.matmul(w.reshape(o, -1), cols, out=out.view(n, o, ho * wo))
    return out


def _im2col_backward(x, w, grad, stride, padding, dilation, need_input, need_weight):
    n, _, h, wd = x.shape
    o, _, kh, kw = w.shape
    go = grad.reshape(n, o, -1)
    grad_input = grad_weight = None
    if need_input:
        grad_cols = torch.matmul(w.reshape(o, -1).t(), go)  # [N, C*kh*kw, L]
        grad_input = F.fold(grad_cols, (h, wd), (kh, kw), dilation=dilation, padding=padding, stride=stride)
        del grad_cols
    if need_weight:
        cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)
        grad_weight = torch.bmm(go, cols.transpose(1, 2)).sum(0).reshape(w.shape)
    return grad_input, grad_weight


def _chunks(n: int):
    size = math.ceil(n / CHUNKS)
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def _chunked_forward(x, w, stride, padding, dilation):
    geometry = ConvGeometry.of(x.shape, w.shape, stride, padding, dilation)
    ho, wo = geometry.output_hw
    out = x.new_empty((x.shape[0], w.shape[0], ho, wo))
    for start, end in _chunks(x.shape[0]):
        out[start:end] = _im2col_forward(x[start:end], w, stride, padding, dilation)
    return out


def _chunked_backward(x, w, grad, stride, padding, dilation, need_input, need_weight):
    grad_input = torch.empty_like(x) if need_input else None
    grad_weight = None
    for start, end in _chunks(x.shape[0]):
        gi, gw = _im2col_backward(x[start:end], w, grad[start:end], stride, padding, dilation, need_input, need_weight)
        if need_input:
            grad_input[start:end] = gi
        if need_weight:
            grad_weight = gw if grad_weight is None else grad_weight + gw
    return grad_input, grad_weight


def _winograd_matrices(like: torch.Tensor):
    return _winograd_matrices_on(like.dtype, like.device)


@functools.lru_cache(maxsize=None)
def _winograd_matrices_on(dtype: torch.dtype, device: torch.device):
    """Made once per dtype and device: building them from Python lists on a GPU copies from pageable memory,
    which synchronizes the stream (and would stop the host from running ahead of the copies)."""
    bt = torch.tensor([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=dtype, device=device)
    g = torch.tensor([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=dtype, device=device)
    at = torch.tensor([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=dtype, device=device)
    return bt, g, at


def _winograd_forward(x, w, padding):
    """F(2x2, 3x3): y = A^T [ (G g G^T) . (B^T d B) ] A per 4x4 input tile, summed over channels."""
    n, c, h, wd = x.shape
    o = w.shape[0]
    ph, pw = padding
    ho, wo = h + 2 * ph - 2, wd + 2 * pw - 2
    th, tw = math.ceil(ho / 2), math.ceil(wo / 2)
    bt, g, at = _winograd_matrices(x)
    xp = F.pad(x, (pw, pw + 2 * tw - wo, ph, ph + 2 * th - ho))  # [N, C, 2th+2, 2tw+2]
    tiles = xp.unfold(2, 4, 2).unfold(3, 4, 2)  # [N, C, th, tw, 4, 4]
    v = torch.einsum("ij,nchwjk,lk->ilcnhw", bt, tiles, bt).reshape(16, c, n * th * tw)
    u = torch.einsum("ij,ocjk,lk->iloc", g, w, g).reshape(16, o, c)
    m = torch.bmm(u, v).reshape(4, 4, o, n, th, tw)
    del v
    y = torch.einsum("ij,jkonhw,lk->nohiwl", at, m, at).reshape(n, o, 2 * th, 2 * tw)
    out = x.new_empty((n, o, ho, wo))  # the result owns its storage (not a view of a temporary)
    out.copy_(y[:, :, :ho, :wo])
    return out


def _winograd_backward(x, w, grad, padding, need_input, need_weight):
    grad_input = grad_weight = None
    if need_input:
        flipped = w.flip(2, 3).transpose(0, 1)  # [C, O, 3, 3]
        grad_input = _winograd_forward(grad, flipped, (2 - padding[0], 2 - padding[1]))
    if need_weight:
        _, grad_weight = _im2col_backward(x, w, grad, (1, 1), padding, (1, 1), False, True)
    return grad_input, grad_weight


def _owns_exactly_its_storage(tensor) -> bool:
    return (tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def _owning(tensor):
    """The result as a tensor that owns exactly its storage: an implementation must keep no more than native's."""
    if tensor is None:
        return None
    if tensor.is_contiguous() and _owns_exactly_its_storage(tensor):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _channels_last(tensor):
    return tensor.contiguous(memory_format=torch.channels_last)


def _natively_channels_last(x, w) -> bool:
    """ATen's convolutions (oneDNN's and cuDNN's) lay every result out channels-last when either operand is."""
    return any(t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous() for t in (x, w))


def _strides(shape, channels_last: bool) -> tuple[int, ...]:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c) if channels_last else (c * h * w, h * w, w, 1)


def _laid_out_as_native(tensor, channels_last: bool):
    """`tensor` with the strides native's result would have (every one: a kernel compiled for the nodes after
    checks them all, those of a dimension of size 1 too), owning exactly its storage."""
    if tensor is None:
        return None
    strides = _strides(tensor.shape, channels_last)
    if tensor.stride() == strides and _owns_exactly_its_storage(tensor):
        return tensor
    return torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def _into_rows(n: int, compute_part, channels_last: bool):
    """compute_part(start, end) for each quarter of the batch, written into its rows of one result with native's
    strides (each part freed before the next)."""
    whole = None
    for start, end in _chunks(n):
        part = compute_part(start, end)
        if whole is None:
            shape = (n, *part.shape[1:])
            whole = torch.empty_strided(shape, _strides(shape, channels_last), dtype=part.dtype, device=part.device)
        whole[start:end].copy_(part)
        del part
    return whole


def _batch_split_forward(x, w, b, arguments):
    return _into_rows(x.shape[0], lambda start, end: torch.ops.aten.convolution(x[start:end], w, b, *arguments),
                      _natively_channels_last(x, w))


def _batch_split_backward(grad, x, w, bias_sizes, arguments, output_mask, summed: bool = False):
    """The input gradient part by part into its rows of one result; the filter and bias gradients by one call on
    the whole batch, as native computes them (summed over parts they round otherwise: 1.1e-5 of the largest
    gradient on ResNet-18-small's stem at batch 2048), or with `summed` part by part too, in the parts' order."""
    need_input, need_weight, need_bias = output_mask
    grad_input = grad_weight = grad_bias = None
    if need_weight or need_bias:
        for start, end in (_chunks(x.shape[0]) if summed else [(0, x.shape[0])]):
            _, part_weight, part_bias = torch.ops.aten.convolution_backward(
                grad[start:end], x[start:end], w, bias_sizes, *arguments, [False, need_weight, need_bias])
            grad_weight = part_weight if grad_weight is None else grad_weight.add_(part_weight)
            grad_bias = part_bias if grad_bias is None else grad_bias.add_(part_bias)
            del part_weight, part_bias
    if need_input:
        grad_input = _into_rows(x.shape[0], lambda start, end: torch.ops.aten.convolution_backward(
            grad[start:end], x[start:end], w, bias_sizes, *arguments, [True, False, False])[0],
            _natively_channels_last(x, w))
    return grad_input, grad_weight, grad_bias


def forward(name: str, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    """What aten.convolution computes, by algorithm `name` (not native: 2-D, not transposed; groups 1 but for
    channels-last and batch-split)."""
    if name == "channels-last":
        out = torch.ops.aten.convolution(_channels_last(x), _channels_last(w), b, stride, padding, dilation,
                                         transposed, output_padding, groups)
        return _laid_out_as_native(out, _natively_channels_last(x, w))
    if name in BATCH_SPLITS:  # a forward sums over no samples: batch-split-sum's is batch-split's
        return _batch_split_forward(x, w, b, (stride, padding, dilation, transposed, output_padding, groups))
    if name == "im2col":
        out = _im2col_forward(x, w, _pair(stride), _pair(padding), _pair(dilation))
    elif name == "im2col-chunked":
        out = _chunked_forward(x, w, _pair(stride), _pair(padding), _pair(dilation))
    elif name == "winograd":
        out = _winograd_forward(x, w, _pair(padding))
    else:
        raise ValueError(f"unknown convolution algorithm {name!r}")
    if b is not None:
        out += b.view(1, -1, 1, 1)
    return _owning(out)


def backward(name: str, grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
             output_mask):
    """What aten.convolution_backward computes for `output_mask`, by algorithm `name` (not native)."""
    if name == "channels-last":
        # the input's values are read for the filter gradient only; the input gradient needs its sizes alone (the
        # weight's channels-last layout makes ATen pick the NHWC kernel), so a stand-in is not written out
        operand = _channels_last(x) if output_mask[1] else x
        gi, gw, gb = torch.ops.aten.convolution_backward(
            _channels_last(grad), operand, _channels_last(w), bias_sizes, stride, padding, dilation,
            transposed, output_padding, groups, output_mask)
        channels_last = _natively_channels_last(x, w)
        return _laid_out_as_native(gi, channels_last), _laid_out_as_native(gw, channels_last), _owning(gb)
    if name in BATCH_SPLITS:
        arguments = (stride, padding, dilation, transposed, output_padding, groups)
        gi, gw, gb = _batch_split_backward(grad, x, w, bias_sizes, arguments, output_mask,
                                           summed=name == "batch-split-sum")
        channels_last = _natively_channels_last(x, w)
        return _laid_out_as_native(gi, channels_last), _laid_out_as_native(gw, channels_last), _owning(gb)
    need_input, need_weight, need_bias = output_mask
    grad = grad.contiguous()
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    if name == "im2col":
        gi, gw = _im2col_backward(x, w, grad, stride, padding, dilation, need_input, need_weight)
    elif name == "im2col-chunked":
        gi, gw = _chunked_backward(x, w, grad, stride, padding, dilation, need_input, need_weight)
    elif name == "winograd":
        gi, gw = _winograd_backward(x, w, grad, padding, need_input, need_weight)
    else:
        raise ValueError(f"unknown convolution algorithm {name!r}")
    gb = grad.sum((0, 2, 3)) if need_bias else None
    return _owning(gi), _owning(gw), _owning(gb)


def geometry_of(input_shape, weight_shape, stride, padding, dilation, transposed, groups) -> ConvGeometry | None:
    """The geometry of a 2-D, non-transposed convolution; None for anything else (native only)."""
    if transposed or len(input_shape) != 4 or len(weight_shape) != 4:
        return None
    if len(list(stride)) != 2 or len(list(padding)) != 2 or len(list(dilation)) != 2:
        return None
    return ConvGeometry.of(input_shape, weight_shape, tuple(stride), tuple(padding), tuple(dilation), groups)

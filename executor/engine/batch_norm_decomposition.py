"""Batch norm in a compiled kernel, summed as ATen's CPU kernel sums it.

The gradients reaching a batch norm nearly cancel (its backward removes their
mean), so a batch norm rounded otherwise than eager's moves a convolution
weight's gradient by 1e-2 (Inductor's own decomposition sums in float32 in
its own order; ATen's channels-last kernel does too). ATen's kernel for a
float32 tensor laid out NCHW (`batch_norm_kernel.cpp`, the contiguous path)
sums each channel in double, so its statistics are the exact sums rounded
once: a kernel that sums in double gets the same float32 statistics whatever
its order, and then applies them in ATen's arithmetic (`x * alpha + beta`,
with alpha and beta formed as ATen forms them). Inductor then fuses the batch
norm with what surrounds it (ReLU, residual adds, copies).

Only where ATen takes that path: float32 on the CPU, in training, a
contiguous input whose channel stride is not 1 (an N x C x 1 x 1 tensor is
also channels-last, and ATen treats it so), every parameter and statistic
present. Anything else returns NotImplemented, and Inductor calls ATen's
kernel, as before. The forward's output matches ATen's bit for bit only where
the compiler contracts `x * alpha + beta` into one fused multiply-add as
ATen's build does: `inductor_options` gives the kernels that may hold one
that setting. The backward's per-image partial sums
are float32 in ATen's kernel and here, in other orders: gradients 1e-6 apart
(`tests/test_batch_norm_decomposition.py`).
"""

from __future__ import annotations

import struct

import torch

_aten = torch.ops.aten

# what GCC does by default and ATen's CPU kernels were built with: a * b + c as one rounding
FLOATING_POINT_CONTRACTION = "fast"


def _on_the_contiguous_path(*tensors) -> bool:
    """ATen's choice of its contiguous CPU kernel (`batch_norm_use_channels_last_kernels` false)."""
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or tensor.dim() < 3:
            return False
        if not tensor.is_contiguous() or tensor.stride()[1] == 1:
            return False
    return True


def _vectors(*tensors) -> bool:
    return all(t is not None and t.dtype == torch.float32 and t.dim() == 1 for t in tensors)


def _float32(value: float) -> float:
    """`value` rounded to float32 (as C++'s `static_cast<float>`), as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _channel_shape(tensor) -> list[int]:
    return [1, -1] + [1] * (tensor.dim() - 2)


def batch_norm_forward(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """`_native_batch_norm_legit_functional`: output, mean, inverse deviation, new running mean and variance."""
    if not training or not _on_the_contiguous_path(input) or not _vectors(weight, bias, running_mean, running_var):
        return NotImplemented
    count = input.numel() // input.shape[1]
    dims = [0] + list(range(2, input.dim()))
    shape = _channel_shape(input)
    mean = (input.to(torch.float64).sum(dims) / count).to(torch.float32)
    centred = input - mean.view(shape)
    # each square in float32, the sum in double
    variance_sum = (centred * centred).to(torch.float64).sum(dims).to(torch.float32)
    invstd = (1.0 / torch.sqrt((variance_sum / count).to(torch.float64) + eps)).to(torch.float32)
    alpha = invstd * weight
    beta = bias - mean * alpha
    output = input * alpha.view(shape) + beta.view(shape)
    # ATen's update: momentum * mean + (1 - momentum) * running_mean in float32, each product rounded (a product of
    # two float32 numbers is exact in double, so rounding it to float32 rounds it once, and the kernel's
    # contraction cannot fuse it into the sum); the variance's in double, beside (1 - momentum) * running_var rounded
    momentum_float = _float32(momentum)
    keep = _float32(1 - momentum_float)
    new_mean = ((mean.to(torch.float64) * momentum_float).to(torch.float32)
                + (running_mean.to(torch.float64) * keep).to(torch.float32))
    unbiased = (variance_sum / (count - 1)).to(torch.float64)
    kept_var = (running_var.to(torch.float64) * keep).to(torch.float32).to(torch.float64)
    new_var = (unbiased * momentum_float + kept_var).to(torch.float32)
    return output, mean, invstd, new_mean, new_var


def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                        output_mask):
    """`native_batch_norm_backward` in training: the input's, weight's and bias's gradients (None where not asked)."""
    if not train or not _on_the_contiguous_path(input, grad_out) or not _vectors(weight, save_mean, save_invstd):
        return NotImplemented
    count = input.numel() // input.shape[1]
    image = list(range(2, input.dim()))
    shape = _channel_shape(input)
    # per image in float32, across the batch in double, as ATen's kernel
    total = grad_out.sum(image).to(torch.float64).sum(0)
    centred = input - save_mean.view(shape)
    dot = (centred * grad_out).sum(image).to(torch.float64).sum(0)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        projection = dot.to(torch.float32) * save_invstd * save_invstd / count
        grad_mean = (total / count).to(torch.float32)
        grad_input = ((grad_out - grad_mean.view(shape) - centred * projection.view(shape))
                      * save_invstd.view(shape) * weight.view(shape))
    if output_mask[1]:
        grad_weight = (dot * save_invstd.to(torch.float64)).to(torch.float32)
    if output_mask[2]:
        grad_bias = total.to(torch.float32)
    return grad_input, grad_weight, grad_bias


DECOMPOSITIONS = {
    _aten._native_batch_norm_legit_functional.default: batch_norm_forward,
    _aten.native_batch_norm_backward.default: batch_norm_backward,
}


def inductor_options(module: torch.fx.GraphModule) -> dict:
    """Inductor's settings for a kernel compiled from `module`: ATen's floating-point contraction where it may hold
    a batch norm decomposed here (on the CPU), without which the output is one rounding apart in half the elements;
    none otherwise."""
    for node in module.graph.nodes:
        value = node.args[0].meta.get("val") if node.op == "call_function" and node.target in DECOMPOSITIONS else None
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return {"cpp.enable_floating_point_contract_flag": FLOATING_POINT_CONTRACTION}
    return {}

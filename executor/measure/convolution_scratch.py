"""How much scratch ATen's own convolution takes, known before the full-size step runs.

The measuring pass must fit the budget, so each native convolution's scratch has
to be bounded before it runs once. oneDNN and ATen keep that scratch to
themselves; a formula from shapes alone must cover the worst layout conversion
(a 3-channel input padded to a blocked layout, im2col's columns), so it is
several times what most convolutions take (ResNet-18-small's stem at batch 2048:
144 MiB allowed, 32 MiB taken), and at a large batch it alone refuses budgets
that every real step fits.

On the CPU the scratch is layout conversions and per-thread buffers: it grows
linearly with the samples times the pixels (measured exactly linear from batch 4
to 2048 on ResNet-18-small's convolutions, forward and each backward half; the
six-convolution network at batch 128 took at its full batch what the line
through 16 and 32 samples said, to the byte; at batch 16 a stem, 3x3, 1x1 and
depthwise convolutions took from 16x16 images to 64x64 what the pixels said).
So each distinct convolution call is run for real, under the allocator's own
events, at three sizes, and carried to the full call (the line through the
outer two, or the largest scaled, whichever is more) with a margin: 2% where
the middle probe lies on the line (within 2% of the larger probe's scratch, or
64 KiB), 25% where it does not. A probe holds at most a quarter of one
convolution's tensors, one probe at a time, and only where the budget has room
for it.

The kernel must be the one the full call runs: with one thread oneDNN ran
MobileNetV2's 1x1 convolutions without any scratch at 4 and 8 samples and with
layout copies (0.8-1.2x their tensors) at 16 and 64. So a batch of 128 or more
is probed on a sixteenth and an eighth of it (16 samples at least) and halfway
between; a smaller one at its full batch, on crops of its images (a quarter and
a half of each side); where the image is under 16 pixels a side, a grouped
convolution of 48 groups or more on some of its groups (multiples of 16, whole
batch and image: a depthwise convolution's scratch is exactly linear in its
groups at multiples of oneDNN's channel block, and above it off them), and any
other as the call itself, once.
A measuring pass that held more than estimated all the same is reported
(`profiler._check_measuring_peak`). The formula stays the ceiling, except where
a probe took more than it allows at the probe's own size (a kernel it does not
know: the measurement is then the bound), and on a GPU (where cuDNN picks its
algorithm, and so its workspace, by the batch) it stays the answer.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.profiler import record_function

from executor.engine import conv_algorithms
from executor.measure.allocations import cpu_workspace_bytes, memory_events
from executor.capture.capture import SHAPE_ONLY
from executor.capture.planning_graph import CONVOLUTION

SMALLEST_PROBE_SAMPLES = 16  # below it oneDNN may run another kind of kernel than at the full batch
SMALLEST_BATCH_PROBED = 128  # so that a probe holds at most a quarter of the batch
PROBE_ROUNDING_BYTES = 1024
SMALLEST_CROPPED_SIDE = 16  # a smaller image is not cropped (its crops would be a few pixels): groups or the call
SCRATCH_MARGIN = 1.25
# where the probe between the two lies on their line (within LINEAR_WITHIN of the larger, or LINEAR_SLACK_BYTES):
# the scratch is seen to grow by the sample, as it did on every convolution measured, and the margin is for rounding:
# the line without it covered every full call of the zoo's CNNs (float32 and bfloat16), ResNet-18-small at 8, 64 and
# 256, MobileNetV2 at 128 and ConvNeXt, with one thread and two, to the byte (2026-12-01, a Sapphire Rapids core)
LINEAR_SCRATCH_MARGIN = 1.02
LINEAR_WITHIN = 0.02
LINEAR_SLACK_BYTES = 64 << 10
SCRATCH_FLOOR_BYTES = 256 << 10  # fixed buffers of tiny convolutions


ProbeShape = tuple[int, int, int, int]  # an input's samples, height and width, and the call's groups
# an uncroppable image's grouped convolution is probed on some of its groups, multiples of oneDNN's channel block,
# where it has 48 groups or more (16 and 32 of them at least, both less than the call)
SMALLEST_GROUPS_PROBED = 48


def native_convolution_scratch_bytes(geometry: conv_algorithms.ConvGeometry, element_size: int) -> int:
    """The formula: on the CPU (ResNet-18 small at batch 8 and 256, the zoo's ResNet, MobileNetV2 and in-place CNN:
    every convolution and backward half) the scratch stayed within 0.8 of the smaller of 3 x (im2col's columns +
    input + weights + output), what strided 1x1 convolutions approach, and 4.5 x (input + weights + output), plus
    256 KiB for the fixed buffers of tiny convolutions."""
    tensors = _tensor_elements(geometry)
    return int(element_size * min(3 * (geometry.columns_elements + tensors), 4.5 * tensors)) + SCRATCH_FLOOR_BYTES


ONEDNN_CHANNEL_BLOCK = 16  # oneDNN's channel blocking on AVX-512 (8 on AVX2: 16 covers both)


def blocked_filter_gradient_bytes(group, batch: int | None = None, channels_last: bool | None = None,
                                   groups: int | None = None) -> int:
    """Scratch the shape formula misses: oneDNN computes the filter gradient of a grouped convolution with few
    channels per group over a channels-last input, with a kernel larger than 3x3 (ConvNeXt's 7x7 depthwise), in a
    layout that pads each group's input and output channels to a block of 16, and copies the input: 256 x the
    filter gradient (16 x 16 per channel) and an input's size, whatever the batch (ConvNeXt-T's last stage, 384
    channels at 7x7, at batch 2: 19.4 MiB where the formula said 1.9; a 3x3 one runs a depthwise kernel without
    it). `batch`: the input's batch where it is called on part of it; `channels_last`: the input's layout where the
    call lays it out so (algorithm channels-last); `groups`: how many of its groups where it is called on some."""
    node = group.convolution
    if node is None or node.target is CONVOLUTION or not node.args[10][1]:
        return 0  # not a filter gradient
    x, w, _, padding, _, transposed, all_groups = _convolution_arguments(node)
    x_value, w_value = x.meta["val"], w.meta["val"]
    if transposed or all_groups == 1 or x_value.dim() != 4 or x_value.device.type != "cpu":
        return 0
    if channels_last is None:
        channels_last = (x_value.is_contiguous(memory_format=torch.channels_last)
                         and not x_value.is_contiguous())
    out_per_group, in_per_group, kernel_h, kernel_w = (int(size) for size in w_value.shape)
    out_per_group //= all_groups
    groups = all_groups if groups is None else groups
    block = ONEDNN_CHANNEL_BLOCK
    if not channels_last or kernel_h * kernel_w <= 9 or min(in_per_group, out_per_group) >= block:
        return 0
    padded = groups * -(-out_per_group // block) * block * -(-in_per_group // block) * block * kernel_h * kernel_w
    samples = int(x_value.shape[0]) if batch is None else batch
    channels = int(x_value.shape[1]) * groups // all_groups
    element_size = x_value.element_size()
    if element_size >= 4:
        return (padded + samples * channels * math.prod(int(size) for size in x_value.shape[2:])) * element_size
    # in bfloat16 or half oneDNN holds the padded gradient twice, in float32 and in the input's type, and copies the
    # padded input in float32 (the residue stayed within 8 bytes a padded input element: 0.5-6.6 measured, over 2-16
    # samples, 64-384 channels, 2x2 to 8x8 images, 5x5 and 7x7 kernels); an input of 80 channels at 4x4 and batch
    # 16 took 5.9 MiB, where counting it as float32's in the input's type said 2.2
    padded_pixels = math.prod(int(size) + 2 * int(pad) for size, pad in zip(x_value.shape[2:], padding))
    return padded * (4 + element_size) + samples * channels * padded_pixels * 8


def covering_blocked_filter_gradient(formula_bytes: int, group, batch: int | None = None,
                                     channels_last: bool | None = None, groups: int | None = None) -> int:
    """The formula's scratch, or the blocked filter gradient's (beside which the call's other scratch stayed under
    SCRATCH_FLOOR_BYTES in every case measured: 3-75 KB), whichever is more."""
    blocked = blocked_filter_gradient_bytes(group, batch, channels_last, groups)
    return max(formula_bytes, blocked + SCRATCH_FLOOR_BYTES) if blocked else formula_bytes


def unprobed_for_room(planning, device, probed: dict[int, int]) -> list[tuple[object, int]]:
    """(planning group, bytes a probe of it needs beyond the fixed memory) for each native convolution the probe
    applies to that `probed` lacks: the budget had no room for its probe, so the formula stands for its scratch."""
    if torch.device(device).type != "cpu":
        return []
    return [(group, need) for group, _, need in _probeable(planning) if group.index not in probed]


def splits_the_batch(group) -> bool:
    """Whether algorithm batch-split runs this node other than native does: a forward convolution or an input
    gradient (a filter gradient alone is native's call on the whole batch, the same call)."""
    node = group.convolution
    return node.target is CONVOLUTION or bool(node.args[10][0])


def sums_over_the_batch(group) -> bool:
    """Whether algorithm batch-split-sum runs this node other than batch-split does: a backward node that computes
    the filter or bias gradient."""
    node = group.convolution
    return node.target is not CONVOLUTION and any(node.args[10][1:])


def batch_split_scratch_bytes(group, algorithm: str, element_size: int, probed_bytes: int | None = None) -> int:
    """Native's scratch within `algorithm` (one of conv_algorithms.BATCH_SPLITS): its calls on a quarter of the
    batch (the scratch grows linearly with the batch, above), and for a backward node that computes the filter or
    bias gradient, batch-split's is native's own call on the whole batch. `probed_bytes`: the whole call's bound as
    probed, if it was."""
    geometry = convolution_geometry(group)
    whole = probed_bytes if probed_bytes is not None else native_scratch_bound_bytes(group)
    if sums_over_the_batch(group) and algorithm != "batch-split-sum":
        return whole
    batch = geometry.input_shape[0]
    part = math.ceil(batch / conv_algorithms.CHUNKS)
    if probed_bytes is None:
        sliced = dataclasses.replace(geometry, input_shape=(part, *geometry.input_shape[1:]))
        return covering_blocked_filter_gradient(native_convolution_scratch_bytes(sliced, element_size), group, part)
    # a blocked filter gradient does not shrink with the batch: each part's call has it
    return min(whole, covering_blocked_filter_gradient(math.ceil(whole * part / batch) + SCRATCH_FLOOR_BYTES,
                                                       group, part))


def _tensor_elements(geometry: conv_algorithms.ConvGeometry) -> int:
    """Input + weights + output."""
    output_elements = math.prod((geometry.input_shape[0], geometry.weight_shape[0]) + geometry.output_hw)
    return math.prod(geometry.input_shape) + math.prod(geometry.weight_shape) + output_elements


def convolution_input(group):
    node = group.convolution
    return node.args[0] if node.target is CONVOLUTION else node.args[1]


def _convolution_arguments(node) -> tuple:
    """(input, weight, stride, padding, dilation, transposed, groups) of a convolution or its backward."""
    if node.target is CONVOLUTION:
        return tuple(node.args[i] for i in (0, 1, 3, 4, 5, 6, 8))
    return tuple(node.args[i] for i in (1, 2, 4, 5, 6, 7, 9))


def convolution_geometry(group) -> conv_algorithms.ConvGeometry | None:
    if group.convolution is None:
        return None
    x, w, stride, padding, dilation, transposed, groups = _convolution_arguments(group.convolution)
    return conv_algorithms.geometry_of(x.meta["val"].shape, w.meta["val"].shape, stride, padding, dilation,
                                       transposed, groups)


def native_scratch_bound_bytes(group) -> int:
    """The formula's bound on native's scratch for a convolution of any shape: a 1-D one as the 2-D convolution of
    height 1 it is (wav2vec2's feature extractor and positional convolution, counted no scratch at all, took 2-64x
    their results in oneDNN's layout copies and columns, and its measuring pass went 6.6% over its budget: measured
    within 0.33 of the lifted formula); one the formula does not cover (3-D, transposed) by its tensors alone, the
    formula's other term."""
    geometry = convolution_geometry(group) or _lifted_1d_geometry(group)
    element_size = convolution_input(group).meta["val"].element_size()
    if geometry is not None:
        return covering_blocked_filter_gradient(native_convolution_scratch_bytes(geometry, element_size), group)
    node = group.convolution
    x, w, *_ = _convolution_arguments(node)
    output = node if node.target is CONVOLUTION else node.args[0]  # backward: the output's gradient
    elements = sum(value.meta["val"].numel() for value in (x, w, output))
    return int(element_size * 4.5 * elements) + SCRATCH_FLOOR_BYTES


def _lifted_1d_geometry(group) -> conv_algorithms.ConvGeometry | None:
    if group.convolution is None:
        return None
    x, w, stride, padding, dilation, transposed, groups = _convolution_arguments(group.convolution)
    x_shape, w_shape = tuple(x.meta["val"].shape), tuple(w.meta["val"].shape)
    if transposed or len(x_shape) != 3 or len(w_shape) != 3 or len(list(stride)) != 1:
        return None
    return conv_algorithms.geometry_of((x_shape[0], x_shape[1], 1, x_shape[2]), (w_shape[0], w_shape[1], 1, w_shape[2]),
                                       (1, stride[0]), (0, padding[0]), (1, dilation[0]), False, groups)


def _fake(argument) -> torch.Tensor | None:
    """The fake tensor an fx argument stands for, or None (a literal)."""
    value = argument.meta.get("val") if hasattr(argument, "meta") else None
    return value if isinstance(value, torch.Tensor) else None


def _shape_only(argument) -> bool:
    """A data-gradient call's stand-in for the convolution's input (capture._split_convolution_backward)."""
    return hasattr(argument, "meta") and bool(argument.meta.get(SHAPE_ONLY))


def _signature(node) -> tuple:
    parts = [str(node.target)]
    for argument in node.args:
        value = _fake(argument)
        if value is not None:
            parts.append((tuple(value.shape), tuple(value.stride()), str(value.dtype), _shape_only(argument)))
        else:
            parts.append(repr(argument))
    return tuple(parts)


def _real_like(value: torch.Tensor, shape: tuple[int, ...], device) -> torch.Tensor:
    channels_last = value.dim() == 4 and not value.is_contiguous() and value.is_contiguous(
        memory_format=torch.channels_last)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return torch.zeros(shape, dtype=value.dtype, device=device).contiguous(memory_format=layout)


def _cut(geometry: conv_algorithms.ConvGeometry, probe: ProbeShape) -> conv_algorithms.ConvGeometry:
    """The convolution's geometry cut to `probe`: its input to the samples, height and width, and both its input's
    channels and its filters to the groups."""
    batch, height, width, groups = probe
    channels = geometry.input_shape[1] * groups // geometry.groups
    filters = geometry.weight_shape[0] * groups // geometry.groups
    return dataclasses.replace(geometry, input_shape=(batch, channels, height, width),
                               weight_shape=(filters, *geometry.weight_shape[1:]), groups=groups)


def _arguments(group, probe: ProbeShape, device) -> list:
    """The call's arguments cut to `probe`, made as the step makes them: a data gradient's stand-in for the input
    is one element expanded to the input's shape, which oneDNN writes out in full in its scratch (an input's size
    more than with a real input: ResNet-18-small's data gradients at batch 2048 took 2-16 MiB more)."""
    node = group.convolution
    geometry = _cut(convolution_geometry(group), probe)
    filters = geometry.weight_shape[0]
    output_shape = (probe[0], filters, *geometry.output_hw)
    forward = node.target is CONVOLUTION
    # forward: input, weight, bias, ..., groups at 8; backward: output's gradient, input, weight, bias sizes, ...,
    # groups at 9
    input_position = 0 if forward else 1
    shapes = {input_position: geometry.input_shape, input_position + 1: geometry.weight_shape}
    literals = {8 if forward else 9: geometry.groups}
    if forward:
        shapes[2] = (filters,)  # the bias, where there is one
    else:
        shapes[0] = output_shape  # the output's gradient
        if node.args[3] is not None:
            literals[3] = [filters]  # the bias gradient's size
    arguments = []
    for position, argument in enumerate(node.args):
        value = _fake(argument)
        shape = shapes.get(position, None if value is None else tuple(value.shape))
        if position in literals:
            arguments.append(literals[position])
        elif value is not None and _shape_only(argument):
            arguments.append(torch.zeros((), dtype=value.dtype, device=device).expand(shape))
        elif value is not None:
            arguments.append(_real_like(value, shape, device))
        else:
            arguments.append(argument)
    return arguments


def _probe_need_bytes(group, probe: ProbeShape, element_size: int) -> int:
    """What a probe of `probe`'s size may hold at most: its arguments and results (a filter and data gradient's
    call holds the output's gradient, the input, the weights and a gradient of each: within twice input + weights
    + output, whatever the bias), the formula's scratch, and 1 KiB for the allocator's rounding."""
    cut = _cut(convolution_geometry(group), probe)
    return 2 * _tensor_elements(cut) * element_size + PROBE_ROUNDING_BYTES + _formula_bytes(group, probe)


def _probeable(planning):
    """(planning group, probe shapes, bytes its largest probe needs) for each native convolution the probe applies
    to: each one the formula covers."""
    for group in planning.groups:
        geometry = convolution_geometry(group)
        if geometry is None:  # no convolution, or one the formula does not cover either
            continue
        probes = probe_shapes(geometry)
        element_size = convolution_input(group).meta["val"].element_size()
        yield group, probes, _probe_need_bytes(group, probes[-1], element_size)


def probe_batches(batch: int) -> tuple[int, int, int]:
    """A sixteenth and an eighth of the batch (16 and 32 samples at least): large enough that the per-sample part
    outweighs fixed buffers, and that oneDNN runs the kind of kernel it runs at the full batch; and the batch
    halfway between them, which tells whether the scratch lies on their line."""
    small, large = max(SMALLEST_PROBE_SAMPLES, batch // 16), max(2 * SMALLEST_PROBE_SAMPLES, batch // 8)
    return small, (small + large) // 2, large


def _crop_sides(side: int) -> tuple[int, int, int] | None:
    """A quarter and a half of an image side, and halfway between; None for a side below SMALLEST_CROPPED_SIDE."""
    if side < SMALLEST_CROPPED_SIDE:
        return None
    small, large = side // 4, side // 2
    return small, (small + large) // 2, large


def _probed_groups(groups: int) -> tuple[int, ...] | None:
    """A quarter and a half of the groups, and halfway between, each rounded down to a multiple of oneDNN's channel
    block (off it the blocks are padded: MobileNetV2's 8x8 depthwise convolution took 1.0-2.0 x its input at 16,
    32 and 48 groups, 1.7-2.7 x at 12 and 24); the two smallest multiples where fewer fit; None below
    SMALLEST_GROUPS_PROBED."""
    if groups < SMALLEST_GROUPS_PROBED:
        return None
    block = ONEDNN_CHANNEL_BLOCK

    def down(count: int) -> int:
        return max(block, count // block * block)

    small, large = down(groups // 4), down(groups // 2)
    if large == small:
        return block, 2 * block
    middle = down((small + large) // 2)
    return (small, middle, large) if small < middle < large else (small, large)


def probe_shapes(geometry: conv_algorithms.ConvGeometry) -> tuple[ProbeShape, ...]:
    """The input shapes (samples, height, width) and groups the call is probed at, the largest last: slices of a
    batch of SMALLEST_BATCH_PROBED or more; below it, the full batch (so that oneDNN runs the kernel it runs for
    the step: it picks by the batch, see above) on crops of the image, a sixteenth to a quarter of its area; where
    the image is too small to crop, some of a grouped call's groups; else the call itself, once."""
    batch, _, height, width = geometry.input_shape
    groups = geometry.groups
    if batch >= SMALLEST_BATCH_PROBED:
        return tuple((samples, height, width, groups) for samples in probe_batches(batch))
    heights, widths = _crop_sides(height), _crop_sides(width)
    if heights is not None and widths is not None:
        crops = tuple((batch, h, w, groups) for h, w in zip(heights, widths))
        if all(min(_cut(geometry, crop).output_hw) >= 1 for crop in crops):
            return crops
    some_groups = _probed_groups(groups)
    if some_groups is not None:
        return tuple((batch, height, width, count) for count in some_groups)
    return ((batch, height, width, groups),)


def _positions(probe: ProbeShape) -> int:
    """The probe's size along which the scratch grows: samples x pixels of the input x groups, counted in whole
    channel blocks (as oneDNN pads them)."""
    samples, height, width, groups = probe
    block = ONEDNN_CHANNEL_BLOCK
    return samples * height * width * -(-groups // block) * block


def _carried_bytes(geometry: conv_algorithms.ConvGeometry, probed: list[tuple[ProbeShape, int]]) -> int:
    """The scratch at the full size from what the probes took: the call itself as measured; else the line through
    the smallest and largest probes, or the largest scaled, whichever is more, with SCRATCH_MARGIN, or
    LINEAR_SCRATCH_MARGIN where a middle probe lies on the line (two probes, on a few groups, have none)."""
    batch, _, height, width = geometry.input_shape
    full = _positions((batch, height, width, geometry.groups))
    if len(probed) == 1:
        return probed[0][1]  # the call itself, as the step makes it
    (small, at_small), *between, (large, at_large) = ((_positions(probe), taken) for probe, taken in probed)
    per_position = max(0.0, (at_large - at_small) / (large - small))
    # two probes (a few groups): no third tells whether the scratch is on their line
    on_the_line = bool(between) and all(
        abs(at_middle - (at_small + per_position * (middle - small))) <= max(LINEAR_WITHIN * at_large,
                                                                             LINEAR_SLACK_BYTES)
        for middle, at_middle in between)
    margin = LINEAR_SCRATCH_MARGIN if on_the_line else SCRATCH_MARGIN
    carried = max(at_small + per_position * (full - small), at_large * full / large)
    # slices of the batch keep the formula's 256 KiB for fixed buffers; crops and groups run at the full batch, and
    # a line through them has the call's fixed buffers in it
    slack = SCRATCH_FLOOR_BYTES if probed[0][0][0] < batch else LINEAR_SLACK_BYTES
    return int(margin * carried) + slack


def probe_native_scratch(planning, device, room_bytes: int | None = None) -> dict[int, int]:
    """Planning node index -> scratch bound (bytes) for each native convolution probed; nodes absent keep the
    formula. `room_bytes`: what the budget leaves beside what the caller holds (None: unknown; one probe runs at a
    time)."""
    device = torch.device(device)
    if device.type != "cpu":
        return {}
    by_signature: dict[tuple, list] = {}
    for group, probes, need in _probeable(planning):
        if room_bytes is None or need <= room_bytes:
            by_signature.setdefault(_signature(group.convolution), []).append((group, probes))
    if not by_signature:
        return {}
    calls = []  # (signature, probe shape, planning group)
    for signature, members in by_signature.items():
        group, probes = members[0]
        calls += [(signature, probe, group) for probe in probes]
    with torch.no_grad(), memory_events() as trees:
        for index, (_, probe, group) in enumerate(calls):
            arguments = _arguments(group, probe, device)
            group.convolution.target(*arguments)  # oneDNN's first call of a kind sets up its primitive
            with record_function(f"mosos-node:{index}"):
                result = group.convolution.target(*arguments)
            del result, arguments
    measured = cpu_workspace_bytes(trees[0], len(calls))
    scratch: dict[tuple, list[tuple[ProbeShape, int]]] = {}
    for index, (signature, probe, _) in enumerate(calls):
        scratch.setdefault(signature, []).append((probe, measured.get(index, 0)))
    bounds = {}
    for signature, members in by_signature.items():  # one signature, one shape: one bound for all its members
        group = members[0][0]
        carried = _carried_bytes(convolution_geometry(group), scratch[signature])
        # the formula is the ceiling unless a probe took more than it allows at the probe's own size: a kernel the
        # formula does not know, whose measurement is then the only bound there is
        refuted = any(taken > _formula_bytes(group, probe) for probe, taken in scratch[signature])
        bounds.update((member.index, carried if refuted else min(native_scratch_bound_bytes(group), carried))
                      for member, _ in members)
    return bounds


def _formula_bytes(group, probe: ProbeShape) -> int:
    """The formula's scratch for the call cut to `probe`."""
    element_size = convolution_input(group).meta["val"].element_size()
    return covering_blocked_filter_gradient(
        native_convolution_scratch_bytes(_cut(convolution_geometry(group), probe), element_size), group, probe[0],
        groups=probe[3])

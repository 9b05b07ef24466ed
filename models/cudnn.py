"""cuDNN convolution algorithm families: where each applies, its time model and its workspace.

One estimate per family, for forward, backward-data and backward-filter: a
convolution's backward is two cuDNN calls (cudnnConvolutionBackwardFilter and
cudnnConvolutionBackwardData), each with its own algorithm, time and
workspace, and the estimator makes each one a node of its own. The
workspace formulas reproduce the sizes cuDNN 7 reports (checked against the
P100 measurements of MONeT's VGG16, see benchmarks/results/calibration.md):

- GEMM: the im2col matrix of the whole batch, (C/g)*KH*KW * OH*OW * N floats.
- Winograd non-fused, F(4x4,3x3): 6x6-tile transforms of input and output of
  the whole batch and of the filters, (N*C*T + N*K*T + C*K) * 36 floats, T the
  number of 4x4 output tiles per image.
- FFT: real-to-complex spectra of size Hf*(Wf/2+1) (Hf, Wf the padded input
  rounded up to a power of two) for 2*(N*K + K*C) planes.
- FFT tiling: 32x32 tiles, spectra of the filters plus those of at most two
  tiles per image for inputs and outputs, (K*C + N*(C+K)*min(T, 2)) * 32*17
  complex values.
- Implicit GEMM needs none, precomputed implicit GEMM a small index table,
  fused Winograd the transformed filters.

Time = the family's useful flops at a family efficiency (scaled down when the
GEMM's reduction or output dimension is too small to fill the tiles) plus, for
the multi-pass families, the memory traffic through their workspace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from models.roofline import Device

FLOAT_BYTES = 4

# Fractions of the FP32 peak reached by each family's main kernel on large shapes (fitted on the P100 data).
EFFICIENCY = {
    "implicit_gemm": 0.70,
    "implicit_precomp_gemm": 0.85,
    "gemm": 0.72,
    "fft": 0.55,
    "fft_tiling": 0.60,
    "winograd": 0.60,
    "winograd_nonfused": 0.80,
}
# Multiplications saved by the Winograd transforms: F(2x2,3x3) and F(4x4,3x3).
WINOGRAD_SAVING = {"winograd": 2.25, "winograd_nonfused": 4.0}
REDUCTION_TILE = 128  # a GEMM reduction shorter than this leaves the tile partly idle (conv1_1: 3*3*3 = 27)
OUTPUT_TILE = 32  # likewise for few output channels
CHANNEL_TILE = 32  # Winograd and FFT kernels reduce over input channels only, in tiles of about 32
FORWARD_FAMILIES = ("implicit_gemm", "implicit_precomp_gemm", "gemm", "fft", "fft_tiling", "winograd",
                    "winograd_nonfused")
BACKWARD_DATA_FAMILIES = ("implicit_gemm", "fft", "fft_tiling", "winograd", "winograd_nonfused")
BACKWARD_FILTER_FAMILIES = ("implicit_gemm", "gemm", "fft", "fft_tiling", "winograd_nonfused")


@dataclass(frozen=True)
class ConvShape:
    """A 2-D convolution: input (n, c, h, w), k filters of kh x kw."""

    n: int
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    element_bytes: int = FLOAT_BYTES

    @property
    def oh(self) -> int:
        return (self.h + 2 * self.padding[0] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1

    @property
    def ow(self) -> int:
        return (self.w + 2 * self.padding[1] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1

    @property
    def flops(self) -> float:
        return 2.0 * self.n * self.k * self.oh * self.ow * (self.c // self.groups) * self.kh * self.kw

    @property
    def input_bytes(self) -> int:
        return self.n * self.c * self.h * self.w * self.element_bytes

    @property
    def output_bytes(self) -> int:
        return self.n * self.k * self.oh * self.ow * self.element_bytes

    @property
    def filter_bytes(self) -> int:
        return self.k * (self.c // self.groups) * self.kh * self.kw * self.element_bytes

    @property
    def unit_stride(self) -> bool:
        return self.stride == (1, 1) and self.dilation == (1, 1) and self.groups == 1

    def transposed(self) -> "ConvShape":
        """The convolution whose backward-data is this one's forward (for stride-1, 'same' shapes)."""
        return replace(self, c=self.k, k=self.c, h=self.oh, w=self.ow)


@dataclass(frozen=True)
class Algorithm:
    family: str
    time_ms: float
    workspace_bytes: int


def _gemm_utilization(reduction: float, outputs: float) -> float:
    return min(1.0, reduction / REDUCTION_TILE) * min(1.0, outputs / OUTPUT_TILE)


def _next_pow2(value: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, value))))


def _fft_size(s: ConvShape) -> tuple[int, int]:
    return _next_pow2(max(s.h + 2 * s.padding[0], s.kh)), _next_pow2(max(s.w + 2 * s.padding[1], s.kw))


def _tiles(s: ConvShape, tile: int) -> int:
    """Output tiles per image when each input tile of `tile` pixels yields tile - kernel + 1 outputs."""
    step_h, step_w = tile - s.kh + 1, tile - s.kw + 1
    return math.ceil(s.oh / step_h) * math.ceil(s.ow / step_w)


def workspace_bytes(family: str, s: ConvShape) -> int:
    e = s.element_bytes
    if family == "implicit_gemm":
        return 0
    if family == "implicit_precomp_gemm":
        return (s.oh * s.ow + (s.c // s.groups) * s.kh * s.kw) * 4  # index table
    if family == "gemm":
        return (s.c // s.groups) * s.kh * s.kw * s.oh * s.ow * s.n * e
    if family == "fft":
        hf, wf = _fft_size(s)
        return 2 * (s.n * s.k + s.k * s.c) * hf * (wf // 2 + 1) * 2 * e
    if family == "fft_tiling":
        return (s.k * s.c + s.n * (s.c + s.k) * min(_tiles(s, 32), 2)) * 32 * 17 * 2 * e
    if family == "winograd":
        return s.c * s.k * 25 * e  # transformed 4x4 filters plus bookkeeping (about 100 bytes per filter pair)
    if family == "winograd_nonfused":
        tiles = math.ceil(s.oh / 4) * math.ceil(s.ow / 4)
        return (s.n * s.c * tiles + s.n * s.k * tiles + s.c * s.k) * 36 * e
    raise ValueError(f"unknown convolution algorithm family {family!r}")


def applies(family: str, s: ConvShape) -> bool:
    """cuDNN's documented applicability, simplified."""
    if family in ("implicit_gemm", "implicit_precomp_gemm", "gemm"):
        return True
    if not s.unit_stride:
        return False
    if family == "fft":
        return s.h + 2 * s.padding[0] <= 256 and s.w + 2 * s.padding[1] <= 256 and s.kh > 1
    if family == "fft_tiling":
        return s.kh <= 32 and s.kw <= 32 and s.kh > 1
    if family in ("winograd", "winograd_nonfused"):
        return (s.kh, s.kw) == (3, 3)
    return False


def _time_ms(family: str, s: ConvShape, device: Device, workspace: int) -> float:
    eff = EFFICIENCY[family] * (device.compute_efficiency / 0.8)
    io = s.input_bytes + s.output_bytes + s.filter_bytes
    if family in ("implicit_gemm", "implicit_precomp_gemm"):
        util = _gemm_utilization((s.c // s.groups) * s.kh * s.kw, s.k)
        return device.kernel_ms(s.flops, io, eff * util)
    if family == "gemm":
        util = _gemm_utilization((s.c // s.groups) * s.kh * s.kw, s.k)
        return device.kernel_ms(s.flops, io, eff * util) + device.memory_ms(2 * workspace + s.input_bytes)
    if family in ("winograd", "winograd_nonfused"):
        util = min(1.0, s.c / CHANNEL_TILE) * min(1.0, s.k / OUTPUT_TILE)
        compute = device.kernel_ms(s.flops / WINOGRAD_SAVING[family], io, eff * util)
        if family == "winograd":
            return compute
        return compute + device.memory_ms(2 * workspace + io, kernels=2)
    if family == "fft":
        hf, wf = _fft_size(s)
        products = 8.0 * s.n * s.k * s.c * hf * (wf // 2 + 1)
        return device.kernel_ms(products, 0, eff * min(1.0, s.c / CHANNEL_TILE)) + device.memory_ms(2 * workspace + io, kernels=3)
    if family == "fft_tiling":
        tiles = _tiles(s, 32)
        products = 8.0 * s.n * s.k * s.c * tiles * 32 * 17
        traffic = 2 * s.n * (s.c + s.k) * tiles * 32 * 17 * 2 * s.element_bytes + io
        return device.kernel_ms(products, 0, eff * min(1.0, s.c / CHANNEL_TILE)) + device.memory_ms(traffic, kernels=3)
    raise ValueError(f"unknown convolution algorithm family {family!r}")


def _family_estimates(families, s: ConvShape, device: Device) -> list[Algorithm]:
    found = []
    for family in families:
        if not applies(family, s):
            continue
        workspace = workspace_bytes(family, s)
        if workspace > device.gpu.memory_bytes:
            continue  # cuDNN cannot allocate it: the algorithm fails, as GEMM does on conv1_2 of the P100 data
        found.append(Algorithm(family, _time_ms(family, s, device, workspace), workspace))
    return found


def forward_algorithms(s: ConvShape, device: Device) -> list[Algorithm]:
    return _family_estimates(FORWARD_FAMILIES, s, device)


def backward_data_algorithms(s: ConvShape, device: Device) -> list[Algorithm]:
    """Gradient w.r.t. the input: a convolution of the output gradient with the flipped filters."""
    if s.unit_stride:
        mirrored = s.transposed()
        return _family_estimates(BACKWARD_DATA_FAMILIES, mirrored, device)
    # strided: only the implicit algorithms apply; same flops as the forward pass
    return _family_estimates(("implicit_gemm",), s, device)


def backward_filter_algorithms(s: ConvShape, device: Device) -> list[Algorithm]:
    """Gradient w.r.t. the filters: same flops, reduction over N*OH*OW (long, so efficient)."""
    return _family_estimates(BACKWARD_FILTER_FAMILIES, s, device)


def pareto(algorithms: list[Algorithm]) -> list[Algorithm]:
    """Those not dominated in (time, workspace), fastest first."""
    kept: list[Algorithm] = []
    for candidate in sorted(algorithms, key=lambda a: (a.time_ms, a.workspace_bytes)):
        if not kept or candidate.workspace_bytes < kept[-1].workspace_bytes:
            kept.append(candidate)
    return kept

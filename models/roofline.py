"""The roofline time model and its stated efficiencies (no torch here).

A kernel takes max(flops / (peak * compute efficiency), bytes / (bandwidth *
memory efficiency)) plus a launch overhead. The efficiencies are round figures
for well-tuned library kernels on large tensors; the convolution families in
`models.cudnn` refine them per algorithm and were checked against measured
cuDNN times (see benchmarks/results/calibration.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.gpus import GPU

COMPUTE_EFFICIENCY = 0.80  # dense GEMM-like kernels (cuBLAS SGEMM reaches 75-90% of peak on large shapes)
TENSOR_CORE_EFFICIENCY = 0.60  # TF32/BF16 tensor-core GEMMs rarely pass 60-70% of the dense peak
MEMORY_EFFICIENCY = 0.80  # streaming kernels (elementwise, normalization, pooling) reach about 80% of bandwidth
ATTENTION_EFFICIENCY = 0.45  # fused attention in FP32 (memory-efficient kernel, no tensor cores)
LAUNCH_MS = 0.005  # per kernel: launch and tail effects


@dataclass(frozen=True)
class Device:
    """A GPU as the time model sees it: peak for the chosen math, and bandwidth."""

    gpu: GPU
    math: str = "fp32"

    @property
    def flops_per_ms(self) -> float:
        return self.gpu.peak_tflops(self.math) * 1e9

    @property
    def compute_efficiency(self) -> float:
        return COMPUTE_EFFICIENCY if self.math == "fp32" or self.gpu.peak_tflops(self.math) == self.gpu.fp32_tflops \
            else TENSOR_CORE_EFFICIENCY

    @property
    def bytes_per_ms(self) -> float:
        return self.gpu.memory_bandwidth_gb_per_s * 1e6

    def kernel_ms(self, flops: float, bytes_moved: float, efficiency: float | None = None, kernels: int = 1) -> float:
        """Roofline time of `kernels` launches doing `flops` and moving `bytes_moved` in all."""
        eff = self.compute_efficiency if efficiency is None else efficiency
        compute = flops / (self.flops_per_ms * eff)
        memory = bytes_moved / (self.bytes_per_ms * MEMORY_EFFICIENCY)
        return max(compute, memory) + kernels * LAUNCH_MS

    def memory_ms(self, bytes_moved: float, kernels: int = 1) -> float:
        return bytes_moved / (self.bytes_per_ms * MEMORY_EFFICIENCY) + kernels * LAUNCH_MS

"""GPUs we may not have, with the figures an estimate needs, and where each figure comes from.

Peaks are the vendor's (boost clock); transfer bandwidths are what pinned
`cudaMemcpyAsync` typically reaches, not the link's nominal rate. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_bytes: int
    fp32_tflops: float
    memory_bandwidth_gb_per_s: float  # 1e9 bytes per second
    pcie: str
    d2h_gb_per_s: float  # typical measured, pinned host memory
    h2d_gb_per_s: float
    tf32_tflops: float | None = None  # dense tensor-core peaks, where the GPU has them
    bf16_tflops: float | None = None
    sources: tuple[str, ...] = ()

    def peak_tflops(self, math: str) -> float:
        """Peak for 'fp32', 'tf32' or 'bf16' math; a GPU without tensor cores for it runs FP32."""
        if math == "tf32" and self.tf32_tflops:
            return self.tf32_tflops
        if math == "bf16" and self.bf16_tflops:
            return self.bf16_tflops
        if math not in ("fp32", "tf32", "bf16"):
            raise ValueError(f"unknown math {math!r}; use fp32, tf32 or bf16")
        return self.fp32_tflops


GPUS: dict[str, GPU] = {
    gpu.key: gpu
    for gpu in (
        GPU(
            "titanx", "GeForce GTX TITAN X (Maxwell)", 12 * GIB, 6.6, 336.5, "PCIe 3.0 x16", 12.8, 12.8,
            sources=(
                "NVIDIA GTX TITAN X specifications: 3072 CUDA cores at 1075 MHz boost (6.6 TFLOPS FP32), "
                "12 GB GDDR5, 336.5 GB/s",
                "vDNN paper (Rhu et al., MICRO 2016), sec. II-C and V: 'about 7 TFLOPS', 336 GB/s, 12 GB; "
                "DMA cudaMemcpy averages 12.8 GB/s of the 16 GB/s PCIe gen3 maximum",
            ),
        ),
        GPU(
            "p40", "Tesla P40", 24 * GIB, 11.76, 346.0, "PCIe 3.0 x16", 12.0, 11.0,
            sources=(
                "NVIDIA Tesla P40 datasheet: 12 TFLOPS FP32 (3840 cores at 1531 MHz), 24 GB GDDR5, 346 GB/s",
                "MO-SOS paper (Wei et al. 2024), experimental setup: PCIe offload at least 12 GB/s, "
                "prefetch at least 11 GB/s on its P40",
            ),
        ),
        GPU(
            "p100", "Tesla P100 PCIe 16 GB", 16 * GIB, 9.3, 732.0, "PCIe 3.0 x16", 12.0, 12.0,
            sources=(
                "NVIDIA Tesla P100 datasheet (PCIe): 9.3 TFLOPS FP32, 16 GB HBM2, 732 GB/s",
                "typical pinned bandwidthTest on PCIe 3.0 x16 hosts: 12-13 GB/s each way",
            ),
        ),
        GPU(
            "v100", "Tesla V100 SXM2 16 GB", 16 * GIB, 15.7, 900.0, "PCIe 3.0 x16", 12.0, 12.0,
            sources=(
                "NVIDIA V100 datasheet (SXM2): 15.7 TFLOPS FP32, 125 TFLOPS FP16 tensor, 16 GB HBM2, 900 GB/s",
                "host link PCIe 3.0 x16: typical pinned bandwidthTest 12-13 GB/s each way",
            ),
        ),
        GPU(
            "a100", "A100 SXM4 40 GB", 40 * GIB, 19.5, 1555.0, "PCIe 4.0 x16", 24.0, 24.0, tf32_tflops=156.0,
            bf16_tflops=312.0,
            sources=(
                "NVIDIA A100 datasheet: 19.5 TFLOPS FP32, 156 TF32 and 312 BF16 tensor (dense), 40 GB HBM2, "
                "1555 GB/s",
                "host link PCIe 4.0 x16: typical pinned bandwidthTest 24-26 GB/s each way",
            ),
        ),
        GPU(
            "h100", "H100 SXM5 80 GB", 80 * GIB, 67.0, 3350.0, "PCIe 5.0 x16", 50.0, 50.0, tf32_tflops=494.7,
            bf16_tflops=989.4,
            sources=(
                "NVIDIA H100 datasheet (SXM5): 67 TFLOPS FP32, 495 TF32 and 989 BF16 tensor (dense, half the "
                "sparse figures), 80 GB HBM3, 3.35 TB/s",
                "host link PCIe 5.0 x16: typical pinned bandwidthTest about 50-55 GB/s each way",
            ),
        ),
    )
}
ALIASES = {"titan-x": "titanx", "titanx-maxwell": "titanx", "tesla-p40": "p40", "tesla-p100": "p100",
           "tesla-v100": "v100"}


def get_gpu(key: str) -> GPU:
    name = key.lower().strip()
    name = ALIASES.get(name, name)
    if name not in GPUS:
        raise KeyError(f"unknown GPU {key!r}; known: {', '.join(GPUS)}")
    return GPUS[name]

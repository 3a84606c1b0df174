"""GPU presets: what a projection scales by. The H200 is the measured machine; the others are its measured
fractions of the data-sheet figures carried over to their data-sheet figures.

Data-sheet figures (per GPU, SXM): HBM bandwidth, dense bf16 tensor rate (no sparsity), SM count, NVLink bandwidth
per direction.
- H100: 3.35 TB/s, 989 TFLOP/s, 132 SMs, NVLink 4 at 450 GB/s each way (NVIDIA H100 Tensor Core GPU datasheet).
- H200: 4.8 TB/s, 989 TFLOP/s, 132 SMs, NVLink 4 at 450 GB/s each way (NVIDIA H200 Tensor Core GPU datasheet).
- B200: 8 TB/s, 2250 TFLOP/s, 148 SMs, NVLink 5 at 900 GB/s each way (NVIDIA HGX B200 datasheet; the tensor rate as
  tabulated in stas00/ml-engineering's accelerator tables).
- B300 (Blackwell Ultra): 8 TB/s, 2250 TFLOP/s bf16 dense (HGX B300, as tabulated on Glenn Lockwood's B300 page;
  Blackwell Ultra raises FP4, not bf16), 160 SMs (NVIDIA's Blackwell Ultra description at Hot Chips 2025, the full
  part), NVLink 5 at 900 GB/s each way.
"""

from __future__ import annotations

from dataclasses import dataclass

# Measured on the H200 the curves come from: the copy bandwidth of the benchmark runs (bench/results/*: 4.19-4.26
# TB/s, their mean) and the best wgmma rate (bench/results/mma: m64n64k16).
H200_COPY_BYTES_PER_S = 4.23e12
H200_TENSOR_FLOPS = 972e12
H200_SPEC_BYTES_PER_S = 4.8e12
H200_SPEC_TENSOR_FLOPS = 989e12
# NCCL-class collectives over NVLink reach about 80% of the link's one-way rate on large messages (assumption, to be
# replaced by issue 27's measurement).
NVLINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class GpuSpec:
    """What the cost model scales by. `transfer_uncertainty` is the relative error a projection adds because the
    kernels were measured on another GPU: 0 where measured, small for the same architecture, larger where the
    kernels (sm_90a wgmma) would have to be rewritten for the target (tcgen05 on Blackwell)."""

    name: str
    spec_bytes_per_s: float
    spec_tensor_flops: float
    sms: int
    nvlink_bytes_per_s: float  # one direction
    memory_bytes: float
    transfer_uncertainty: float

    @property
    def bytes_per_s(self) -> float:
        """The achievable copy bandwidth: the H200's measured fraction of its data-sheet figure."""
        return self.spec_bytes_per_s * H200_COPY_BYTES_PER_S / H200_SPEC_BYTES_PER_S

    @property
    def tensor_flops(self) -> float:
        return self.spec_tensor_flops * H200_TENSOR_FLOPS / H200_SPEC_TENSOR_FLOPS

    @property
    def collective_bytes_per_s(self) -> float:
        return self.nvlink_bytes_per_s * NVLINK_EFFICIENCY


GPUS = {
    "h200": GpuSpec("H200", 4.8e12, 989e12, 132, 450e9, 141e9, 0.0),
    "h100": GpuSpec("H100", 3.35e12, 989e12, 132, 450e9, 80e9, 0.10),
    "b200": GpuSpec("B200", 8.0e12, 2250e12, 148, 900e9, 180e9, 0.25),
    "b300": GpuSpec("B300", 8.0e12, 2250e12, 160, 900e9, 288e9, 0.25),
}
MEASURED = GPUS["h200"]

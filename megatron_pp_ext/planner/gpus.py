"""The GPUs the plan can price a stage on: their dense tensor-core peaks and memory, from
NVIDIA's data sheets, and the share of the peak a step is assumed to reach. It imports
nothing of the package: the commands read it to list their choices without loading Megatron."""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    fp8_flops: float
    memory_bytes: int  # the data sheet's capacity
    source: str
    #: Transformer Engine's fp8 (delayed, tensorwise) tensors keep a transposed copy beside
    #: the data where the GPU's fp8 GEMMs take only the TN layout (Hopper); Blackwell's do
    #: not (TE ``is_non_tn_fp8_gemm_supported``: compute capability 10.0 up to 12.0)
    fp8_transpose: bool = True


#: Dense (not sparse) tensor-core peaks and capacities from NVIDIA's data sheets (SXM parts).
GPUS = {
    "H100": Gpu("H100", 989 * TERA, 1979 * TERA, 80 * 10**9,
                "NVIDIA H100 SXM data sheet: 989 TFLOPS bf16, 1979 TFLOPS fp8 dense, 80 GB"),
    "H200": Gpu("H200", 989 * TERA, 1979 * TERA, 141 * 10**9,
                "NVIDIA H200 SXM data sheet: 989 TFLOPS bf16, 1979 TFLOPS fp8 dense, 141 GB"),
    "B200": Gpu("B200", 2250 * TERA, 4500 * TERA, 180 * 10**9,
                "NVIDIA HGX B200 data sheet, per GPU: 2.25 PFLOPS bf16, 4.5 PFLOPS fp8 "
                "dense, 180 GB", fp8_transpose=False),
}
#: What a training process holds on a GPU besides the model's tensors, held back from its
#: memory in "fits" (``--reserve``): the CUDA context with cuBLAS and cuDNN (about 0.5 GiB
#: on Hopper), NCCL's buffers (per communicator, NCCL_BUFFSIZE 4 MiB per channel per peer,
#: both ways: a few hundred MiB for each of Megatron's tp, dp, pp and ep groups), and what
#: PyTorch's caching allocator reserves beyond what it hands out (fragmentation: a few per
#: cent of the GPU). An assumption, not a measurement: give a site's own with --reserve.
DEFAULT_RESERVE_BYTES = 4 * 2**30


def gpu_named(name: str) -> Gpu:
    key = str(name).upper()
    if key not in GPUS:
        raise ValueError(f"--gpu {name}: the plan knows {', '.join(GPUS)}; for another GPU "
                         "give measured costs (--costs) or --t-f/--t-i/--t-w")
    return GPUS[key]


__all__ = ["DEFAULT_RESERVE_BYTES", "GPUS", "Gpu", "gpu_named"]

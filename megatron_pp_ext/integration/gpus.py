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


#: Dense (not sparse) tensor-core peaks and capacities from NVIDIA's data sheets (SXM parts).
GPUS = {
    "H100": Gpu("H100", 989 * TERA, 1979 * TERA, 80 * 10**9,
                "NVIDIA H100 SXM data sheet: 989 TFLOPS bf16, 1979 TFLOPS fp8 dense, 80 GB"),
    "H200": Gpu("H200", 989 * TERA, 1979 * TERA, 141 * 10**9,
                "NVIDIA H200 SXM data sheet: 989 TFLOPS bf16, 1979 TFLOPS fp8 dense, 141 GB"),
    "B200": Gpu("B200", 2250 * TERA, 4500 * TERA, 180 * 10**9,
                "NVIDIA HGX B200 data sheet, per GPU: 2.25 PFLOPS bf16, 4.5 PFLOPS fp8 "
                "dense, 180 GB"),
}
#: The share of the peak a well-tuned GPT step reaches (model FLOPs utilization); assumed.
DEFAULT_EFFICIENCY = 0.5


def gpu_named(name: str) -> Gpu:
    key = str(name).upper()
    if key not in GPUS:
        raise ValueError(f"--gpu {name}: the plan knows {', '.join(GPUS)}; for another GPU "
                         "give measured costs (--costs) or --t-f/--t-i/--t-w")
    return GPUS[key]


__all__ = ["DEFAULT_EFFICIENCY", "GPUS", "Gpu", "gpu_named"]
